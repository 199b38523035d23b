//! The loss, KL and aggregation variants against an independent scalar (f64) implementation of the
//! closed forms, and their gradients w.r.t. the log-probabilities against the analytic gradients
//! (including the clipped region and masked actions, where the gradient must be exactly zero).

use burn::tensor::{Device, Tensor, TensorData};
use kiln_rl::loss::{LossInputs, aggregate, kl_per_action, policy_loss};
use kiln_rl::{KlEstimator, LossAgg, LossConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const B: usize = 4;
const T: usize = 5;

struct Case {
    logp: Vec<f64>,
    old: Vec<f64>,
    refp: Vec<f64>,
    adv: Vec<f64>,
    mask: Vec<f64>,
}

fn random_case(seed: u64) -> Case {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    let n = B * T;
    let old: Vec<f64> = (0..n).map(|_| -r.random_range(0.05..3.0)).collect();
    // ratios spread over [0.5, 1.6] so both clip sides are hit
    let logp: Vec<f64> = old
        .iter()
        .map(|o| o + r.random_range(-0.7f64..0.47))
        .collect();
    let refp: Vec<f64> = old.iter().map(|o| o + r.random_range(-0.5..0.5)).collect();
    let adv: Vec<f64> = (0..B)
        .flat_map(|_| {
            let a = r.random_range(-2.0..2.0);
            std::iter::repeat_n(a, T)
        })
        .collect();
    let mut mask: Vec<f64> = (0..n)
        .map(|_| if r.random_bool(0.75) { 1.0 } else { 0.0 })
        .collect();
    // one fully masked trajectory and one full one
    for t in 0..T {
        mask[t] = 0.0;
        mask[T + t] = 1.0;
    }
    Case {
        logp,
        old,
        refp,
        adv,
        mask,
    }
}

fn t2(v: &[f64], device: &Device) -> Tensor<2> {
    Tensor::from_data(
        TensorData::new(v.iter().map(|x| *x as f32).collect::<Vec<f32>>(), [B, T]),
        device,
    )
}

fn agg_ref(vals: &[f64], mask: &[f64], agg: LossAgg) -> f64 {
    match agg {
        LossAgg::TokenMean => {
            let s: f64 = vals.iter().zip(mask).map(|(v, m)| v * m).sum();
            s / mask.iter().sum::<f64>().max(1.0)
        }
        LossAgg::SeqMeanTokenMean => {
            let mut tot = 0.0;
            for b in 0..B {
                let s: f64 = (0..T).map(|t| vals[b * T + t] * mask[b * T + t]).sum();
                let m: f64 = (0..T).map(|t| mask[b * T + t]).sum();
                tot += s / m.max(1.0);
            }
            tot / B as f64
        }
        LossAgg::SeqMeanTokenSumNorm => {
            let s: f64 = vals.iter().zip(mask).map(|(v, m)| v * m).sum();
            s / (B * T) as f64
        }
    }
}

fn kl_ref(logp: f64, refp: f64, est: KlEstimator) -> f64 {
    let lr = refp - logp;
    match est {
        KlEstimator::K1 => -lr,
        KlEstimator::K2 => 0.5 * lr * lr,
        KlEstimator::K3 => (lr.exp() - 1.0 - lr).clamp(-10.0, 10.0),
    }
}

/// d kl / d logp
fn kl_grad(logp: f64, refp: f64, est: KlEstimator) -> f64 {
    let lr = refp - logp;
    match est {
        KlEstimator::K1 => 1.0,
        KlEstimator::K2 => -lr,
        KlEstimator::K3 => 1.0 - lr.exp(),
    }
}

fn ppo_ref(logp: f64, old: f64, a: f64, lo: f64, hi: f64) -> (f64, f64, bool) {
    let ratio = (logp - old).exp();
    let pg1 = -a * ratio;
    let pg2 = -a * ratio.clamp(1.0 - lo, 1.0 + hi);
    // (value, d/dlogp, clipped-active)
    if pg2 > pg1 {
        (pg2, 0.0, true)
    } else {
        (pg1, -a * ratio, false)
    }
}

/// d agg / d value_i (the aggregation is linear in the values)
fn agg_weight(i: usize, mask: &[f64], agg: LossAgg) -> f64 {
    let m = mask[i];
    match agg {
        LossAgg::TokenMean => m / mask.iter().sum::<f64>().max(1.0),
        LossAgg::SeqMeanTokenMean => {
            let b = i / T;
            let mt: f64 = (0..T).map(|t| mask[b * T + t]).sum();
            m / mt.max(1.0) / B as f64
        }
        LossAgg::SeqMeanTokenSumNorm => m / (B * T) as f64,
    }
}

#[test]
fn loss_values_and_gradients_match_closed_form() {
    let device = Device::flex().autodiff();
    let mut checked_clipped_zero = 0;
    let mut checked_masked_zero = 0;
    for seed in 0..6u64 {
        let c = random_case(seed);
        for agg in [
            LossAgg::TokenMean,
            LossAgg::SeqMeanTokenMean,
            LossAgg::SeqMeanTokenSumNorm,
        ] {
            for est in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3] {
                for beta in [0.0, 0.05] {
                    let cfg = LossConfig {
                        loss_agg: agg,
                        kl_estimator: est,
                        kl_beta: beta,
                        clip_eps: 0.2,
                        clip_eps_high: 0.28,
                        entropy_coef: 0.0,
                        ..LossConfig::default()
                    };
                    let logp = t2(&c.logp, &device).require_grad();
                    let out = policy_loss(
                        LossInputs {
                            logp: logp.clone(),
                            old_logp: t2(&c.old, &device),
                            ref_logp: Some(t2(&c.refp, &device)),
                            advantages: t2(&c.adv, &device),
                            mask: t2(&c.mask, &device),
                            entropy: None,
                        },
                        &cfg,
                    );
                    let n = B * T;
                    let mut pg = vec![0.0; n];
                    let mut dpg = vec![0.0; n];
                    let mut clipped = vec![false; n];
                    let mut kl = vec![0.0; n];
                    for i in 0..n {
                        let (v, d, cl) = ppo_ref(c.logp[i], c.old[i], c.adv[i], 0.2, 0.28);
                        pg[i] = v;
                        dpg[i] = d;
                        clipped[i] = cl;
                        kl[i] = kl_ref(c.logp[i], c.refp[i], est);
                    }
                    let policy = agg_ref(&pg, &c.mask, agg);
                    let klv = agg_ref(&kl, &c.mask, agg);
                    let expect = policy + beta * klv;
                    let got = out.loss.clone().into_scalar::<f32>() as f64;
                    assert!(
                        (got - expect).abs() < 1e-4 * (1.0 + expect.abs()),
                        "loss {agg:?} {est:?} beta {beta}: {got} vs {expect}"
                    );
                    assert!((out.stats.policy_loss - policy).abs() < 1e-4 * (1.0 + policy.abs()));
                    let n_act: f64 = c.mask.iter().sum();
                    let cf =
                        (0..n).filter(|&i| clipped[i] && c.mask[i] > 0.0).count() as f64 / n_act;
                    assert!(
                        (out.stats.clip_frac - cf).abs() < 1e-6,
                        "clip frac {} vs {cf}",
                        out.stats.clip_frac
                    );

                    let grads = out.loss.backward();
                    let g: Vec<f32> = logp
                        .grad(&grads)
                        .unwrap()
                        .into_data()
                        .try_into_vec()
                        .unwrap();
                    for i in 0..n {
                        let w = agg_weight(i, &c.mask, agg);
                        let mut expect = w * dpg[i];
                        if beta > 0.0 {
                            let in_clamp = !(est == KlEstimator::K3
                                && (c.refp[i] - c.logp[i]).exp() - 1.0 - (c.refp[i] - c.logp[i])
                                    > 10.0);
                            if in_clamp {
                                expect += beta * w * kl_grad(c.logp[i], c.refp[i], est);
                            }
                        }
                        let gi = g[i] as f64;
                        assert!(
                            (gi - expect).abs() < 1e-5 + 1e-4 * expect.abs(),
                            "grad[{i}] {agg:?} {est:?} beta {beta}: {gi} vs {expect}"
                        );
                        if c.mask[i] == 0.0 {
                            assert_eq!(gi, 0.0, "masked action must have zero gradient");
                            checked_masked_zero += 1;
                        } else if clipped[i] && beta == 0.0 {
                            assert_eq!(gi, 0.0, "clipped action must have zero gradient");
                            checked_clipped_zero += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(
        checked_clipped_zero > 10,
        "the cases must hit the clipped region ({checked_clipped_zero})"
    );
    assert!(checked_masked_zero > 10);
}

#[test]
fn aggregation_modes_closed_form() {
    let device = Device::flex();
    let vals: Vec<f64> = (0..B * T).map(|i| i as f64 * 0.5 - 3.0).collect();
    let c = random_case(42);
    for agg in [
        LossAgg::TokenMean,
        LossAgg::SeqMeanTokenMean,
        LossAgg::SeqMeanTokenSumNorm,
    ] {
        let got =
            aggregate(t2(&vals, &device), t2(&c.mask, &device), agg, 0).into_scalar::<f32>() as f64;
        let exp = agg_ref(&vals, &c.mask, agg);
        assert!((got - exp).abs() < 1e-5, "{agg:?}: {got} vs {exp}");
    }
    // Dr.GRPO's constant normaliser
    let got = aggregate(
        t2(&vals, &device),
        t2(&c.mask, &device),
        LossAgg::SeqMeanTokenSumNorm,
        10,
    )
    .into_scalar::<f32>() as f64;
    let s: f64 = vals.iter().zip(&c.mask).map(|(v, m)| v * m).sum();
    assert!((got - s / (B as f64 * 10.0)).abs() < 1e-5);
}

#[test]
fn kl_estimators_closed_form_and_k3_is_nonnegative() {
    let device = Device::flex();
    let c = random_case(7);
    for est in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3] {
        let v: Vec<f32> = kl_per_action(t2(&c.logp, &device), t2(&c.refp, &device), est)
            .into_data()
            .try_into_vec()
            .unwrap();
        assert_eq!(v.len(), B * T);
        for (i, vi) in v.iter().enumerate() {
            let e = kl_ref(c.logp[i], c.refp[i], est);
            assert!((*vi as f64 - e).abs() < 1e-5, "{est:?}");
            if est == KlEstimator::K3 {
                assert!(*vi >= 0.0);
            }
        }
    }
    // identical policies: every estimator is 0
    for est in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3] {
        let v = kl_per_action(t2(&c.logp, &device), t2(&c.logp, &device), est)
            .abs()
            .max()
            .into_scalar::<f32>();
        assert_eq!(v, 0.0);
    }
}

#[test]
fn on_policy_ratio_is_one_and_loss_is_minus_mean_advantage() {
    // With logp == old_logp (first PPO epoch), token-mean loss = -mean(A) over actions.
    let device = Device::flex().autodiff();
    let c = random_case(3);
    let out = policy_loss(
        LossInputs {
            logp: t2(&c.logp, &device).require_grad(),
            old_logp: t2(&c.logp, &device),
            ref_logp: None,
            advantages: t2(&c.adv, &device),
            mask: t2(&c.mask, &device),
            entropy: None,
        },
        &LossConfig {
            kl_beta: 0.0,
            ..Default::default()
        },
    );
    let exp = -agg_ref(&c.adv, &c.mask, LossAgg::TokenMean);
    assert!((out.loss.into_scalar::<f32>() as f64 - exp).abs() < 1e-5);
    assert_eq!(out.stats.clip_frac, 0.0);
    assert!(out.stats.approx_kl.abs() < 1e-7);
}
