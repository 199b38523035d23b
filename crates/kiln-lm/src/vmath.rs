//! Vectorised element-wise math for the host kernels: a branch-free `exp`, the run-time dispatch
//! that compiles a generic loop for AVX-512 / AVX2 + FMA, and the exp-heavy passes built on them
//! (softmax numerators, log-sum-exp, SiLU).
//!
//! Why hand-written: std's `f32::exp` is a call into libm's scalar `expf`, which LLVM cannot
//! vectorise; in profiles it was 3-10% of every workload (attention softmax, SwiGLU, sampling).
//! The maintained SIMD crates (`wide`, `pulp`) pick their vector width at compile time or wrap
//! every kernel in their own dispatch types; this `exp` is ten lines of arithmetic that LLVM
//! vectorises at whatever width the enclosing function is compiled for, so every caller keeps
//! its own loop and one [`dispatch!`] picks the width at run time.

/// `log2(e)`.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two (Cephes) so that `x - n ln 2` is exact enough.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this `exp` returns exactly 0 (`e^-87.3` is the smallest normal f32), so that a score
/// masked with `-inf` gets a zero weight.
const EXP_LO: f32 = -87.0;

/// `e^x` for `x` in [-87, 88] (~1 ulp, Cephes `expf`), 0 below (and for `-inf`), clamped to
/// `e^88` above; branch-free, so loops over it vectorise. The integer part is rounded with the
/// 1.5 * 2^23 trick instead of a float-to-int cast, whose saturating semantics keep LLVM from
/// vectorising the loop. NaN in gives NaN out.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    let c = x.clamp(EXP_LO, 88.0);
    let shifted = c * LOG2E + ROUND;
    let n = shifted - ROUND; // round(x / ln 2)
    let r = c - n * LN2_HI - n * LN2_LO;
    let z = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 0.166_666_65)
        * r
        + 0.5;
    let e = p * z + r + 1.0;
    // The low mantissa bits of `shifted` hold n; 2^n = (n + 127) << 23.
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let v = e * f32::from_bits(n_bits.wrapping_add(127) << 23);
    if x < EXP_LO { 0.0 } else { v }
}

/// `1 / (1 + e^-x)` with [`exp`].
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// Defines `$name`, which runs `$generic` compiled for AVX-512 or AVX2 + FMA when the CPU has
/// them (checked once per call; std caches the checks), and as compiled (SSE2 on x86-64)
/// elsewhere.
macro_rules! dispatch {
    ($(#[$doc:meta])* $vis:vis $name:ident, $generic:ident, ($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
        $(#[$doc])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                fn v4($($arg: $ty),*) $(-> $ret)? {
                    $generic($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn v3($($arg: $ty),*) $(-> $ret)? {
                    $generic($($arg),*)
                }
                if is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features `v4` is compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: as above, for `v3`.
                    return unsafe { v3($($arg),*) };
                }
            }
            $generic($($arg),*)
        }
    };
}
pub(crate) use dispatch;

/// Lanes of the vectorised sums (two AVX-512 or four AVX2 vectors: enough independent chains to
/// hide the add latency).
const L: usize = 16;

#[inline(always)]
fn exp_shift_sum_generic(xs: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0.0f32; L];
    let mut chunks = xs.chunks_exact_mut(L);
    for c in &mut chunks {
        for j in 0..L {
            c[j] = exp(c[j] - shift);
            acc[j] += c[j];
        }
    }
    let mut tail = 0.0f32;
    for x in chunks.into_remainder() {
        *x = exp(*x - shift);
        tail += *x;
    }
    acc.iter().sum::<f32>() + tail
}

dispatch!(
    /// `x <- e^(x - shift)` in place (0 where `x` is `-inf`); returns the sum of the results
    /// (16 lane sums: the order differs from a serial sum).
    pub(crate) exp_shift_sum, exp_shift_sum_generic, (xs: &mut [f32], shift: f32) -> f32
);

#[inline(always)]
fn sum_exp_f64_generic(xs: &[f32], shift: f32, scale: f32) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            acc[j] += exp((c[j] - shift) * scale) as f64;
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&x| exp((x - shift) * scale) as f64)
        .sum();
    acc.iter().sum::<f64>() + tail
}

dispatch!(
    /// `sum_i e^((x_i - shift) * scale)`: each term in f32 (relative error ~1e-7), summed in
    /// f64 (8 lane sums), for a log-sum-exp over a vocabulary.
    pub(crate) sum_exp_f64, sum_exp_f64_generic, (xs: &[f32], shift: f32, scale: f32) -> f64
);

#[inline(always)]
fn exp_moments_f64_generic(xs: &[f32], shift: f32) -> (f64, f64) {
    let (mut s, mut sx) = ([0.0f64; 8], [0.0f64; 8]);
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            let y = c[j] - shift;
            let e = exp(y);
            s[j] += e as f64;
            sx[j] += (e * y) as f64;
        }
    }
    let (mut ts, mut tsx) = (0.0f64, 0.0f64);
    for &x in chunks.remainder() {
        let y = x - shift;
        let e = exp(y);
        ts += e as f64;
        tsx += (e * y) as f64;
    }
    (s.iter().sum::<f64>() + ts, sx.iter().sum::<f64>() + tsx)
}

