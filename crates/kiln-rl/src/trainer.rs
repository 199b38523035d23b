//! The generic on-policy loop: rollout -> rewards -> advantages -> `ppo_epochs` x minibatches of the
//! loss -> optimiser step -> metrics -> checkpoint. It reads top to bottom in [`Trainer::train_step`].
//!
//! The seam ("The RlTask seam" in the repository's `ARCHITECTURE.md`): a task provides a rollout function producing per-action batches with
//! rewards, grouped by prompt, and a differentiable re-scoring of the same actions under given
//! parameters. The trainer knows nothing else about the task.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor, TensorData};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::TrainError;
use crate::advantage::{batch_advantages, batch_reward_to_go_advantages};
use crate::checkpoint::{
    CheckpointManager, MODEL_FILE, OPTIM_FILE, Rejected, RngState, TrainerState, file_digest,
    no_valid_message, warn_rejected,
};
use crate::loss::{LossConfig, LossInputs, LossStats, policy_loss};
use crate::optim::{OptimConfig, clip_grad_norm};

/// Loop hyper-parameters (recipe section `trainer:`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct TrainerConfig {
    /// Number of training steps (one rollout batch + its updates each).
    pub steps: u64,
    /// Passes over each rollout batch (PPO epochs). 1 = strictly on-policy GRPO.
    pub ppo_epochs: usize,
    /// Trajectories per optimiser step; 0 = the whole rollout batch in one step.
    pub mini_batch_size: usize,
    /// Shuffle trajectories between minibatches (with the seeded trainer RNG).
    pub shuffle: bool,
    /// Save a checkpoint every N steps (0 = only at the end). The final step is always saved.
    pub checkpoint_every: u64,
    /// Keep the newest K checkpoints.
    pub keep_checkpoints: usize,
    /// Evaluate every N steps (0 = only at the end).
    pub eval_every: u64,
    /// Abort after this many consecutive non-finite updates (each one is skipped and logged).
    pub max_nonfinite_updates: u32,
    /// Also print a trainer log line every N steps (0 = never; the `kiln` CLI leaves progress lines
    /// to `logging.console`).
    pub log_every: u64,
    /// Leave groups whose advantages are all zero (every member got the same reward) out of the updates,
    /// and skip the update entirely when every group is uniform (DAPO's observation: such groups carry no
    /// policy-gradient signal, yet with Adam and a KL term they still move the weights). Their share is
    /// logged as `groups/uniform_frac` either way. Off by default (the plain GRPO objective).
    pub skip_uniform_groups: bool,
    /// Largest allowed `max |log p_train - log p_sampled|` over the policy tokens of a step: the
    /// log-probs the loss computes must be those the actions were sampled with, or the PPO ratio
    /// does not start at 1 and the gradient belongs to another distribution. Checked on every step
    /// against the log-probs the task recorded while sampling ([`Rollout::sampled_logp`]), and,
    /// when a step makes more than one pass (several minibatches or PPO epochs, where the old
    /// log-probs are re-scored by the rollout snapshot), on the first minibatch against that
    /// re-scoring (non-deterministic scoring, e.g. dropout). With one on-policy pass the old
    /// log-probs are the minibatch's own, detached (no extra forward; `ratio/single_pass` = 1),
    /// and the sampling check runs on them. Logged as `ratio/max_abs_logp_diff`. Past it the step
    /// fails with an error naming the task. 0 = off. Default 1e-3.
    pub ratio_tolerance: f64,
    /// Placebo control (a debug switch for diagnostics, never for real training): before the
    /// advantages are computed, the groups' reward vectors are permuted among the groups of the
    /// batch (seeded per step), so each group is trained on another group's rewards. The reward
    /// sparsity, the share of uniform groups and the number of updates stay those of a real run,
    /// but the rewards say nothing about the trajectories they are attached to: if a metric moves
    /// as much under the placebo as in a real run, the movement is optimiser noise, not learning.
    /// Logged metrics (`reward/...`) stay the true rewards. Default false.
    pub placebo_rewards: bool,
    /// Trajectories per forward/backward pass inside a minibatch (0 = the whole minibatch at once):
    /// the gradients of the pieces are summed, each piece's loss weighted by its share of the
    /// minibatch (its actions for `token_mean`, its trajectories otherwise), so the update is the
    /// minibatch's own, with the memory of one piece. For large models, whose activations for a
    /// whole minibatch do not fit (SmolLM2: 20 trajectories of ~700 tokens need > 23 GB).
    pub micro_batch_size: usize,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            steps: 100,
            ppo_epochs: 1,
            mini_batch_size: 0,
            shuffle: true,
            checkpoint_every: 50,
            keep_checkpoints: 2,
            eval_every: 0,
            max_nonfinite_updates: 5,
            log_every: 0,
            skip_uniform_groups: false,
            ratio_tolerance: 1e-3,
            placebo_rewards: false,
            micro_batch_size: 0,
        }
    }
}

