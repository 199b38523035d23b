//! Atomic, verified checkpoints: `checkpoints/step-N/` holds `model.bpk` (burnpack module
//! record), `optim.bpk` (optimiser state), `state.json` (step, RNG state, task data cursor) and
//! `manifest.json` (size and SHA-256 of each of the three). A checkpoint is written into
//! `checkpoints/.tmp-step-N/` and renamed into place, so a crash never leaves a half-written
//! `step-N`; `state.json` marks a checkpoint complete, `manifest.json` is written last.
//!
//! Everything read back is untrusted (a disk error, a crash of another tool, a hand edit):
//! [`CheckpointManager::verify`] checks, before any tensor is loaded, that every file of the
//! manifest has its recorded size and digest, that `state.json` parses within a size bound, that
//! its step is the folder's `N`, that its RNG state is well-formed, and that the run's
//! `metrics.jsonl` (when there is one) has a row for step `N` (a checkpoint that claims steps the
//! run never logged is refused). Resuming and [`CheckpointManager::resolve`] fall back from a
//! corrupt newest checkpoint to the newest valid one, with a warning that names what was wrong.
//! Checkpoints written before manifests existed load with a warning that they are unverified.

use std::io::Read;
use std::path::{Path, PathBuf};

use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::TrainError;

/// File names inside a checkpoint directory.
pub const MODEL_FILE: &str = "model.bpk";
/// Optimiser state file.
pub const OPTIM_FILE: &str = "optim.bpk";
/// Trainer state file (marks a checkpoint complete).
pub const STATE_FILE: &str = "state.json";
/// Sizes and SHA-256 digests of the other files (written last).
pub const MANIFEST_FILE: &str = "manifest.json";
/// The per-step metrics of the run directory (written by kiln-track's JSONL sink; one JSON object
/// with a `step` field per line). Used to check a checkpoint's step against what the run logged.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// Largest `state.json` / `manifest.json` read (they are a few hundred bytes; the task state is a
/// data cursor). A bigger file is corrupt, and is refused before it is read into memory.
const MAX_JSON_BYTES: u64 = 16 << 20;

/// Serializable state of a ChaCha8 RNG (seed, stream and word position restore it exactly).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RngState {
    /// The 32-byte seed, hex encoded.
    pub seed: String,
    /// Stream id.
    pub stream: u64,
    /// Position in the key stream (in 32-bit words).
    pub word_pos: String,
}

impl RngState {
    /// Capture the state of `rng`.
    pub fn capture(rng: &ChaCha8Rng) -> Self {
        let seed = rng.get_seed();
        Self {
            seed: seed.iter().map(|b| format!("{b:02x}")).collect(),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos().to_string(),
        }
    }

    /// Rebuild the RNG. Any string value is an error or a valid RNG, never a panic.
    pub fn restore(&self) -> Result<ChaCha8Rng, String> {
        use rand::SeedableRng;
        let hex = self.seed.as_bytes();
        if hex.len() != 64 || !hex.iter().all(u8::is_ascii_hexdigit) {
            return Err(format!(
                "rng seed must be 64 hex digits, got {:?}",
                self.seed.chars().take(80).collect::<String>()
            ));
        }
        let digit = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
        let mut seed = [0u8; 32];
        for (i, b) in seed.iter_mut().enumerate() {
            *b = digit(hex[2 * i]) << 4 | digit(hex[2 * i + 1]);
        }
        let pos: u128 = self
            .word_pos
            .parse()
            .map_err(|e| format!("rng word_pos is not an integer: {e}"))?;
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(self.stream);
        rng.set_word_pos(pos);
        Ok(rng)
    }
}

/// Everything besides tensors that a resumed run needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    /// Number of completed training steps.
    pub step: u64,
    /// The trainer RNG after `step` steps.
    pub rng: RngState,
    /// Task state (data cursor, task RNGs, ...), opaque to the trainer.
    pub task: serde_json::Value,
    /// Consecutive non-finite updates at checkpoint time.
    pub nonfinite_streak: u32,
    /// kiln version that wrote the checkpoint.
    pub kiln_version: String,
    /// When the model file holds only part of the policy ([`PolicySubset`]): what the rest is (e.g.
    /// the base model of LoRA adapters). `None`: every parameter is in the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_subset: Option<String>,
}

