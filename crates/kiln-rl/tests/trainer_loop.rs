//! The generic trainer on a small contextual bandit: it learns, it checkpoints and resumes
//! exactly, and its non-finite guard skips bad updates and aborts without writing a checkpoint.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::module::{Module, Param};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln_rl::{
    LossConfig, NullSink, OptimConfig, RlTask, Rollout, Scored, TaskError, TrainError, Trainer,
    TrainerConfig, TrainerOptions,
};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

const ARMS: usize = 6;
const CONTEXTS: usize = 4;

#[derive(Module, Debug)]
struct Table {
    logits: Param<Tensor<2>>,
}

impl Table {
    fn new(device: &Device) -> Self {
        Self {
            logits: Param::from_tensor(Tensor::zeros([CONTEXTS, ARMS], device)),
        }
    }
}

/// Context c rewards arm (c + 1) % ARMS. Two actions per trajectory (the same context twice).
struct Bandit {
    groups: usize,
    g: usize,
    nan_rewards: bool,
    /// Every trajectory gets reward 1 (all groups uniform).
    constant: bool,
    /// From step `.0` on, sample at temperature `.1` while `score` stays at temperature 1: the
    /// mismatch a task that ignores its sampling temperature in training would have.
    hot_from: Option<(u64, f32)>,
    /// Rows scored so far (every `score` call adds its batch size).
    scored_rows: AtomicUsize,
}

struct Data {
    ctx: Vec<usize>,
    actions: Vec<usize>,
}

fn dev(t: &Table) -> Device {
    t.devices().into_iter().next().unwrap()
}

impl RlTask for Bandit {
    type Policy = Table;
    type Data = Data;

    fn name(&self) -> &str {
        "bandit"
    }

    fn rollout(
        &mut self,
        policy: &Table,
        step: u64,
        rng: &mut ChaCha8Rng,
    ) -> Result<Rollout<Data>, TaskError> {
        let temp = match self.hot_from {
            Some((s, t)) if step >= s => t,
            _ => 1.0,
        };
        let probs: Vec<f32> =
            burn::tensor::activation::softmax(policy.logits.val().div_scalar(temp), 1)
                .into_data()
                .try_into_vec()
                .unwrap();
        let mut sampled = Vec::new();
        let mut ctx = Vec::new();
        let mut actions = Vec::new();
        let mut rewards = Vec::new();
        for _ in 0..self.groups {
            let c = rng.random_range(0..CONTEXTS);
            for _ in 0..self.g {
                let mut r = 0.0;
                for _ in 0..2 {
                    let u: f32 = rng.random();
                    let mut acc = 0.0;
                    let mut a = ARMS - 1;
                    for k in 0..ARMS {
                        acc += probs[c * ARMS + k];
                        if u < acc {
                            a = k;
                            break;
                        }
                    }
                    actions.push(a);
                    sampled.push(probs[c * ARMS + a].ln());
                    if a == (c + 1) % ARMS {
                        r += 0.5;
                    }
                }
                ctx.push(c);
                rewards.push(if self.nan_rewards {
                    f64::NAN
                } else if self.constant {
                    1.0
                } else {
                    r
                });
            }
        }
        let n = rewards.len();
        Ok(Rollout {
            data: Data { ctx, actions },
            group_size: self.g,
            rewards,
            step_rewards: None,
            max_actions: 2,
            action_mask: vec![1.0; n * 2],
            metrics: BTreeMap::new(),
            sampled_logp: Some(sampled),
        })
    }

    fn score(&self, policy: &Table, data: &Data, indices: &[usize]) -> Scored {
        let device = dev(policy);
        let b = indices.len();
        self.scored_rows.fetch_add(b, Ordering::Relaxed);
        let ctx: Vec<i64> = indices.iter().map(|&i| data.ctx[i] as i64).collect();
        let acts: Vec<i64> = indices
            .iter()
            .flat_map(|&i| [data.actions[2 * i] as i64, data.actions[2 * i + 1] as i64])
            .collect();
        let ctx_t: Tensor<1, Int> = Tensor::from_data(TensorData::new(ctx, [b]), &device);
        let logp = log_softmax(policy.logits.val().select(0, ctx_t), 1); // [b, ARMS]
        let idx: Tensor<2, Int> = Tensor::from_data(TensorData::new(acts, [b, 2]), &device);
        Scored {
            logp: logp.gather(1, idx),
            entropy: None,
        }
    }