/// One rollout batch produced by a task.
pub struct Rollout<D> {
    /// Task data needed to re-score the actions (token ids, states, ...).
    pub data: D,
    /// Trajectories per prompt; trajectories `g*G .. (g+1)*G` share a prompt.
    pub group_size: usize,
    /// Outcome reward of each trajectory.
    pub rewards: Vec<f64>,
    /// Dense per-action rewards (only needed for `reward_to_go`).
    pub step_rewards: Option<Vec<Vec<f64>>>,
    /// Padded number of actions per trajectory (`T`).
    pub max_actions: usize,
    /// Action mask, `n * T` row-major: 1.0 for policy actions, 0.0 for padding / observations.
    pub action_mask: Vec<f32>,
    /// Task metrics for this batch (reward components, lengths, ...).
    pub metrics: BTreeMap<String, f64>,
    /// Log-probability each action had when it was sampled, `n * T` row-major like
    /// `action_mask` (entries under mask 0 are ignored), or `None` when the task does not record
    /// them. The trainer checks the re-scored log-probs against these
    /// ([`TrainerConfig::ratio_tolerance`]).
    pub sampled_logp: Option<Vec<f32>>,
}

impl<D> Rollout<D> {
    /// Number of trajectories.
    pub fn len(&self) -> usize {
        self.rewards.len()
    }

    /// True when the batch holds no trajectory.
    pub fn is_empty(&self) -> bool {
        self.rewards.is_empty()
    }

    fn validate(&self) -> Result<(), TrainError> {
        let n = self.len();
        let bad = |m: String| Err(TrainError::InvalidRollout(m));
        if n == 0 {
            return bad("the task produced an empty rollout batch".into());
        }
        if self.group_size == 0 || !n.is_multiple_of(self.group_size) {
            return bad(format!(
                "{n} trajectories are not a whole number of groups of {}",
                self.group_size
            ));
        }
        if self.action_mask.len() != n * self.max_actions {
            return bad(format!(
                "action mask has {} entries, expected {n} x {}",
                self.action_mask.len(),
                self.max_actions
            ));
        }
        if let Some(s) = &self.sampled_logp
            && s.len() != n * self.max_actions
        {
            return bad(format!(
                "sampled log-probs have {} entries, expected {n} x {}",
                s.len(),
                self.max_actions
            ));
        }
        if let Some(sr) = &self.step_rewards {
            if sr.len() != n {
                return bad(format!(
                    "{} step-reward rows for {n} trajectories",
                    sr.len()
                ));
            }
            if sr.iter().any(|r| r.len() > self.max_actions) {
                return bad("a step-reward row is longer than max_actions".into());
            }
        }
        Ok(())
    }
}

/// Output of a task's re-scoring pass.
pub struct Scored {
    /// Log-probabilities of the recorded actions, `[b, T]` (padding entries are ignored).
    pub logp: Tensor<2>,
    /// Per-action entropy `[b, T]`, if the task computes it.
    pub entropy: Option<Tensor<2>>,
}

/// A task error, boxed so tasks keep their own error types.
pub type TaskError = Box<dyn std::error::Error + Send + Sync>;

/// What a task provides to the trainer.
pub trait RlTask {
    /// The trainable policy (a burn module).
    type Policy: Module;
    /// Rollout data the task needs to re-score actions.
    type Data;

    /// The task's name in errors (e.g. the policy-ratio check). Default `task`.
    fn name(&self) -> &str {
        "task"
    }

    /// Generate a batch of grouped trajectories with `policy` (a no-grad snapshot of the current
    /// parameters). All randomness must come from `rng` or from state saved by [`RlTask::state`].
    fn rollout(
        &mut self,
        policy: &Self::Policy,
        step: u64,
        rng: &mut ChaCha8Rng,
    ) -> Result<Rollout<Self::Data>, TaskError>;

    /// Log-probabilities `[indices.len(), T]` of the recorded actions of the trajectories `indices`
    /// under `policy`; differentiable when `policy` lives on an autodiff device.
    fn score(&self, policy: &Self::Policy, data: &Self::Data, indices: &[usize]) -> Scored;

    /// Held-out evaluation; metric names should start with `eval/`.
    fn evaluate(
        &mut self,
        _policy: &Self::Policy,
        _step: u64,
    ) -> Result<BTreeMap<String, f64>, TaskError> {
        Ok(BTreeMap::new())
    }

    /// Serializable task state (data cursor, task RNGs) for checkpoints.
    fn state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }

    /// Restore [`RlTask::state`].
    fn load_state(&mut self, _state: &serde_json::Value) -> Result<(), TaskError> {
        Ok(())
    }

    /// The part of the policy checkpoints store when not all of it: LoRA adapters over a frozen
    /// base the task rebuilds from its recipe (a few MB per checkpoint instead of the whole
    /// model). `None` (default): every parameter.
    fn checkpoint_subset(&self) -> Option<crate::checkpoint::PolicySubset> {
        None
    }
}