/// A checkpoint that stores part of the policy: the parameters `group` matches (e.g. LoRA
/// adapters), the rest being `rest` (e.g. "the base model X, sha256 ..."), which the task rebuilds
/// before a checkpoint is loaded. A checkpoint is only loaded over a policy whose `rest` is the
/// same ([`load_model`]), so adapters never land on another base.
#[derive(Debug, Clone)]
pub struct PolicySubset {
    /// The stored parameters.
    pub group: burn::module::ParamGroup,
    /// What the parameters outside `group` are (compared on load).
    pub rest: String,
}

/// Writes `model` to `path`: every parameter, or only `subset.group`'s.
pub fn save_model<M: burn::module::Module>(
    model: M,
    path: &Path,
    subset: Option<&PolicySubset>,
) -> Result<(), TrainError> {
    match subset {
        Some(s) => model.into_record_group(s.group.clone()).save(path),
        None => model.save_file(path),
    }
    .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", path.display())))
}

/// Loads the model file `path` over `model`. `stored` is what the checkpoint says the parameters
/// outside the file are ([`TrainerState::policy_subset`]; `None` = the file is complete), `current`
/// what they are in `model`: a partial file loads only over the same rest (missing parameters
/// keep `model`'s values), a complete file loads over anything with the same parameters.
pub fn load_model<M: burn::module::Module>(
    model: M,
    path: &Path,
    stored: Option<&str>,
    current: Option<&str>,
) -> Result<M, TrainError> {
    let err = |e: String| TrainError::Checkpoint(format!("{}: {e}", path.display()));
    let record = burn::store::ModuleRecord::load(path).map_err(|e| err(e.to_string()))?;
    let record = match (stored, current) {
        (None, _) => record,
        (Some(s), Some(c)) if s == c => record.allow_partial(true),
        (Some(s), c) => {
            return Err(err(format!(
                "this checkpoint holds part of the policy; the rest must be {s}, but the policy it \
                 would load over is {}: rebuild that policy (the recipe's pretrained model, init_dir and \
                 lora settings) or start a new run",
                c.unwrap_or("a complete model")
            )));
        }
    };
    model
        .try_load_record(record)
        .map_err(|e| err(e.to_string()))
}

/// One file of a [`Manifest`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ManifestEntry {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the contents, lowercase hex.
    pub sha256: String,
}

/// `manifest.json`: what a checkpoint directory must hold, byte for byte.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Manifest {
    /// Format version (1).
    pub version: u32,
    /// The files, in the order they were written.
    pub files: Vec<ManifestEntry>,
}

/// Size and SHA-256 (lowercase hex) of a file, streamed in 1 MiB blocks.
pub fn file_digest(path: &Path) -> std::io::Result<(u64, String)> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    let hex = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((n, hex))
}

/// A checkpoint that failed verification: which one and what was wrong.
#[derive(Debug, Clone)]
pub struct Rejected {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// What was wrong.
    pub reason: String,
}

/// Manages `run_dir/checkpoints/`.
#[derive(Debug, Clone)]
pub struct CheckpointManager {
    dir: PathBuf,
    keep: usize,
}

fn io_err(path: &Path, e: std::io::Error) -> TrainError {
    TrainError::Checkpoint(format!("{}: {e}", path.display()))
}