    fn evaluate(&mut self, policy: &Table, _step: u64) -> Result<BTreeMap<String, f64>, TaskError> {
        let p: Vec<f32> = burn::tensor::activation::softmax(policy.logits.val(), 1)
            .into_data()
            .try_into_vec()
            .unwrap();
        let best: f64 = (0..CONTEXTS)
            .map(|c| p[c * ARMS + (c + 1) % ARMS] as f64)
            .sum::<f64>()
            / CONTEXTS as f64;
        Ok(BTreeMap::from([("eval/p_best".to_string(), best)]))
    }
}

fn opts(dir: &std::path::Path, steps: u64) -> TrainerOptions {
    TrainerOptions {
        trainer: TrainerConfig {
            steps,
            ppo_epochs: 2,
            mini_batch_size: 16,
            checkpoint_every: 5,
            keep_checkpoints: 10,
            ..Default::default()
        },
        algorithm: LossConfig {
            kl_beta: 0.01,
            ..Default::default()
        },
        optim: OptimConfig {
            lr: 0.1,
            weight_decay: 0.0,
            ..Default::default()
        },
        run_dir: dir.to_path_buf(),
        seed: 5,
        progress: None,
    }
}

fn trainer(dir: &std::path::Path, steps: u64, nan: bool) -> Trainer<Bandit> {
    trainer_with(dir, steps, nan, false, false)
}

fn trainer_with(
    dir: &std::path::Path,
    steps: u64,
    nan: bool,
    constant: bool,
    skip_uniform: bool,
) -> Trainer<Bandit> {
    let device = Device::flex().autodiff();
    let mut o = opts(dir, steps);
    o.trainer.skip_uniform_groups = skip_uniform;
    Trainer::new(
        Bandit {
            groups: 8,
            g: 4,
            nan_rewards: nan,
            constant,
            hot_from: None,
            scored_rows: AtomicUsize::new(0),
        },
        Table::new(&device),
        device,
        o,
        Box::new(NullSink),
    )
}

/// A trainer over the learnable 8 x 4 bandit with `opts`, sampling hot from `hot_from`.
fn bandit_trainer(o: TrainerOptions, hot_from: Option<(u64, f32)>) -> Trainer<Bandit> {
    let device = Device::flex().autodiff();
    Trainer::new(
        Bandit {
            groups: 8,
            g: 4,
            nan_rewards: false,
            constant: false,
            hot_from,
            scored_rows: AtomicUsize::new(0),
        },
        Table::new(&device),
        device,
        o,
        Box::new(NullSink),
    )
}

fn logits(t: &Trainer<Bandit>) -> Vec<f32> {
    t.model().logits.val().into_data().try_into_vec().unwrap()
}

#[test]
fn uniform_groups_are_left_out_of_updates() {
    // All rewards equal: nothing to learn; with the switch on, no update at all and the weights stay.
    let d = tempfile::tempdir().unwrap();
    let mut t = trainer_with(d.path(), 5, false, true, true);
    let before = logits(&t);
    for _ in 0..3 {
        let m = t.train_step().unwrap();
        assert_eq!(m["groups/uniform_frac"], 1.0);
        assert_eq!(m["updates"], 0.0);
    }
    assert_eq!(logits(&t), before);
    // A learnable bandit with the switch on: the groups with signal are kept, so it still learns; the
    // uniform ones are counted.
    let d = tempfile::tempdir().unwrap();
    let mut t = trainer_with(d.path(), 30, false, false, true);
    let s = t.run().unwrap();
    assert!(s.eval["eval/p_best"] > 0.8, "{:?}", s.eval);
    assert!(s.last["groups/uniform_frac"] > 0.0, "{:?}", s.last);
    // Off (the default): uniform groups still take part (the update count never drops).
    let d = tempfile::tempdir().unwrap();
    let mut t = trainer_with(d.path(), 5, false, true, false);
    assert_eq!(t.train_step().unwrap()["updates"], 4.0); // 2 epochs x 32/16 minibatches
}