/// Receives one metrics row per step (kiln-track's tracker implements this in the CLI).
pub trait MetricsSink {
    /// Log the metrics of training step `step`.
    fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>);
}

/// A sink that drops everything (tests, benchmarks).
pub struct NullSink;

impl MetricsSink for NullSink {
    fn log(&mut self, _step: u64, _metrics: &BTreeMap<String, f64>) {}
}

/// Everything the trainer needs besides the task and the model.
pub struct TrainerOptions {
    /// Loop settings.
    pub trainer: TrainerConfig,
    /// Advantage and loss settings.
    pub algorithm: LossConfig,
    /// Optimiser settings.
    pub optim: OptimConfig,
    /// Run directory (checkpoints go to `run_dir/checkpoints`).
    pub run_dir: PathBuf,
    /// Seed of the trainer RNG.
    pub seed: u64,
    /// Progress bar to drive (position = step, message = reward); `None` draws nothing.
    pub progress: Option<indicatif::ProgressBar>,
}

/// Final figures of a run.
#[derive(Debug, Clone, Default)]
pub struct TrainSummary {
    /// Steps completed (including steps from before a resume).
    pub steps: u64,
    /// Metrics of the last step.
    pub last: BTreeMap<String, f64>,
    /// Metrics of the last evaluation.
    pub eval: BTreeMap<String, f64>,
    /// Wall time of this process's training, seconds.
    pub wall_s: f64,
}

/// The on-policy trainer.
pub struct Trainer<T: RlTask> {
    task: T,
    model: T::Policy,
    reference: Option<T::Policy>,
    optim: ModuleOptimizer,
    opts: TrainerOptions,
    device: Device,
    rng: ChaCha8Rng,
    step: u64,
    nonfinite_streak: u32,
    ckpt: CheckpointManager,
    sink: Box<dyn MetricsSink>,
}

fn to_host(t: Tensor<2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 tensor data")
}

struct FiniteCheck(bool);

impl ModuleVisitor for FiniteCheck {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.0 {
            let v = param.val().abs().max().into_scalar::<f32>();
            self.0 = v.is_finite();
        }
    }
}

/// True when every float parameter of `module` is finite.
pub fn params_finite<M: Module>(module: &M) -> bool {
    let mut c = FiniteCheck(true);
    module.visit(&mut c);
    c.0
}

impl<T: RlTask> Trainer<T> {
    /// A trainer for `model`, which must live on an autodiff device (`device`).
    pub fn new(
        task: T,
        model: T::Policy,
        device: Device,
        opts: TrainerOptions,
        sink: Box<dyn MetricsSink>,
    ) -> Self {
        let reference = (opts.algorithm.kl_beta != 0.0).then(|| model.valid());
        let optim = opts.optim.build();
        let ckpt = CheckpointManager::new(&opts.run_dir, opts.trainer.keep_checkpoints);
        let rng = ChaCha8Rng::seed_from_u64(opts.seed);
        Self {
            task,
            model,
            reference,
            optim,
            opts,
            device,
            rng,
            step: 0,
            nonfinite_streak: 0,
            ckpt,
            sink,
        }
    }

    /// Completed steps.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The current model.
    pub fn model(&self) -> &T::Policy {
        &self.model
    }

    /// The task.
    pub fn task(&self) -> &T {
        &self.task
    }

    fn reference_path(&self) -> PathBuf {
        self.ckpt.dir().join("reference.bpk")
    }

    /// Save the frozen reference policy once (so a resumed run keeps the original reference).
    fn save_reference(&self) -> Result<(), TrainError> {
        let Some(r) = &self.reference else {
            return Ok(());
        };
        let path = self.reference_path();
        if path.exists() {
            return Ok(());
        }
        std::fs::create_dir_all(self.ckpt.dir())
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", self.ckpt.dir().display())))?;
        let tmp = self.ckpt.dir().join(".tmp-reference.bpk");
        crate::checkpoint::save_model(r.clone(), &tmp, self.task.checkpoint_subset().as_ref())?;
        let (bytes, sha) = file_digest(&tmp)
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", tmp.display())))?;
        let d = self.reference_digest_path();
        std::fs::write(&d, format!("{bytes} {sha}\n"))
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", d.display())))?;
        std::fs::rename(&tmp, &path)
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", path.display())))?;
        Ok(())
    }

