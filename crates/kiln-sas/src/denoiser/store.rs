//! The denoiser store: a denoiser folder holds `denoiser.bpk` (weights), `denoiser.json` (its
//! config, written last: its presence marks a complete save) and `pretrain.json` (how the weights
//! were pre-trained, [`PretrainRecord`]); a `sas` run records which weights it froze
//! (`denoiser_source.json`, an FNV-1a digest of the weights file) so that a policy is never
//! continued or evaluated against a denoiser re-trained in the same folder since.

use std::path::Path;

use burn::module::Module;
use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use super::pretrain::PretrainConfig;
use super::{DenoiserConfig, DenoiserError, SudokuDenoiser, check_denoiser_config};
use crate::sudoku::Shape;

/// File name of the denoiser weights inside a denoiser directory.
pub const DENOISER_FILE: &str = "denoiser.bpk";
/// File name of the denoiser's model config (JSON) next to the weights.
pub const DENOISER_CONFIG_FILE: &str = "denoiser.json";

/// File in a denoiser folder recording how its weights were pre-trained.
pub const PRETRAIN_RECORD_FILE: &str = "pretrain.json";

/// How the weights in a denoiser folder were made: written by [`pretrain`] at every snapshot and
/// at the end, so that a recipe can tell a finished pre-training from an interrupted one and
/// from one made under other settings (instead of silently freezing the wrong denoiser).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PretrainRecord {
    /// The run seed.
    pub seed: u64,
    /// Optimiser steps behind the saved weights.
    pub steps_done: u64,
    /// True once all `pretrain.steps` are done and the final weights are saved.
    pub complete: bool,
    /// Mean loss over the last 10% of steps (complete runs only).
    pub final_loss: Option<f64>,
    /// The denoiser architecture.
    pub model: serde_json::Value,
    /// The pre-training settings (`log_every` / `save_every` left out: they do not change the
    /// weights).
    pub pretrain: serde_json::Value,
}

impl PretrainRecord {
    fn settings(
        model: &DenoiserConfig,
        cfg: &PretrainConfig,
    ) -> (serde_json::Value, serde_json::Value) {
        let m = serde_json::to_value(model).unwrap_or_default();
        let mut p = serde_json::to_value(cfg).unwrap_or_default();
        if let Some(o) = p.as_object_mut() {
            o.remove("log_every");
            o.remove("save_every");
        }
        (m, p)
    }

    /// The record of a pre-training of `model` with `cfg` and `seed`, `steps_done` steps in.
    pub fn new(
        model: &DenoiserConfig,
        cfg: &PretrainConfig,
        seed: u64,
        steps_done: u64,
        final_loss: Option<f64>,
    ) -> Self {
        let (m, p) = Self::settings(model, cfg);
        Self {
            seed,
            steps_done,
            complete: final_loss.is_some() && steps_done >= cfg.steps,
            final_loss,
            model: m,
            pretrain: p,
        }
    }

    /// Read `dir/pretrain.json`; `Ok(None)` when the folder has no record (a denoiser saved by
    /// other means).
    pub fn load(dir: &Path) -> Result<Option<Self>, DenoiserError> {
        let path = dir.join(PRETRAIN_RECORD_FILE);
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|e| DenoiserError::Io {
            path: path.clone(),
            msg: e.to_string(),
        })?;
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| DenoiserError::Shape {
                path,
                msg: format!("not a pre-training record ({e}); delete the file or the folder"),
            })
    }

    /// Write `dir/pretrain.json` atomically.
    pub fn save(&self, dir: &Path) -> Result<(), DenoiserError> {
        let path = dir.join(PRETRAIN_RECORD_FILE);
        let tmp = dir.join(".tmp-pretrain.json");
        let io = |p: &Path, e: String| DenoiserError::Io {
            path: p.to_path_buf(),
            msg: e,
        };
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e.to_string()))?;
        let json = serde_json::to_vec_pretty(self).map_err(|e| io(&path, e.to_string()))?;
        std::fs::write(&tmp, json).map_err(|e| io(&tmp, e.to_string()))?;
        std::fs::rename(&tmp, &path).map_err(|e| io(&path, e.to_string()))
    }

    /// The settings in which this record differs from a pre-training of `model` with `cfg` and
    /// `seed`, as `field: recorded -> asked` lines (empty = same settings).
    pub fn differences(
        &self,
        model: &DenoiserConfig,
        cfg: &PretrainConfig,
        seed: u64,
    ) -> Vec<String> {
        let (m, p) = Self::settings(model, cfg);
        let mut out = Vec::new();
        if self.seed != seed {
            out.push(format!("seed: {} -> {}", self.seed, seed));
        }
        diff_values("model", &self.model, &m, &mut out);
        diff_values("pretrain", &self.pretrain, &p, &mut out);
        out
    }
}