#[test]
fn bandit_learns() {
    let d = tempfile::tempdir().unwrap();
    let mut t = trainer(d.path(), 30, false);
    let s = t.run().unwrap();
    assert_eq!(s.steps, 30);
    let p = s.eval["eval/p_best"];
    assert!(p > 0.8, "p(best arm) = {p} (chance {})", 1.0 / ARMS as f64);
    assert!(s.last["reward/mean"] > 0.7);
    assert!(d.path().join("checkpoints/step-30/state.json").is_file());
    assert!(d.path().join("checkpoints/reference.bpk").is_file());
}

#[test]
fn resume_reproduces_uninterrupted_training() {
    let full = tempfile::tempdir().unwrap();
    let mut a = trainer(full.path(), 10, false);
    let mut rows_a = Vec::new();
    for _ in 0..10 {
        rows_a.push(a.train_step().unwrap());
    }
    let part = tempfile::tempdir().unwrap();
    let mut b = trainer(part.path(), 10, false);
    for _ in 0..5 {
        b.train_step().unwrap();
    }
    b.save_checkpoint().unwrap();
    b.train_step().unwrap(); // work after the checkpoint is lost in a crash
    drop(b);
    let mut c = trainer(part.path(), 10, false);
    assert_eq!(c.resume().unwrap(), Some(5));
    for want in &rows_a[5..] {
        let got = c.train_step().unwrap();
        for (k, v) in want {
            if k.starts_with("time/") || k.starts_with("throughput/") {
                continue;
            }
            assert_eq!(
                got[k].to_bits(),
                v.to_bits(),
                "metric {k} after resume: {} vs {v}",
                got[k]
            );
        }
    }
}

#[test]
fn nonfinite_rewards_skip_updates_then_abort_without_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let mut t = trainer(d.path(), 30, true);
    let err = t.run().unwrap_err();
    assert!(matches!(err, TrainError::NonFinite(_)), "{err}");
    assert!(err.to_string().contains("consecutive non-finite"), "{err}");
    assert!(
        !d.path().join("checkpoints/step-5").exists(),
        "no checkpoint after poisoned updates"
    );
    // parameters untouched by the skipped updates
    assert!(kiln_rl::trainer::params_finite(t.model()));
}