    /// Restore the newest valid checkpoint of the run directory. Returns the restored step, or
    /// `None` when the run has no checkpoint yet. Each checkpoint is verified first
    /// ([`CheckpointManager::verify`]: manifest digests, step vs folder and metrics, RNG state);
    /// a corrupt or unloadable newest checkpoint is skipped with a warning naming what was wrong,
    /// and the next older one is used. Nothing of the trainer changes until a checkpoint has
    /// loaded completely.
    pub fn resume(&mut self) -> Result<Option<u64>, TrainError> {
        if self.ckpt.list().is_empty() {
            return Ok(None);
        }
        self.verify_reference()?;
        let candidates = self.ckpt.newest_first();
        let mut rejected = Vec::new();
        for c in candidates {
            let (step, dir, state) = match c {
                Ok(x) => x,
                Err(r) => {
                    rejected.push(r);
                    continue;
                }
            };
            match self.restore_from(&dir, state) {
                Ok(()) => {
                    for r in &rejected {
                        warn_rejected(r, &dir);
                    }
                    return Ok(Some(step));
                }
                Err(e) => rejected.push(Rejected {
                    dir,
                    reason: e.to_string(),
                }),
            }
        }
        Err(TrainError::Checkpoint(no_valid_message(
            &self.opts.run_dir,
            &rejected,
        )))
    }

    /// Load the tensors of a verified checkpoint, then (only when all of them loaded) replace the
    /// trainer's state with it.
    fn restore_from(&mut self, dir: &Path, state: TrainerState) -> Result<(), TrainError> {
        let model_path = dir.join(MODEL_FILE);
        let current = self.task.checkpoint_subset().map(|s| s.rest);
        let stored = state.policy_subset.as_deref();
        let model = crate::checkpoint::load_model(
            self.model.clone(),
            &model_path,
            stored,
            current.as_deref(),
        )?;
        let optim_path = dir.join(OPTIM_FILE);
        let optim = self
            .opts
            .optim
            .build()
            .load(&optim_path)
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", optim_path.display())))?;
        let reference = if self.reference.is_some() && self.reference_path().exists() {
            let p = self.reference_path();
            // The reference was written like the checkpoints (complete, or the same subset).
            Some(crate::checkpoint::load_model(
                self.model.valid(),
                &p,
                stored,
                current.as_deref(),
            )?)
        } else {
            self.reference.clone()
        };
        let rng = state.rng.restore().map_err(TrainError::Checkpoint)?;
        self.task
            .load_state(&state.task)
            .map_err(|e| TrainError::Task(format!("restoring task state: {e}")))?;
        self.model = model;
        self.optim = optim;
        self.reference = reference;
        self.rng = rng;
        self.step = state.step;
        self.nonfinite_streak = state.nonfinite_streak;
        Ok(())
    }

    /// The frozen reference's digest file (`reference.bpk.sha256`: size and SHA-256).
    fn reference_digest_path(&self) -> PathBuf {
        self.ckpt.dir().join("reference.bpk.sha256")
    }

    /// Check `reference.bpk` against the digest written with it (when both exist). The reference
    /// is shared by every checkpoint of the run, so a corrupt one is an error, not a fallback.
    fn verify_reference(&self) -> Result<(), TrainError> {
        let (p, d) = (self.reference_path(), self.reference_digest_path());
        if self.reference.is_none() || !p.is_file() || !d.is_file() {
            return Ok(());
        }
        let want = std::fs::read_to_string(&d)
            .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", d.display())))?;
        let (bytes, sha) =
            file_digest(&p).map_err(|e| TrainError::Checkpoint(format!("{}: {e}", p.display())))?;
        if want.trim() != format!("{bytes} {sha}") {
            return Err(TrainError::Checkpoint(format!(
                "{} does not match {} (size and SHA-256 {bytes} {sha}, recorded {:?}): the KL \
                 reference of this run is corrupt; restore it from a backup, or start the run over",
                p.display(),
                d.display(),
                want.trim()
            )));
        }
        Ok(())
    }