/// Read a small JSON file, refusing one larger than [`MAX_JSON_BYTES`] before reading it.
fn read_small(path: &Path) -> Result<Vec<u8>, String> {
    let len = std::fs::metadata(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if len > MAX_JSON_BYTES {
        return Err(format!(
            "{} is {len} bytes, more than the {MAX_JSON_BYTES} a checkpoint's JSON may have (corrupt)",
            path.display()
        ));
    }
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The highest `step` of a `metrics.jsonl` (lines that do not parse are skipped: a crash can leave
/// a torn last line). Reads line by line with a bound per line.
fn max_logged_step(path: &Path) -> Result<Option<u64>, String> {
    use std::io::BufRead;
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut r = std::io::BufReader::new(f);
    let mut line = Vec::new();
    let mut best = None;
    loop {
        line.clear();
        // A metrics row is a few KB; 1 MiB bounds the memory a corrupt file can take.
        let n = (&mut r)
            .take(1 << 20)
            .read_until(b'\n', &mut line)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if n == 0 {
            break;
        }
        if line.last() != Some(&b'\n') && n == 1 << 20 {
            // Skip the rest of an over-long line.
            let mut sink = Vec::new();
            loop {
                sink.clear();
                let k = (&mut r)
                    .take(1 << 20)
                    .read_until(b'\n', &mut sink)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                if k == 0 || sink.last() == Some(&b'\n') {
                    break;
                }
            }
            continue;
        }
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&line)
            && let Some(s) = v.get("step").and_then(serde_json::Value::as_u64)
        {
            best = Some(best.map_or(s, |b: u64| b.max(s)));
        }
    }
    Ok(best)
}

impl CheckpointManager {
    /// Checkpoints under `run_dir/checkpoints`, keeping the newest `keep` (at least 1).
    pub fn new(run_dir: &Path, keep: usize) -> Self {
        Self {
            dir: run_dir.join("checkpoints"),
            keep: keep.max(1),
        }
    }

    /// The checkpoints directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Complete checkpoints (those with a `state.json`), oldest first. Not verified: see
    /// [`CheckpointManager::verify`].
    pub fn list(&self) -> Vec<(u64, PathBuf)> {
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return out;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(n) = name.strip_prefix("step-")
                && let Ok(step) = n.parse::<u64>()
                && e.path().join(STATE_FILE).is_file()
            {
                out.push((step, e.path()));
            }
        }
        out.sort();
        out
    }

    /// The newest complete checkpoint (not verified).
    pub fn latest(&self) -> Option<(u64, PathBuf)> {
        self.list().pop()
    }

    /// Complete checkpoints, newest first, each verified ([`CheckpointManager::verify`] with this
    /// manager's run directory) as the iterator reaches it: `Ok` with its state, or the reason it
    /// was rejected. Lazy, so that a caller that stops at the first valid one hashes no older one.
    pub fn newest_first(
        &self,
    ) -> impl Iterator<Item = Result<(u64, PathBuf, TrainerState), Rejected>> + use<> {
        let run_dir = self.dir.parent().map(Path::to_path_buf);
        self.list().into_iter().rev().map(move |(step, dir)| {
            match Self::verify(&dir, run_dir.as_deref()) {
                Ok(st) => Ok((step, dir, st)),
                Err(reason) => Err(Rejected { dir, reason }),
            }
        })
    }

    /// Write a checkpoint atomically. `write_tensors` writes the model and optimiser files into the
    /// given (temporary) directory.
    pub fn save(
        &self,
        state: &TrainerState,
        write_tensors: impl FnOnce(&Path) -> Result<(), TrainError>,
    ) -> Result<PathBuf, TrainError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| io_err(&self.dir, e))?;
        let final_dir = self.dir.join(format!("step-{}", state.step));
        let tmp = self.dir.join(format!(".tmp-step-{}", state.step));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
        write_tensors(&tmp)?;
        let json = serde_json::to_vec_pretty(state)
            .map_err(|e| TrainError::Checkpoint(format!("serialising state: {e}")))?;
        let state_path = tmp.join(STATE_FILE);
        std::fs::write(&state_path, json).map_err(|e| io_err(&state_path, e))?;
        let mut files = Vec::new();
        for name in [MODEL_FILE, OPTIM_FILE, STATE_FILE] {
            let p = tmp.join(name);
            if !p.is_file() {
                continue;
            }
            let (bytes, sha256) = file_digest(&p).map_err(|e| io_err(&p, e))?;
            if let Ok(f) = std::fs::File::open(&p) {
                let _ = f.sync_all();
            }
            files.push(ManifestEntry {
                name: name.to_string(),
                bytes,
                sha256,
            });
        }
        let manifest = serde_json::to_vec_pretty(&Manifest { version: 1, files })
            .map_err(|e| TrainError::Checkpoint(format!("serialising manifest: {e}")))?;
        let mp = tmp.join(MANIFEST_FILE);
        std::fs::write(&mp, manifest).map_err(|e| io_err(&mp, e))?;
        if let Ok(f) = std::fs::File::open(&mp) {
            let _ = f.sync_all();
        }
        if final_dir.exists() {
            std::fs::remove_dir_all(&final_dir).map_err(|e| io_err(&final_dir, e))?;
        }
        std::fs::rename(&tmp, &final_dir).map_err(|e| io_err(&final_dir, e))?;
        self.prune();
        Ok(final_dir)
    }

    fn prune(&self) {
        let all = self.list();
        if all.len() > self.keep {
            for (_, p) in &all[..all.len() - self.keep] {
                if let Err(e) = std::fs::remove_dir_all(p) {
                    tracing::warn!("could not remove old checkpoint {}: {e}", p.display());
                }
            }
        }
    }

    /// Check a checkpoint directory before anything is loaded from it, and return its state:
    /// the manifest's files have their recorded sizes and SHA-256 (a checkpoint without a manifest,
    /// written by an older kiln, passes with a warning), `state.json` parses, its step equals the
    /// `N` of a `step-N` folder, its RNG state restores, and when `run_dir` holds a
    /// `metrics.jsonl`, the run logged step `N`. The error says what was wrong, in which file.
    pub fn verify(dir: &Path, run_dir: Option<&Path>) -> Result<TrainerState, String> {
        let mp = dir.join(MANIFEST_FILE);
        if mp.is_file() {
            let bytes = read_small(&mp)?;
            let m: Manifest = serde_json::from_slice(&bytes)
                .map_err(|e| format!("{}: not a checkpoint manifest: {e}", mp.display()))?;
            for need in [MODEL_FILE, STATE_FILE] {
                if !m.files.iter().any(|f| f.name == need) {
                    return Err(format!("{}: does not list {need}", mp.display()));
                }
            }
            for f in &m.files {
                if f.name.contains(['/', '\\']) || f.name == ".." {
                    return Err(format!("{}: bad file name {:?}", mp.display(), f.name));
                }
                let p = dir.join(&f.name);
                let len = std::fs::metadata(&p)
                    .map_err(|e| format!("{}: {e} (listed in {MANIFEST_FILE})", p.display()))?
                    .len();
                if len != f.bytes {
                    return Err(format!(
                        "{} is {len} bytes, the manifest says {} (truncated or replaced)",
                        p.display(),
                        f.bytes
                    ));
                }
                let (_, sha) = file_digest(&p).map_err(|e| format!("{}: {e}", p.display()))?;
                if sha != f.sha256 {
                    return Err(format!(
                        "{}: SHA-256 {sha} differs from the manifest's {} (the file was modified or \
                         the disk corrupted it)",
                        p.display(),
                        f.sha256
                    ));
                }
            }
        } else {
            tracing::warn!(
                "{} has no {MANIFEST_FILE} (written by an older kiln): its files are not verified",
                dir.display()
            );
        }
        let sp = dir.join(STATE_FILE);
        let state: TrainerState = serde_json::from_slice(&read_small(&sp)?)
            .map_err(|e| format!("{}: corrupt state: {e}", sp.display()))?;
        if let Some(n) = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<u64>().ok())
            && n != state.step
        {
            return Err(format!(
                "{}: step {} does not match the folder step-{n}",
                sp.display(),
                state.step
            ));
        }
        state
            .rng
            .restore()
            .map_err(|e| format!("{}: {e}", sp.display()))?;
        if let Some(run) = run_dir {
            let metrics = run.join(METRICS_FILE);
            if metrics.is_file() {
                let logged = max_logged_step(&metrics)?;
                if logged.is_none_or(|s| s < state.step) {
                    return Err(format!(
                        "{}: step {} was never logged in {} (last logged step: {}); the checkpoint \
                         claims steps the run did not make",
                        sp.display(),
                        state.step,
                        metrics.display(),
                        logged.map_or("none".to_string(), |s| s.to_string())
                    ));
                }
            }
        }
        Ok(state)
    }

    /// The checkpoint a user names: `path` itself when it holds a model file (`step-N/`; it must
    /// verify), else the newest valid checkpoint of the run directory `path` (newer corrupt ones
    /// are skipped with a warning). Every command that takes "a checkpoint or a run directory"
    /// resolves it here.
    pub fn resolve(path: &Path) -> Result<PathBuf, TrainError> {
        if path.join(MODEL_FILE).is_file() {
            return Self::verify(path, None)
                .map(|_| path.to_path_buf())
                .map_err(|e| {
                    TrainError::Checkpoint(format!("{} is corrupt: {e}", path.display()))
                });
        }
        let m = CheckpointManager::new(path, 1);
        let mut rejected = Vec::new();
        for c in m.newest_first() {
            match c {
                Ok((_, dir, _)) => {
                    for r in &rejected {
                        warn_rejected(r, &dir);
                    }
                    return Ok(dir);
                }
                Err(r) => rejected.push(r),
            }
        }
        if !rejected.is_empty() {
            return Err(TrainError::Checkpoint(no_valid_message(path, &rejected)));
        }
        Err(TrainError::Checkpoint(format!(
            "{} is neither a checkpoint directory (with {MODEL_FILE}) nor a run directory \
             with checkpoints",
            path.display()
        )))
    }

    /// The run directory of a checkpoint directory (`<run>/checkpoints/step-N` -> `<run>`).
    pub fn run_dir_of(checkpoint: &Path) -> Option<PathBuf> {
        checkpoint.parent()?.parent().map(Path::to_path_buf)
    }

    /// Read the trainer state of a checkpoint directory (bounded size; not otherwise verified).
    pub fn read_state(dir: &Path) -> Result<TrainerState, TrainError> {
        let p = dir.join(STATE_FILE);
        let bytes = read_small(&p).map_err(TrainError::Checkpoint)?;
        serde_json::from_slice(&bytes)
            .map_err(|e| TrainError::Checkpoint(format!("{}: corrupt state: {e}", p.display())))
    }
}