dispatch!(
    /// `(sum_i e^(x_i - shift), sum_i e^(x_i - shift) (x_i - shift))`, terms in f32, sums in f64
    /// (8 lane sums): a log-sum-exp and an entropy over a vocabulary in one pass.
    pub(crate) exp_moments_f64, exp_moments_f64_generic, (xs: &[f32], shift: f32) -> (f64, f64)
);

#[inline(always)]
fn scaled_exp_generic(xs: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = scale * exp(x - shift);
    }
}

dispatch!(
    /// `out = scale * e^(x - shift)` element-wise (a softmax times a gradient).
    pub(crate) scaled_exp, scaled_exp_generic, (xs: &[f32], shift: f32, scale: f32, out: &mut [f32])
);

#[inline(always)]
fn silu_mul_generic(a: &[f32], b: &[f32], out: &mut [f32]) {
    for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
        *o = a * sigmoid(a) * b;
    }
}

dispatch!(
    /// `out = silu(a) * b` element-wise (SwiGLU), over the shortest of the three.
    pub(crate) silu_mul, silu_mul_generic, (a: &[f32], b: &[f32], out: &mut [f32])
);

#[inline(always)]
fn silu_mul_backward_generic(a: &[f32], b: &[f32], g: &[f32], da: &mut [f32], db: &mut [f32]) {
    let n = da
        .len()
        .min(db.len())
        .min(a.len())
        .min(b.len())
        .min(g.len());
    let (a, b, g, da, db) = (&a[..n], &b[..n], &g[..n], &mut da[..n], &mut db[..n]);
    for j in 0..n {
        let sg = sigmoid(a[j]);
        da[j] = g[j] * b[j] * sg * (1.0 + a[j] * (1.0 - sg));
        db[j] = g[j] * a[j] * sg;
    }
}

dispatch!(
    /// `(da, db)` of [`silu_mul`] for the upstream gradient `g`, element-wise.
    pub(crate) silu_mul_backward, silu_mul_backward_generic,
    (a: &[f32], b: &[f32], g: &[f32], da: &mut [f32], db: &mut [f32])
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_and_zero_below_its_range() {
        let mut worst = 0.0f64;
        for i in -87_000..=88_000 {
            let x = i as f32 / 1000.0;
            let want = (x as f64).exp();
            worst = worst.max(((exp(x) as f64) - want).abs() / want);
        }
        assert!(worst < 3e-7, "exp relative error {worst}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-87.5), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
    }

    /// The dispatched (vectorised) passes against f64 references, on lengths that leave a
    /// ragged tail after the lanes.
    #[test]
    fn passes_match_f64_references() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for n in [0usize, 1, 7, 16, 33, 1000] {
            let xs: Vec<f32> = (0..n).map(|_| rng.random_range(-30.0f32..5.0)).collect();
            let mut got = xs.clone();
            got.iter_mut()
                .step_by(5)
                .for_each(|x| *x = f32::NEG_INFINITY);
            let masked = got.clone();
            let sum = exp_shift_sum(&mut got, 2.0);
            let mut want_sum = 0.0f64;
            for (g, &x) in got.iter().zip(&masked) {
                // The shift is an f32 subtraction in the kernel: compare from there.
                let want = ((x - 2.0) as f64).exp();
                want_sum += want;
                assert!((*g as f64 - want).abs() <= 1e-6 * want, "{g} vs {want}");
            }
            assert!((sum as f64 - want_sum).abs() <= 1e-5 * want_sum.max(1e-30));

            let s = sum_exp_f64(&xs, 4.0, 0.5);
            let want: f64 = xs.iter().map(|&x| (((x - 4.0) * 0.5) as f64).exp()).sum();
            assert!((s - want).abs() <= 1e-6 * want.max(1e-30), "{s} vs {want}");

            let (m0, m1) = exp_moments_f64(&xs, 1.5);
            let (w0, w1) = xs.iter().fold((0.0f64, 0.0f64), |(a, b), &x| {
                let y = (x - 1.5) as f64;
                (a + y.exp(), b + y.exp() * y)
            });
            assert!((m0 - w0).abs() <= 1e-6 * w0.max(1e-30), "{m0} vs {w0}");
            assert!(
                (m1 - w1).abs() <= 1e-5 * w1.abs().max(1e-30),
                "{m1} vs {w1}"
            );
            let mut se = vec![0.0f32; n];
            scaled_exp(&xs, 1.5, -0.25, &mut se);
            for (g, &x) in se.iter().zip(&xs) {
                let want = -0.25 * ((x - 1.5) as f64).exp();
                assert!((*g as f64 - want).abs() <= 1e-6 * want.abs().max(1e-30));
            }

            let b: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let g: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let mut out = vec![0.0f32; n];
            silu_mul(&xs, &b, &mut out);
            let (mut da, mut db) = (vec![0.0f32; n], vec![0.0f32; n]);
            silu_mul_backward(&xs, &b, &g, &mut da, &mut db);
            for i in 0..n {
                let (a, b, g) = (xs[i] as f64, b[i] as f64, g[i] as f64);
                let sg = 1.0 / (1.0 + (-a).exp());
                let close = |x: f32, y: f64| (x as f64 - y).abs() <= 1e-5 * (1.0 + y.abs());
                assert!(close(out[i], a * sg * b), "silu_mul[{i}]");
                assert!(close(da[i], g * b * sg * (1.0 + a * (1.0 - sg))), "da[{i}]");
                assert!(close(db[i], g * a * sg), "db[{i}]");
            }
        }
    }
}