    /// Write a checkpoint of the current state (refuses to write non-finite parameters).
    pub fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        if !params_finite(&self.model) {
            return Err(TrainError::NonFinite(format!(
                "refusing to write a checkpoint at step {}: the model has non-finite parameters",
                self.step
            )));
        }
        let state = TrainerState {
            step: self.step,
            rng: RngState::capture(&self.rng),
            task: self.task.state(),
            nonfinite_streak: self.nonfinite_streak,
            kiln_version: env!("CARGO_PKG_VERSION").to_string(),
            policy_subset: None,
        };
        let subset = self.task.checkpoint_subset();
        let state = TrainerState {
            policy_subset: subset.as_ref().map(|s| s.rest.clone()),
            ..state
        };
        let model = self.model.clone();
        let optim = &self.optim;
        self.ckpt.save(&state, |dir| {
            let mp = dir.join(MODEL_FILE);
            crate::checkpoint::save_model(model, &mp, subset.as_ref())?;
            let op = dir.join(OPTIM_FILE);
            optim
                .save(&op)
                .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", op.display())))?;
            Ok(())
        })
    }

    fn tensor(&self, data: Vec<f32>, b: usize, t: usize) -> Tensor<2> {
        Tensor::from_data(TensorData::new(data, [b, t]), &self.device)
    }

    fn gather_rows(src: &[f32], t: usize, idx: &[usize]) -> Vec<f32> {
        let mut out = Vec::with_capacity(idx.len() * t);
        for &i in idx {
            out.extend_from_slice(&src[i * t..(i + 1) * t]);
        }
        out
    }

    /// Log-probs of all trajectories under a no-grad policy, in chunks, as host `n * T`.
    fn score_all(
        &self,
        policy: &T::Policy,
        data: &T::Data,
        n: usize,
        t: usize,
        rows: &[usize],
        chunk: usize,
    ) -> Vec<f32> {
        // Row-major [n, t]; rows not in `rows` stay 0 (they are never gathered).
        let mut out = vec![0f32; n * t];
        for c in rows.chunks(chunk.max(1)) {
            let s = self.task.score(policy, data, c);
            let v = to_host(s.logp.detach());
            debug_assert_eq!(v.len(), c.len() * t);
            for (k, &i) in c.iter().enumerate() {
                out[i * t..(i + 1) * t].copy_from_slice(&v[k * t..(k + 1) * t]);
            }
        }
        out
    }

    /// Fails the step when `diff` (a max |log-prob difference|) is past `trainer.ratio_tolerance`.
    fn check_ratio(&self, diff: f64, against: &'static str) -> Result<(), TrainError> {
        let tolerance = self.opts.trainer.ratio_tolerance;
        if tolerance > 0.0 && diff > tolerance {
            return Err(TrainError::RatioCheck {
                task: self.task.name().to_string(),
                step: self.step,
                against,
                diff,
                tolerance,
            });
        }
        Ok(())
    }

    /// One training step; returns its metrics row.
    pub fn train_step(&mut self) -> Result<BTreeMap<String, f64>, TrainError> {
        let t_step = Instant::now();
        let total = self.opts.trainer.steps;
        let lr = self.opts.optim.lr_at(self.step, total);
        let mut m: BTreeMap<String, f64> = BTreeMap::new();

        // 1. Rollout with a no-grad snapshot of the current parameters.
        let t0 = Instant::now();
        let snapshot = self.model.valid();
        let rollout = self
            .task
            .rollout(&snapshot, self.step, &mut self.rng)
            .map_err(|e| TrainError::Task(format!("rollout at step {}: {e}", self.step)))?;
        rollout.validate()?;
        let t_rollout = t0.elapsed().as_secs_f64();
        let n = rollout.len();
        let t = rollout.max_actions;
        let mb = match self.opts.trainer.mini_batch_size {
            0 => n,
            k => k.min(n),
        };

        // 2. Advantages from rewards (group baseline).
        let alg = self.opts.algorithm.clone();
        let alg = &alg;
        let groups = n / rollout.group_size.max(1);
        if self.opts.trainer.placebo_rewards && groups < 2 {
            return Err(TrainError::InvalidRollout(format!(
                "trainer.placebo_rewards needs at least 2 groups per rollout batch to swap their \
                 rewards; this batch has {groups}"
            )));
        }
        let placebo = self
            .opts
            .trainer
            .placebo_rewards
            .then(|| group_permutation(groups, self.opts.seed, self.step));
        // The rewards the advantages see: the rollout's own, or (placebo) another group's.
        let (placebo_rewards, placebo_step_rewards) = match &placebo {
            Some(perm) => (
                Some(permute_groups(&rollout.rewards, rollout.group_size, perm)),
                rollout
                    .step_rewards
                    .as_ref()
                    .map(|sr| permute_groups(sr, rollout.group_size, perm)),
            ),
            None => (None, None),
        };
        let rewards_for_adv = placebo_rewards.as_ref().unwrap_or(&rollout.rewards);
        let step_rewards_for_adv = placebo_step_rewards
            .as_ref()
            .or(rollout.step_rewards.as_ref());
        let adv: Vec<f32> = match (step_rewards_for_adv, alg.reward_to_go) {
            (Some(sr), true) => {
                let a = batch_reward_to_go_advantages(sr, rollout.group_size, alg.advantage);
                let mut out = vec![0f32; n * t];
                for (i, row) in a.iter().enumerate() {
                    for (j, v) in row.iter().enumerate() {
                        out[i * t + j] = *v as f32;
                    }
                }
                out
            }
            _ => {
                let a = batch_advantages(rewards_for_adv, rollout.group_size, alg.advantage);
                a.iter()
                    .flat_map(|&x| std::iter::repeat_n(x as f32, t))
                    .collect()
            }
        };

        // Rows that take part in the updates: all, or only the groups with some non-zero advantage.
        let g = rollout.group_size.max(1);
        let uniform: Vec<bool> = (0..n / g)
            .map(|k| adv[k * g * t..(k + 1) * g * t].iter().all(|a| *a == 0.0))
            .collect();
        let n_uniform = uniform.iter().filter(|u| **u).count();
        m.insert(
            "groups/uniform_frac".into(),
            n_uniform as f64 / uniform.len().max(1) as f64,
        );
        let mut order: Vec<usize> = if self.opts.trainer.skip_uniform_groups {
            (0..n).filter(|i| !uniform[i / g]).collect()
        } else {
            (0..n).collect()
        };

        // 3. Old and reference log-probs, once per rollout batch (not needed when nothing is
        // updated). One on-policy pass (one epoch, one minibatch): the parameters that score the
        // minibatch are the snapshot's, so the old log-probs are the minibatch's own, detached,
        // and no separate forward runs; the sampling check below then compares those.
        let epochs = if order.is_empty() {
            0
        } else {
            self.opts.trainer.ppo_epochs.max(1)
        };
        let single_pass = epochs == 1 && order.len() <= mb;
        m.insert("ratio/single_pass".into(), f64::from(u8::from(single_pass)));
        let t1 = Instant::now();
        let old_logp = if order.is_empty() || single_pass {
            Vec::new()
        } else {
            self.score_all(&snapshot, &rollout.data, n, t, &order, mb)
        };
        let ref_logp = if order.is_empty() {
            None
        } else {
            self.reference
                .as_ref()
                .map(|r| self.score_all(r, &rollout.data, n, t, &order, mb))
        };
        drop(snapshot);
        let t_score = t1.elapsed().as_secs_f64();

        // The policy ratio must start at 1: the re-scored log-probs are the sampled ones.
        if let Some(sampled) = &rollout.sampled_logp
            && !order.is_empty()
            && !single_pass
        {
            let d = max_masked_diff(&old_logp, sampled, &rollout.action_mask, t, &order);
            m.insert("ratio/max_abs_logp_diff".into(), d);
            self.check_ratio(d, "sampling")?;
        }

        // 4. PPO epochs x minibatches.
        let t2 = Instant::now();
        let mut stats_acc: Vec<LossStats> = Vec::new();
        let mut grad_norms = Vec::new();
        let mut skipped = 0u32;
        let mut first_minibatch = true;
        for _epoch in 0..epochs {
            if self.opts.trainer.shuffle {
                order.shuffle(&mut self.rng);
            }
            for idx in order.chunks(mb) {
                let b = idx.len();
                let micro = match self.opts.trainer.micro_batch_size {
                    0 => b,
                    k => k.min(b),
                };
                // Each piece's share of the minibatch's loss (see `TrainerConfig::micro_batch_size`).
                let actions = |rows: &[usize]| -> f64 {
                    rows.iter()
                        .map(|&i| {
                            rollout.action_mask[i * t..(i + 1) * t]
                                .iter()
                                .map(|&v| v as f64)
                                .sum::<f64>()
                        })
                        .sum()
                };
                let total_actions = actions(idx).max(1.0);
                let check = std::mem::take(&mut first_minibatch);
                let mut accum = GradientsAccumulator::<T::Policy>::new();
                let mut pieces = Vec::new();
                let mut bad = None;
                for piece in idx.chunks(micro) {
                    let pb = piece.len();
                    let scored = self.task.score(&self.model, &rollout.data, piece);
                    let mut own_old = None;
                    if check {
                        let new = to_host(scored.logp.clone().detach());
                        let rows: Vec<usize> = (0..pb).collect();
                        let mask = Self::gather_rows(&rollout.action_mask, t, piece);
                        if single_pass {
                            // The minibatch is the whole batch: its log-probs against the sampled
                            // ones (the ratio at the start of the update).
                            if let Some(sampled) = &rollout.sampled_logp {
                                let s = Self::gather_rows(sampled, t, piece);
                                let d = max_masked_diff(&new, &s, &mask, t, &rows);
                                let prev = m.get("ratio/max_abs_logp_diff").copied().unwrap_or(0.0);
                                m.insert("ratio/max_abs_logp_diff".into(), prev.max(d));
                                self.check_ratio(d, "sampling")?;
                            }
                            own_old = Some(new);
                        } else {
                            // Same weights as the snapshot that scored `old_logp`: any difference
                            // is non-deterministic scoring (dropout, a stateful task).
                            let old = Self::gather_rows(&old_logp, t, piece);
                            let d = max_masked_diff(&new, &old, &mask, t, &rows);
                            let key = "ratio/first_minibatch_max_abs_diff";
                            let prev = m.get(key).copied().unwrap_or(0.0);
                            m.insert(key.into(), prev.max(d));
                            self.check_ratio(d, "the rollout snapshot")?;
                        }
                    } else if single_pass {
                        own_old = Some(to_host(scored.logp.clone().detach()));
                    }
                    let old = own_old.unwrap_or_else(|| Self::gather_rows(&old_logp, t, piece));
                    let inputs = LossInputs {
                        logp: scored.logp,
                        old_logp: self.tensor(old, pb, t),
                        ref_logp: ref_logp
                            .as_ref()
                            .map(|r| self.tensor(Self::gather_rows(r, t, piece), pb, t)),
                        advantages: self.tensor(Self::gather_rows(&adv, t, piece), pb, t),
                        mask: self.tensor(Self::gather_rows(&rollout.action_mask, t, piece), pb, t),
                        entropy: scored.entropy,
                    };
                    let out = policy_loss(inputs, alg);
                    let share = match alg.loss_agg {
                        crate::loss::LossAgg::TokenMean => actions(piece) / total_actions,
                        _ => pb as f64 / b as f64,
                    };
                    let loss = if micro == b {
                        out.loss
                    } else {
                        out.loss.mul_scalar(share)
                    };
                    let loss_v = loss.clone().into_scalar::<f32>() as f64;
                    if !loss_v.is_finite() {
                        bad = Some(format!("loss = {loss_v}"));
                        break;
                    }
                    accum.accumulate(
                        &self.model,
                        GradientsParams::from_grads(loss.backward(), &self.model),
                    );
                    pieces.push(out.stats);
                }
                if let Some(why) = bad {
                    skipped += 1;
                    self.note_nonfinite(&why)?;
                    continue;
                }
                let mut gp = accum.grads();
                let norm = clip_grad_norm(&self.model, &mut gp, self.opts.optim.max_grad_norm);
                if !norm.is_finite() {
                    skipped += 1;
                    self.note_nonfinite(&format!("gradient norm = {norm}"))?;
                    continue;
                }
                self.nonfinite_streak = 0;
                self.model = self.optim.step(lr, self.model.clone(), gp);
                grad_norms.push(norm);
                stats_acc.extend(pieces);
            }
        }
        let t_update = t2.elapsed().as_secs_f64();

        // 5. Metrics.
        let rewards = &rollout.rewards;
        let (rm, rs) = mean_std(rewards);
        m.insert("reward/mean".into(), rm);
        m.insert("reward/std".into(), rs);
        m.insert(
            "reward/max".into(),
            rewards.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
        );
        m.insert(
            "reward/min".into(),
            rewards.iter().cloned().fold(f64::INFINITY, f64::min),
        );
        let masked_adv: Vec<f64> = adv
            .iter()
            .zip(&rollout.action_mask)
            .filter(|(_, mk)| **mk > 0.0)
            .map(|(a, _)| *a as f64)
            .collect();
        let (am, asd) = mean_std(&masked_adv);
        m.insert("adv/mean".into(), am);
        m.insert("adv/std".into(), asd);
        let lens: Vec<f64> = rollout
            .action_mask
            .chunks(t.max(1))
            .map(|r| r.iter().map(|x| *x as f64).sum())
            .collect();
        let n_actions: f64 = lens.iter().sum();
        m.insert("response_len/mean".into(), mean_std(&lens).0);
        m.insert(
            "response_len/max".into(),
            lens.iter().cloned().fold(0.0, f64::max),
        );
        let k = stats_acc.len().max(1) as f64;
        let avg = |f: fn(&LossStats) -> f64| stats_acc.iter().map(f).sum::<f64>() / k;
        m.insert("loss/policy".into(), avg(|s| s.policy_loss));
        m.insert("kl/ref".into(), avg(|s| s.kl_ref));
        m.insert("kl/approx".into(), avg(|s| s.approx_kl));
        m.insert("clip_frac".into(), avg(|s| s.clip_frac));
        let ent = avg(|s| s.entropy);
        if ent.is_finite() {
            m.insert("entropy".into(), ent);
        }
        m.insert(
            "grad_norm".into(),
            grad_norms.iter().sum::<f64>() / grad_norms.len().max(1) as f64,
        );
        m.insert("lr".into(), lr);
        m.insert("nonfinite_skips".into(), skipped as f64);
        m.insert("updates".into(), grad_norms.len() as f64);
        let wall = t_step.elapsed().as_secs_f64();
        m.insert("time/rollout_s".into(), t_rollout);
        m.insert("time/score_s".into(), t_score);
        m.insert("time/update_s".into(), t_update);
        m.insert("time/step_s".into(), wall);
        m.insert(
            "throughput/actions_per_s".into(),
            n_actions / wall.max(1e-9),
        );
        for (key, v) in rollout.metrics {
            m.insert(key, v);
        }
        self.step += 1;
        Ok(m)
    }

    fn note_nonfinite(&mut self, what: &str) -> Result<(), TrainError> {
        self.nonfinite_streak += 1;
        tracing::warn!(
            "step {}: non-finite {what}; update skipped ({} in a row)",
            self.step,
            self.nonfinite_streak
        );
        if self.nonfinite_streak >= self.opts.trainer.max_nonfinite_updates.max(1) {
            return Err(TrainError::NonFinite(format!(
                "{} consecutive non-finite updates (last: {what}) at step {}; aborting without \
                 writing a checkpoint. Lower optim.lr, enable optim.max_grad_norm, or check the \
                 task's rewards for NaN/inf",
                self.nonfinite_streak, self.step
            )));
        }
        Ok(())
    }

    /// Run evaluation now (no-grad snapshot).
    pub fn evaluate(&mut self) -> Result<BTreeMap<String, f64>, TrainError> {
        let snap = self.model.valid();
        self.task
            .evaluate(&snap, self.step)
            .map_err(|e| TrainError::Task(format!("evaluation at step {}: {e}", self.step)))
    }

    /// Train until `trainer.steps`, logging, evaluating and checkpointing on the way.
    pub fn run(&mut self) -> Result<TrainSummary, TrainError> {
        let started = Instant::now();
        let cfg = self.opts.trainer.clone();
        self.save_reference()?;
        let pb = self
            .opts
            .progress
            .clone()
            .unwrap_or_else(indicatif::ProgressBar::hidden);
        pb.set_length(cfg.steps);
        pb.set_position(self.step);
        let mut summary = TrainSummary::default();
        let start_step = self.step;
        while self.step < cfg.steps {
            let mut m = self.train_step()?;
            let step = self.step;
            let last = step == cfg.steps;
            if (cfg.eval_every > 0 && step.is_multiple_of(cfg.eval_every)) || last {
                let ev = self.evaluate()?;
                for (k, v) in &ev {
                    m.insert(k.clone(), *v);
                }
                if !ev.is_empty() {
                    summary.eval = ev;
                }
            }
            self.sink.log(step, &m);
            let reward = m.get("reward/mean").copied().unwrap_or(f64::NAN);
            pb.set_message(format!("reward {reward:.3}"));
            pb.set_position(step);
            if cfg.log_every > 0
                && (step.is_multiple_of(cfg.log_every) || last || step == start_step + 1)
            {
                let done = (step - start_step) as f64;
                let eta = started.elapsed().as_secs_f64() / done * (cfg.steps - step) as f64;
                let extra: String = m
                    .iter()
                    .filter(|(k, _)| k.starts_with("eval/"))
                    .map(|(k, v)| format!(" {k} {v:.4}"))
                    .collect();
                // No pb.suspend here: a tracing writer may suspend the bar itself (re-entrant lock).
                tracing::info!(
                    "step {step}/{} reward {reward:.4} kl {:.5} clip {:.3} grad_norm {:.3} \
                     {:.2}s/step ETA {:.0}s{extra}",
                    cfg.steps,
                    m.get("kl/ref").copied().unwrap_or(0.0),
                    m.get("clip_frac").copied().unwrap_or(0.0),
                    m.get("grad_norm").copied().unwrap_or(0.0),
                    m.get("time/step_s").copied().unwrap_or(0.0),
                    eta
                )
            }
            if (cfg.checkpoint_every > 0 && step.is_multiple_of(cfg.checkpoint_every)) || last {
                self.save_checkpoint()?;
            }
            summary.last = m;
        }
        pb.finish_and_clear();
        summary.steps = self.step;
        summary.wall_s = started.elapsed().as_secs_f64();
        Ok(summary)
    }
}