/// The warning for a checkpoint skipped in favour of `used`.
pub fn warn_rejected(r: &Rejected, used: &Path) {
    tracing::warn!(
        "skipping the corrupt checkpoint {} ({}); using {}",
        r.dir.display(),
        r.reason,
        used.display()
    );
}

/// The error when every checkpoint of `run` was rejected.
pub fn no_valid_message(run: &Path, rejected: &[Rejected]) -> String {
    let list: Vec<String> = rejected
        .iter()
        .map(|r| format!("  {}: {}", r.dir.display(), r.reason))
        .collect();
    format!(
        "no valid checkpoint in {}:\n{}\n(delete the corrupt step-* folders to start the run over, or \
         restore them from a backup)",
        run.display(),
        list.join("\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng};

    #[derive(burn::module::Module, Debug)]
    struct TwoPart {
        base: burn::nn::Linear,
        head_lora: burn::nn::Linear,
    }

    fn two_part(seed: u64) -> TwoPart {
        let device = burn::tensor::Device::flex();
        device.seed(seed);
        TwoPart {
            base: burn::nn::LinearConfig::new(4, 3).init(&device),
            head_lora: burn::nn::LinearConfig::new(3, 2).init(&device),
        }
    }

    fn values(l: &burn::nn::Linear) -> Vec<f32> {
        l.weight.val().into_data().try_to_vec::<f32>().unwrap()
    }

    /// A subset checkpoint stores only its group, loads over a freshly built module (new
    /// parameter ids) with the same `rest`, keeps the module's own values elsewhere, and refuses
    /// another or no rest; a complete file loads every parameter.
    #[test]
    fn subset_checkpoints_store_their_group_and_load_only_over_the_same_rest() {
        let dir = tempfile::tempdir().unwrap();
        let subset = PolicySubset {
            group: burn::module::ParamGroup::from_predicate("_lora"),
            rest: "base X".into(),
        };
        let saved = two_part(1);
        let (saved_base, saved_head) = (values(&saved.base), values(&saved.head_lora));
        let part = dir.path().join("part.bpk");
        save_model(saved.clone(), &part, Some(&subset)).unwrap();
        let full = dir.path().join("full.bpk");
        save_model(saved, &full, None).unwrap();
        assert!(
            std::fs::metadata(&part).unwrap().len() < std::fs::metadata(&full).unwrap().len() / 2,
            "the subset file holds the small group only"
        );
        let fresh = two_part(2);
        let fresh_base = values(&fresh.base);
        assert_ne!(fresh_base, saved_base);
        let loaded = load_model(fresh.clone(), &part, Some("base X"), Some("base X")).unwrap();
        assert_eq!(values(&loaded.head_lora), saved_head);
        assert_eq!(values(&loaded.base), fresh_base);
        for current in [Some("base Y"), None] {
            let e = load_model(fresh.clone(), &part, Some("base X"), current)
                .unwrap_err()
                .to_string();
            assert!(e.contains("base X") && e.contains("part.bpk"), "{e}");
        }
        // A subset file read as a complete one is refused (parameters missing).
        assert!(load_model(fresh.clone(), &part, None, None).is_err());
        let loaded = load_model(fresh, &full, None, Some("base X")).unwrap();
        assert_eq!(values(&loaded.base), saved_base);
        assert_eq!(values(&loaded.head_lora), saved_head);
    }

    fn state(step: u64) -> TrainerState {
        TrainerState {
            step,
            rng: RngState::capture(&ChaCha8Rng::seed_from_u64(0)),
            task: serde_json::json!({"cursor": step}),
            nonfinite_streak: 0,
            kiln_version: "t".into(),
            policy_subset: None,
        }
    }

    /// A run directory with checkpoints at `steps` (fake tensor files) and a metrics row per step
    /// up to the last one.
    fn run_with(steps: &[u64]) -> (tempfile::TempDir, CheckpointManager) {
        let d = tempfile::tempdir().unwrap();
        let m = CheckpointManager::new(d.path(), 10);
        for &step in steps {
            m.save(&state(step), |p| {
                std::fs::write(p.join(MODEL_FILE), vec![step as u8; 1000]).unwrap();
                std::fs::write(p.join(OPTIM_FILE), b"optim").unwrap();
                Ok(())
            })
            .unwrap();
        }
        let last = steps.iter().max().copied().unwrap_or(0);
        let rows: String = (1..=last).map(|s| format!("{{\"step\":{s}}}\n")).collect();
        std::fs::write(d.path().join(METRICS_FILE), rows).unwrap();
        (d, m)
    }

    fn verified(m: &CheckpointManager) -> Vec<Result<u64, String>> {
        m.newest_first()
            .map(|c| c.map(|(s, _, _)| s).map_err(|r| r.reason))
            .collect()
    }

    #[test]
    fn rng_roundtrip_continues_the_stream() {
        let mut a = ChaCha8Rng::seed_from_u64(7);
        for _ in 0..13 {
            a.next_u32();
        }
        let mut b = RngState::capture(&a).restore().unwrap();
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
    }

    /// Before: a 64-byte seed with a multi-byte character panicked (string slicing at a non-char
    /// boundary). Every seed string is now an error or an RNG.
    #[test]
    fn any_rng_seed_string_is_an_error_not_a_panic() {
        let ok = RngState::capture(&ChaCha8Rng::seed_from_u64(1));
        for seed in [
            format!("é{}", &ok.seed[2..]),
            format!("{}é", &ok.seed[..62]),
            "zz".repeat(32),
            String::new(),
            "0".repeat(65),
            "🦀".repeat(16),
        ] {
            let s = RngState { seed, ..ok.clone() };
            assert!(s.restore().is_err(), "{:?}", s.seed);
        }
        let s = RngState {
            word_pos: "-1".into(),
            ..ok.clone()
        };
        assert!(s.restore().is_err());
        assert!(ok.restore().is_ok());
    }

    #[test]
    fn save_is_atomic_and_prunes() {
        let d = tempfile::tempdir().unwrap();
        let m = CheckpointManager::new(d.path(), 2);
        for step in [1, 2, 3] {
            m.save(&state(step), |p| {
                std::fs::write(p.join(MODEL_FILE), b"x").unwrap();
                Ok(())
            })
            .unwrap();
        }
        let steps: Vec<u64> = m.list().iter().map(|x| x.0).collect();
        assert_eq!(steps, vec![2, 3]);
        // A half-written checkpoint (no state.json) is ignored.
        std::fs::create_dir_all(m.dir().join("step-9")).unwrap();
        assert_eq!(m.latest().unwrap().0, 3);
        let st = CheckpointManager::read_state(&m.latest().unwrap().1).unwrap();
        assert_eq!(st.task["cursor"], 3);
        let man: Manifest = serde_json::from_slice(
            &std::fs::read(m.latest().unwrap().1.join(MANIFEST_FILE)).unwrap(),
        )
        .unwrap();
        let names: Vec<&str> = man.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, [MODEL_FILE, STATE_FILE]);
    }

    /// One flipped byte in the newest checkpoint's weights: it is rejected with the file and the
    /// digests named, and the previous checkpoint is the newest valid one.
    #[test]
    fn a_flipped_weight_byte_is_detected_and_the_previous_checkpoint_used() {
        let (d, m) = run_with(&[4, 8]);
        assert_eq!(verified(&m), vec![Ok(8), Ok(4)]);
        let p = m.dir().join("step-8").join(MODEL_FILE);
        let mut b = std::fs::read(&p).unwrap();
        b[500] ^= 0x10;
        std::fs::write(&p, b).unwrap();
        let v = verified(&m);
        let e = v[0].as_ref().unwrap_err();
        assert!(e.contains("model.bpk") && e.contains("SHA-256"), "{e}");
        assert_eq!(v[1], Ok(4));
        let chosen = CheckpointManager::resolve(d.path()).unwrap();
        assert!(chosen.ends_with("step-4"), "{}", chosen.display());
        // Naming the corrupt checkpoint itself is an error.
        let e = CheckpointManager::resolve(&m.dir().join("step-8")).unwrap_err();
        assert!(e.to_string().contains("corrupt"), "{e}");
        // A truncated file is reported by size.
        std::fs::write(&p, b"short").unwrap();
        let e = verified(&m)[0].clone().unwrap_err();
        assert!(e.contains("5 bytes"), "{e}");
    }

    /// Before: `state.step` edited 15 -> 35 resumed at 35 and silently skipped 20 steps. Now the
    /// step must equal the folder's and must have been logged.
    #[test]
    fn the_state_step_must_match_the_folder_and_the_metrics() {
        let (d, m) = run_with(&[4, 8]);
        let dir = m.dir().join("step-8");
        // An edited step (the manifest is removed too, as a careful editor would).
        std::fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
        let sp = dir.join(STATE_FILE);
        let mut st = CheckpointManager::read_state(&dir).unwrap();
        st.step = 35;
        std::fs::write(&sp, serde_json::to_vec(&st).unwrap()).unwrap();
        let e = verified(&m)[0].clone().unwrap_err();
        assert!(e.contains("does not match the folder step-8"), "{e}");
        // The folder renamed to match: the run never logged step 35.
        std::fs::rename(&dir, m.dir().join("step-35")).unwrap();
        let e = verified(&m)[0].clone().unwrap_err();
        assert!(e.contains("never logged"), "{e}");
        // Without a metrics file (logging.jsonl off) the folder check still holds.
        std::fs::remove_file(d.path().join(METRICS_FILE)).unwrap();
        assert_eq!(verified(&m)[0], Ok(35));
        assert_eq!(verified(&m)[1], Ok(4));
    }

    #[test]
    fn garbage_state_and_manifest_files_are_errors() {
        let (_d, m) = run_with(&[2]);
        let dir = m.dir().join("step-2");
        for (file, bytes) in [
            (MANIFEST_FILE, b"{\"version\": 1, \"files\": [{\"name\": \"../x\", \"bytes\": 1, \"sha256\": \"0\"}]}".to_vec()),
            (MANIFEST_FILE, b"not json".to_vec()),
            (MANIFEST_FILE, b"{\"version\": 1, \"files\": []}".to_vec()),
        ] {
            std::fs::write(dir.join(file), bytes).unwrap();
            assert!(verified(&m)[0].is_err());
        }
        std::fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
        let sp = dir.join(STATE_FILE);
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&sp).unwrap()).unwrap();
        v["rng"]["seed"] = serde_json::json!("é".repeat(32));
        std::fs::write(&sp, serde_json::to_vec(&v).unwrap()).unwrap();
        let e = verified(&m)[0].clone().unwrap_err();
        assert!(e.contains("hex"), "{e}");
        std::fs::write(&sp, b"{\"step\": -1}").unwrap();
        assert!(verified(&m)[0].is_err());
        // An oversized state.json is refused before it is read.
        let f = std::fs::File::create(&sp).unwrap();
        f.set_len(MAX_JSON_BYTES + 1).unwrap();
        let e = verified(&m)[0].clone().unwrap_err();
        assert!(e.contains("more than"), "{e}");
    }
}