fn diff_values(path: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    match (a, b) {
        (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let null = serde_json::Value::Null;
                diff_values(
                    &format!("{path}.{k}"),
                    x.get(k).unwrap_or(&null),
                    y.get(k).unwrap_or(&null),
                    out,
                );
            }
        }
        _ if a != b => out.push(format!("{path}: {a} -> {b}")),
        _ => {}
    }
}

/// Save `model` as `dir/denoiser.bpk` plus its config `dir/denoiser.json` (atomically: written
/// to temporary names, then renamed; the config last, so its presence marks a complete save).
pub fn save_denoiser(model: &SudokuDenoiser, dir: &Path) -> Result<(), DenoiserError> {
    let io = |path: &Path, e: String| DenoiserError::Io {
        path: path.to_path_buf(),
        msg: e,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e.to_string()))?;
    let tmp = dir.join(".tmp-denoiser.bpk");
    model
        .clone()
        .save_file(&tmp)
        .map_err(|e| io(&tmp, e.to_string()))?;
    let wp = dir.join(DENOISER_FILE);
    std::fs::rename(&tmp, &wp).map_err(|e| io(&wp, e.to_string()))?;
    let cp = dir.join(DENOISER_CONFIG_FILE);
    let tmpc = dir.join(".tmp-denoiser.json");
    let json = serde_json::to_vec_pretty(model.config()).map_err(|e| io(&cp, e.to_string()))?;
    std::fs::write(&tmpc, json).map_err(|e| io(&tmpc, e.to_string()))?;
    std::fs::rename(&tmpc, &cp).map_err(|e| io(&cp, e.to_string()))?;
    Ok(())
}

/// True when `dir` holds a complete denoiser checkpoint.
pub fn denoiser_exists(dir: &Path) -> bool {
    dir.join(DENOISER_FILE).is_file() && dir.join(DENOISER_CONFIG_FILE).is_file()
}

/// Load a denoiser saved by [`save_denoiser`] onto `device`, checking that it is a Sudoku
/// denoiser for `shape`. A weights file that does not match its config (or is not a burnpack
/// file) is a [`DenoiserError::Shape`] naming the file.
pub fn load_denoiser(
    dir: &Path,
    shape: Shape,
    device: &Device,
) -> Result<SudokuDenoiser, DenoiserError> {
    let cp = dir.join(DENOISER_CONFIG_FILE);
    let text = std::fs::read_to_string(&cp).map_err(|e| DenoiserError::Io {
        path: cp.clone(),
        msg: format!("{e} (train one with `kiln train recipes/mdm_sudoku.yaml`)"),
    })?;
    let cfg: DenoiserConfig = serde_json::from_str(&text).map_err(|e| DenoiserError::Shape {
        path: cp.clone(),
        msg: format!("not a Sudoku denoiser config: {e}"),
    })?;
    check_denoiser_config(&cfg, shape).map_err(|m| DenoiserError::Shape {
        path: cp.clone(),
        msg: m,
    })?;
    let wp = dir.join(DENOISER_FILE);
    if !wp.is_file() {
        return Err(DenoiserError::Io {
            path: wp,
            msg: "missing denoiser weights".into(),
        });
    }
    let model = cfg.init(device);
    model.try_load_file(&wp).map_err(|e| DenoiserError::Shape {
        path: wp.clone(),
        msg: format!("the weights do not fit the model of {}: {e}", cp.display()),
    })
}