/// The ratio guard: re-scored log-probs equal the sampled ones while the task samples what it
/// scores (the metric is logged, ~0); once it samples at another temperature than it scores,
/// the step fails with an error naming the task and the tolerance.
#[test]
fn a_task_that_scores_another_distribution_than_it_samples_fails_the_step() {
    let d = tempfile::tempdir().unwrap();
    let mut t = trainer(d.path(), 10, false);
    for _ in 0..3 {
        let m = t.train_step().unwrap();
        assert!(m["ratio/max_abs_logp_diff"] < 1e-5, "{m:?}");
        assert_eq!(m["ratio/first_minibatch_max_abs_diff"], 0.0, "{m:?}");
    }
    let d = tempfile::tempdir().unwrap();
    let mut t = bandit_trainer(opts(d.path(), 10), Some((3, 0.5)));
    for _ in 0..3 {
        t.train_step().unwrap();
    }
    let e = t.train_step().unwrap_err();
    assert!(matches!(e, TrainError::RatioCheck { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("`bandit`") && msg.contains("ratio_tolerance"),
        "{msg}"
    );
}

/// One on-policy pass (one epoch, one minibatch holding the whole batch): the old log-probs are
/// the minibatch's own, so each step scores its 32 rows once (no snapshot forward; no reference
/// with `kl_beta: 0`), the sampling check still runs on them, and the bandit still learns. With
/// two minibatches the snapshot re-scores every row first (32 + 32 rows per step).
#[test]
fn one_on_policy_pass_scores_each_row_once_and_keeps_the_ratio_guard() {
    let single = |dir: &std::path::Path, mini_batch: usize| {
        let mut o = opts(dir, 30);
        o.trainer.ppo_epochs = 1;
        o.trainer.mini_batch_size = mini_batch;
        o.algorithm.kl_beta = 0.0;
        o
    };
    let d = tempfile::tempdir().unwrap();
    let mut t = bandit_trainer(single(d.path(), 32), None);
    for step in 1..=3 {
        let m = t.train_step().unwrap();
        assert_eq!(m["ratio/single_pass"], 1.0, "{m:?}");
        assert!(m["ratio/max_abs_logp_diff"] < 1e-5, "{m:?}");
        assert!(!m.contains_key("ratio/first_minibatch_max_abs_diff"));
        assert_eq!(t.task().scored_rows.load(Ordering::Relaxed), 32 * step);
    }
    let s = t.run().unwrap();
    assert!(s.eval["eval/p_best"] > 0.8, "{:?}", s.eval);
    // The guard still fails a step whose sampling and scoring distributions differ.
    let d = tempfile::tempdir().unwrap();
    let mut t = bandit_trainer(single(d.path(), 32), Some((1, 0.5)));
    t.train_step().unwrap();
    let e = t.train_step().unwrap_err();
    assert!(matches!(e, TrainError::RatioCheck { .. }), "{e}");
    // Two minibatches of 16: the snapshot scores the 32 rows, then the minibatches do.
    let d = tempfile::tempdir().unwrap();
    let mut t = bandit_trainer(single(d.path(), 16), None);
    let m = t.train_step().unwrap();
    assert_eq!(m["ratio/single_pass"], 0.0);
    assert_eq!(t.task().scored_rows.load(Ordering::Relaxed), 64);
}

/// Zero advantages (every reward equal) with the policy equal to the reference: the policy
/// gradient, the KL term's gradient (k3 has zero slope at equality) and hence the update are
/// zero; the weights do not move.
#[test]
fn zero_advantages_at_the_reference_give_a_zero_update() {
    let d = tempfile::tempdir().unwrap();
    let mut t = trainer_with(d.path(), 5, false, true, false);
    let before = logits(&t);
    let m = t.train_step().unwrap();
    assert!(m["updates"] > 0.0, "the step must update: {m:?}");
    assert_eq!(m["grad_norm"], 0.0, "{m:?}");
    assert_eq!(logits(&t), before);
}

/// The placebo control: the same bandit, the same budget, with each group trained on another
/// group's rewards (`trainer.placebo_rewards`). The real run learns (see `bandit_learns`); the
/// placebo run stays near chance, and its logged rewards are still the true ones.
#[test]
fn placebo_rewards_do_not_teach_the_bandit() {
    let d = tempfile::tempdir().unwrap();
    let mut o = opts(d.path(), 30);
    o.trainer.placebo_rewards = true;
    let mut t = bandit_trainer(o, None);
    let s = t.run().unwrap();
    let p = s.eval["eval/p_best"];
    eprintln!(
        "placebo p(best arm) after 30 steps: {p:.3} (chance {:.3})",
        1.0 / ARMS as f64
    );
    assert!(
        p < 0.5,
        "placebo p(best arm) = {p}: the placebo taught the policy"
    );
    assert!(s.last["reward/mean"] < 0.6, "{:?}", s.last);
}

/// `trainer.micro_batch_size`: a minibatch scored and back-propagated in pieces, the pieces'
/// gradients summed with their share of the loss, makes the same update as the minibatch in one
/// piece (token-mean and sequence-mean aggregation, with and without the single on-policy pass);
/// the step's update count is unchanged. Without the shares (each piece's own mean) the update
/// would be 4x the gradient, which the comparison would catch.
#[test]
fn micro_batches_make_the_same_update_as_the_whole_minibatch() {
    use kiln_rl::loss::LossAgg;
    for agg in [LossAgg::TokenMean, LossAgg::SeqMeanTokenMean] {
        for mini in [32, 16] {
            let run = |micro: usize| {
                let d = tempfile::tempdir().unwrap();
                let mut o = opts(d.path(), 5);
                o.trainer.ppo_epochs = 1;
                o.trainer.mini_batch_size = mini;
                o.trainer.micro_batch_size = micro;
                o.algorithm.loss_agg = agg;
                o.optim.max_grad_norm = 1e9; // no clipping: compare raw updates
                let mut t = bandit_trainer(o, None);
                let mut updates = Vec::new();
                for _ in 0..2 {
                    updates.push(t.train_step().unwrap()["updates"]);
                }
                (logits(&t), updates)
            };
            let (whole, u_whole) = run(0);
            let (pieces, u_pieces) = run(4);
            assert_eq!(u_whole, u_pieces);
            let d = whole
                .iter()
                .zip(&pieces)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d < 1e-5, "{agg:?} minibatch {mini}: max |diff| {d}");
            assert!(
                whole.iter().any(|v| v.abs() > 1e-3),
                "the runs must move the weights"
            );
        }
    }
}