/// Mean and (population) standard deviation; NaN-propagating.
pub fn mean_std(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// A seeded derangement of `groups` group indices for the placebo control of `step`: no group
/// keeps its own rewards (a fixed point would leak 1/groups of the real signal per step). A
/// random cycle through a shuffled order. Identity for a single group (refused at the start).
fn group_permutation(groups: usize, seed: u64, step: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(
        seed ^ 0x504C_4143_4542_4F00 ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    let mut order: Vec<usize> = (0..groups).collect();
    order.shuffle(&mut rng);
    let mut p = vec![0; groups];
    for i in 0..groups {
        p[order[i]] = order[(i + 1) % groups];
    }
    p
}

/// `v` (one entry per trajectory, `g` per group) with group `k` holding group `perm[k]`'s entries.
fn permute_groups<T: Clone>(v: &[T], g: usize, perm: &[usize]) -> Vec<T> {
    let g = g.max(1);
    let mut out = Vec::with_capacity(v.len());
    for &src in perm {
        out.extend_from_slice(&v[src * g..(src + 1) * g]);
    }
    out.extend_from_slice(&v[perm.len() * g..]);
    out
}

/// `max |a - b|` over the entries of rows `rows` (of width `t`) where `mask` is non-zero; 0 when
/// none is. Non-finite differences are left to the non-finite guard of the update.
fn max_masked_diff(a: &[f32], b: &[f32], mask: &[f32], t: usize, rows: &[usize]) -> f64 {
    let mut d = 0f64;
    for &i in rows {
        for k in i * t..(i + 1) * t {
            if mask.get(k).is_some_and(|m| *m != 0.0) {
                let x = (f64::from(a[k]) - f64::from(b[k])).abs();
                if x.is_finite() {
                    d = d.max(x);
                }
            }
        }
    }
    d
}