/// File in a `sas` run directory naming the frozen denoiser the policy was trained against.
pub const DENOISER_SOURCE_FILE: &str = "denoiser_source.json";

fn io(path: &Path, e: impl std::fmt::Display) -> DenoiserError {
    DenoiserError::Io {
        path: path.to_path_buf(),
        msg: e.to_string(),
    }
}

/// A digest of the denoiser weights in `dir` (FNV-1a of the weights file, 16 hex digits).
pub fn denoiser_digest(dir: &Path) -> Result<String, DenoiserError> {
    let p = dir.join(DENOISER_FILE);
    let bytes = std::fs::read(&p).map_err(|e| io(&p, e))?;
    Ok(kiln_rl::digest::fnv1a_hex(&bytes))
}

/// Check that the denoiser in `denoiser_dir` is the one the run in `run_dir` recorded (runs
/// made before the record existed pass), so that a policy is never evaluated or continued
/// against a denoiser that was re-trained in the same folder since.
pub fn check_denoiser_source(run_dir: &Path, denoiser_dir: &Path) -> Result<(), DenoiserError> {
    let Some(p) = run_dir
        .ancestors()
        .take(4)
        .map(|d| d.join(DENOISER_SOURCE_FILE))
        .find(|p| p.is_file())
    else {
        return Ok(());
    };
    let text = std::fs::read_to_string(&p).map_err(|e| io(&p, e))?;
    let rec: serde_json::Value = serde_json::from_str(&text).map_err(|e| io(&p, e))?;
    let want = rec
        .get("weights_fnv1a")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    let have = denoiser_digest(denoiser_dir)?;
    if want != have {
        return Err(DenoiserError::Source(format!(
            "the denoiser in {} (weights digest {have}) is not the one this run's policy was trained \
             against ({} records {want}): it was re-trained or replaced since. Restore those weights, \
             point `denoiser_dir` at them, or train the policy again.",
            denoiser_dir.display(),
            p.display()
        )));
    }
    Ok(())
}

/// Record in `run_dir` which denoiser weights (folder and digest) the run freezes.
pub fn record_denoiser_source(run_dir: &Path, denoiser_dir: &Path) -> Result<(), DenoiserError> {
    let rec = serde_json::json!({
        "denoiser_dir": denoiser_dir.display().to_string(),
        "weights_fnv1a": denoiser_digest(denoiser_dir)?,
    });
    std::fs::create_dir_all(run_dir).map_err(|e| io(run_dir, e))?;
    let p = run_dir.join(DENOISER_SOURCE_FILE);
    let bytes = serde_json::to_vec_pretty(&rec).map_err(|e| io(&p, e))?;
    std::fs::write(&p, bytes).map_err(|e| io(&p, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::denoiser::tiny_denoiser_config;

    #[test]
    fn wrong_shape_checkpoint_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let device = Device::flex();
        let model = tiny_denoiser_config(Shape::NINE).init(&device);
        save_denoiser(&model, dir.path()).unwrap();
        // Config says width 64 but the weights are width 32.
        let mut cfg = tiny_denoiser_config(Shape::NINE);
        cfg.d_model = 64;
        std::fs::write(
            dir.path().join(DENOISER_CONFIG_FILE),
            serde_json::to_vec(&cfg).unwrap(),
        )
        .unwrap();
        let err = load_denoiser(dir.path(), Shape::NINE, &device).unwrap_err();
        assert!(matches!(err, DenoiserError::Shape { .. }), "{err}");
        assert!(err.to_string().contains("denoiser.bpk"), "{err}");
        // A 4x4 denoiser is not a 9x9 denoiser.
        let m4 = tiny_denoiser_config(Shape::FOUR).init(&device);
        save_denoiser(&m4, dir.path()).unwrap();
        let err = load_denoiser(dir.path(), Shape::NINE, &device).unwrap_err();
        assert!(err.to_string().contains("side"), "{err}");
    }
}
