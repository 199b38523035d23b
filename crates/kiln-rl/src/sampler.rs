//! The epoch-shuffled data cursor every task draws its training examples with.
//!
//! An [`EpochSampler`] walks a fresh permutation of `0..len` per epoch: epoch `e` is shuffled by a
//! ChaCha8 generator seeded with `seed ^ e.wrapping_mul(mix)`, so the whole sequence of draws is a
//! function of `(len, seed, mix)` alone. Its checkpoint state is only the cursor and the epoch
//! ([`SamplerState`], serialised into a checkpoint's `state.json` by the task): restoring it
//! re-derives the epoch's permutation, so a resumed run draws exactly what the uninterrupted run
//! would have drawn.
//!
//! `mix` is a constructor argument because the tasks predate this type with different constants
//! (`0x9e37` for SAS, `0x9E37_79B9` for Search-R2): keeping each one keeps their metrics and
//! checkpoints byte-identical.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Where an [`EpochSampler`] stands: the only part of it a checkpoint stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SamplerState {
    /// Draws made in the current epoch.
    pub cursor: usize,
    /// Completed epochs.
    pub epoch: u64,
}

impl SamplerState {
    /// The state in a task's checkpoint JSON (`{"cursor": .., "epoch": ..}`); `Ok(None)` for the
    /// `null` of a checkpoint written before the task had state.
    pub fn from_json(v: &serde_json::Value) -> Result<Option<SamplerState>, String> {
        if v.is_null() {
            return Ok(None);
        }
        let cursor = v["cursor"].as_u64().ok_or("task state lacks `cursor`")? as usize;
        let epoch = v["epoch"].as_u64().ok_or("task state lacks `epoch`")?;
        Ok(Some(SamplerState { cursor, epoch }))
    }

    /// The JSON form read by [`SamplerState::from_json`].
    pub fn to_json(self) -> serde_json::Value {
        serde_json::json!({"cursor": self.cursor, "epoch": self.epoch})
    }
}

/// Seeded epoch-by-epoch shuffled indices into a data set of `len` examples.
#[derive(Debug, Clone)]
pub struct EpochSampler {
    len: usize,
    seed: u64,
    mix: u64,
    perm: Vec<usize>,
    state: SamplerState,
}

impl EpochSampler {
    /// A sampler over `0..len` whose epoch `e` is shuffled with `seed ^ e.wrapping_mul(mix)`.
    pub fn new(len: usize, seed: u64, mix: u64) -> EpochSampler {
        let mut s = EpochSampler {
            len,
            seed,
            mix,
            perm: Vec::new(),
            state: SamplerState::default(),
        };
        s.shuffle();
        s
    }

    fn shuffle(&mut self) {
        let mut rng =
            ChaCha8Rng::seed_from_u64(self.seed ^ self.state.epoch.wrapping_mul(self.mix));
        self.perm = (0..self.len).collect();
        self.perm.shuffle(&mut rng);
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there is nothing to draw.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The next index (a new epoch starts, reshuffled, when the current one is used up); `None`
    /// when the data set is empty.
    pub fn next_index(&mut self) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        if self.state.cursor >= self.perm.len() {
            self.state.epoch += 1;
            self.state.cursor = 0;
            self.shuffle();
        }
        let i = self.perm[self.state.cursor];
        self.state.cursor += 1;
        Some(i)
    }

    /// The next `k` indices (empty when the data set is empty).
    pub fn take(&mut self, k: usize) -> Vec<usize> {
        (0..k).map_while(|_| self.next_index()).collect()
    }

    /// The next `k` indices, each repeated `group_size` times in a row (the prompts of a GRPO
    /// step, one group of rollouts each).
    pub fn take_groups(&mut self, k: usize, group_size: usize) -> Vec<usize> {
        self.take(k)
            .into_iter()
            .flat_map(|i| std::iter::repeat_n(i, group_size))
            .collect()
    }

    /// The checkpoint state.
    pub fn state(&self) -> SamplerState {
        self.state
    }

    /// Continue from `state` (its epoch's permutation is re-derived; a cursor past the end of a
    /// smaller data set starts the next epoch at the next draw).
    pub fn restore(&mut self, state: SamplerState) {
        self.state.epoch = state.epoch;
        self.shuffle();
        self.state.cursor = state.cursor.min(self.perm.len());
    }

    /// [`EpochSampler::restore`] from a task's checkpoint JSON (`null` leaves the sampler as is).
    pub fn load_json(&mut self, v: &serde_json::Value) -> Result<(), String> {
        if let Some(s) = SamplerState::from_json(v)? {
            self.restore(s);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_epoch_is_a_permutation_and_epochs_differ() {
        let mut s = EpochSampler::new(10, 3, 0x9e37);
        let a = s.take(10);
        let b = s.take(10);
        for e in [&a, &b] {
            let mut x = e.clone();
            x.sort();
            assert_eq!(x, (0..10).collect::<Vec<_>>());
        }
        assert_ne!(a, b);
        assert_eq!(
            s.state(),
            SamplerState {
                cursor: 10,
                epoch: 1
            }
        );
    }

    #[test]
    fn restore_continues_the_same_sequence() {
        let mut a = EpochSampler::new(7, 11, 0x9E37_79B9);
        a.take(9);
        let st = a.state().to_json();
        let mut b = EpochSampler::new(7, 11, 0x9E37_79B9);
        b.load_json(&st).unwrap();
        assert_eq!(a.take(20), b.take(20));
        assert!(b.load_json(&serde_json::json!({"epoch": 1})).is_err());
        assert!(b.load_json(&serde_json::Value::Null).is_ok());
    }

    /// The draws equal the per-task cursors this type replaced (same seeds, same constants).
    #[test]
    fn matches_the_former_inline_cursor() {
        use rand::SeedableRng;
        use rand::seq::SliceRandom;
        let (len, seed, mix) = (5usize, 42u64, 0x9e37u64);
        let perm = |epoch: u64| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ epoch.wrapping_mul(mix));
            let mut p: Vec<usize> = (0..len).collect();
            p.shuffle(&mut rng);
            p
        };
        let want: Vec<usize> = (0..3).flat_map(perm).collect();
        assert_eq!(EpochSampler::new(len, seed, mix).take(15), want);
        assert!(EpochSampler::new(0, 0, 1).take(3).is_empty());
        let mut s = EpochSampler::new(len, seed, mix);
        assert_eq!(
            s.take_groups(2, 3),
            vec![want[0], want[0], want[0], want[1], want[1], want[1]]
        );
    }
}
