//! Atomic checkpoints: `checkpoints/step-N/` holds `model.bpk` (burnpack module record),
//! `optim.bpk` (optimiser state) and `state.json` (step, RNG state, task data cursor). A checkpoint
//! is written into `checkpoints/.tmp-step-N/` and renamed into place, so a crash never leaves a
//! half-written `step-N`; `state.json` is written last and marks a checkpoint complete.

use std::path::{Path, PathBuf};

use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::TrainError;

/// File names inside a checkpoint directory.
pub const MODEL_FILE: &str = "model.bpk";
/// Optimiser state file.
pub const OPTIM_FILE: &str = "optim.bpk";
/// Trainer state file (written last).
pub const STATE_FILE: &str = "state.json";

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

    /// Rebuild the RNG.
    pub fn restore(&self) -> Result<ChaCha8Rng, String> {
        use rand::SeedableRng;
        if self.seed.len() != 64 {
            return Err(format!(
                "rng seed must be 64 hex chars, got {}",
                self.seed.len()
            ));
        }
        let mut seed = [0u8; 32];
        for (i, b) in seed.iter_mut().enumerate() {
            *b = u8::from_str_radix(&self.seed[2 * i..2 * i + 2], 16)
                .map_err(|e| format!("rng seed is not hex: {e}"))?;
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

    /// Complete checkpoints (those with a `state.json`), oldest first.
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

    /// The newest complete checkpoint.
    pub fn latest(&self) -> Option<(u64, PathBuf)> {
        self.list().pop()
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
        if let Ok(f) = std::fs::File::open(&state_path) {
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

    /// The checkpoint a user names: `path` itself when it holds a model file (`step-N/`), else
    /// the newest complete checkpoint of the run directory `path`. Every command that takes "a
    /// checkpoint or a run directory" resolves it here.
    pub fn resolve(path: &Path) -> Result<PathBuf, TrainError> {
        if path.join(MODEL_FILE).is_file() {
            return Ok(path.to_path_buf());
        }
        CheckpointManager::new(path, 1)
            .latest()
            .map(|(_, p)| p)
            .ok_or_else(|| {
                TrainError::Checkpoint(format!(
                    "{} is neither a checkpoint directory (with {MODEL_FILE}) nor a run directory \
                     with checkpoints",
                    path.display()
                ))
            })
    }

    /// The run directory of a checkpoint directory (`<run>/checkpoints/step-N` -> `<run>`).
    pub fn run_dir_of(checkpoint: &Path) -> Option<PathBuf> {
        checkpoint.parent()?.parent().map(Path::to_path_buf)
    }

    /// Read the trainer state of a checkpoint directory.
    pub fn read_state(dir: &Path) -> Result<TrainerState, TrainError> {
        let p = dir.join(STATE_FILE);
        let bytes = std::fs::read(&p).map_err(|e| io_err(&p, e))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| TrainError::Checkpoint(format!("{}: corrupt state: {e}", p.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng};

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

    #[test]
    fn save_is_atomic_and_prunes() {
        let d = tempfile::tempdir().unwrap();
        let m = CheckpointManager::new(d.path(), 2);
        for step in [1, 2, 3] {
            let st = TrainerState {
                step,
                rng: RngState::capture(&ChaCha8Rng::seed_from_u64(0)),
                task: serde_json::json!({"cursor": step}),
                nonfinite_streak: 0,
                kiln_version: "t".into(),
            };
            m.save(&st, |p| {
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
    }
}
