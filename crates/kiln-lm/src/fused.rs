//! Fused CPU kernels for the transformer's memory-bound ops, forward and backward:
//!
//! | op | forward | backward (given `g = dL/dy`) |
//! |---|---|---|
//! | [`swiglu`] | `y = silu(a) * b = a * s * b`, `s = 1 / (1 + e^-a)` | `da = g * b * s * (1 + a * (1 - s))`, `db = g * a * s` |
//! | [`rms_norm`] | `y = x * r * gamma`, `r = 1 / sqrt(mean(x^2) + eps)` per row | `dx = r * (u - x̂ * mean(u * x̂))` with `x̂ = x * r`, `u = g * gamma`; `dgamma = Σ_rows g * x̂` |
//! | [`rope`] | `y1 = x1 c - x2 s`, `y2 = x2 c + x1 s` (halves of each head) | `dx1 = g1 c + g2 s`, `dx2 = g2 c - g1 s` |
//! | [`linear`] | `y = x W` (`x` flattened to `[M, K]`) | `dx = g W^T`, `dW = x^T g` (only for tracked inputs) |
//! | [`attention`] | `P = softmax(q k^T / sqrt(D))` (masked), `o = P v`; keeps `lse` per query | `P` again from `lse`; `dv = P^T g`, `dS = P * (g v^T - rowsum(g * o))`, `dq = dS k / sqrt(D)`, `dk = dS^T q / sqrt(D)` |
//!
//! Why hand-written: burn-flex (0.22) runs each elementwise op of a composite on one thread and
//! keeps every intermediate for the backward pass; its matmul zero-fills every output and copies it
//! once more into an aligned buffer, and the autodiff attention is a chain of such ops over
//! `[B, H, T, T]` with the kv heads repeated. A SmolLM2 train step spent ~70% of its wall time on one
//! core while `gemm` used both. Each op here is one pass forward and one pass backward, split over
//! the rayon pool, keeping only its inputs (and the norm's `r`, the attention's output and `lse`).
//! No maintained crate offers these as burn ops; `gemm` (burn-flex's own matmul crate) does the
//! products.
//!
//! The ops are a burn backend extension ([`FusedOps`]) for `Flex` and `Autodiff<Flex>`; the
//! public functions take `Tensor`s and fall back to the same arithmetic in burn ops on every other
//! backend (wgpu, ...) and dtype, so the model code calls them unconditionally. f32 only on the
//! fused path; results equal the composites up to float rounding (tests below).

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, NodeGuard, Ops, OpsKind},
};
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::{Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::activation::silu;
use burn::tensor::{Bytes, DType, Device, Int, Shape, Tensor};
use rayon::prelude::*;

use crate::skinny::SyncPtr;

/// Elements per rayon task: below this an op runs on the calling thread.
const GRAIN: usize = 1 << 14;

/// The fused ops as a burn backend extension: implemented for `Flex` (host kernels) and
/// `Autodiff<Flex>` (the same kernels with hand-written backward steps).
#[backend_extension(Flex, Autodiff)]
pub trait FusedOps: Backend {
    /// `silu(a) * b`, same shapes.
    fn fused_swiglu(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
    /// RMSNorm over the last axis of `x` with weight `gamma` `[d]`.
    fn fused_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self>;
    /// `x W` for `x` `[.., K]` and `W` `[K, N]` (any strides), `[.., N]`.
    fn fused_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Scaled dot-product attention of `q` `[B, T, H, D]` over `k`, `v` `[B, T, KVH, D]`
    /// (grouped heads), keys allowed where `keep` `[B, T]` is 1 (and, when `causal`, at or
    /// before the query), `[B, T, H, D]`; a row with no allowed key is zero.
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        keep: FloatTensor<Self>,
        causal: bool,
    ) -> FloatTensor<Self>;
    /// Rotate-half RoPE of `x` `[B, T, H, D]` with tables `cos`, `sin` `[B, 1, T, D]` (halves equal).
    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// Per row of `logits` `[N, V]`: `log_softmax(row)[target]` and the row's entropy, `[N, 2]`,
    /// for `targets` `[N]` (token ids as floats). Only the first column has a gradient.
    fn fused_target_logprobs(
        logits: FloatTensor<Self>,
        targets: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// Whether `t` takes the fused path: f32 on the Flex device (with or without autodiff).
fn fused_path<const D: usize>(t: &Tensor<D>) -> bool {
    t.dtype() == DType::F32 && t.device().inner() == Device::flex() && !fused_off()
}

/// `KILN_FUSED_OFF` set (read once: the check sits on every op of every layer).
fn fused_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var_os("KILN_FUSED_OFF").is_some())
}

/// `silu(a) * b` (the SwiGLU activation), `a` and `b` of one shape.
pub fn swiglu<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    if fused_path(&a) && a.dims() == b.dims() {
        Tensor::from_dispatch(<Dispatch as FusedOps>::fused_swiglu(
            a.into_dispatch(),
            b.into_dispatch(),
        ))
    } else {
        silu(a) * b
    }
}

/// `x W (+ bias)` for `x` `[.., K]`, `W` `[K, N]` (a transposed view is fine: tied embeddings),
/// `bias` `[N]`: burn's `linear`, with the product as one `gemm` call over the flattened rows on
/// the CPU (forward and both backward products), outputs written in place.
pub fn linear<const D: usize>(x: Tensor<D>, w: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<D> {
    if fused_path(&x) && D >= 2 && x.dims()[D - 1] == w.dims()[0] && w.dtype() == DType::F32 {
        let y = Tensor::<D>::from_dispatch(<Dispatch as FusedOps>::fused_linear(
            x.into_dispatch(),
            w.into_dispatch(),
        ));
        match bias {
            Some(b) => y + b.unsqueeze(),
            None => y,
        }
    } else {
        burn::tensor::module::linear(x, w, bias)
    }
}

/// Self-attention of a full forward (training or scoring, no KV cache) on the projections'
/// layout: `q` `[B, T, H, D]`, `k`, `v` `[B, T, KVH, D]` (`H` a multiple of `KVH`), `mask`
/// `[B, 1, 1, T]` true on forbidden keys (key padding), causal or not; `softmax(q k^T / sqrt(D))
/// v` as `[B, T, H, D]`, a row whose keys are all forbidden giving zeros (as burn's autodiff
/// attention does; burn-flex's inference kernel gives a uniform average). One task per (row, head):
/// the `[T, T]` scores live only inside it, and the backward pass recomputes them from the
/// saved log-sum-exp (no `[B, H, T, T]` probabilities kept between passes).
///
/// `None` where the fused kernel does not apply (not the CPU device, other dtypes, other mask
/// shapes): the caller runs burn's attention.
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, burn::tensor::Bool>>,
    causal: bool,
) -> Option<Tensor<4>> {
    let [b, t, h, d] = q.dims();
    let [_, _, kvh, _] = k.dims();
    let mask_ok = mask.as_ref().is_none_or(|m| m.dims() == [b, 1, 1, t]);
    if !fused_path(&q)
        || !mask_ok
        || kvh == 0
        || h % kvh != 0
        || k.dims() != [b, t, kvh, d]
        || v.dims() != [b, t, kvh, d]
    {
        return None;
    }
    let device = q.device().inner();
    let keep = match mask {
        Some(m) => m.reshape([b, t]).bool_not().float().to_device(&device),
        None => Tensor::<2>::ones([b, t], &device),
    };
    Some(Tensor::from_dispatch(
        <Dispatch as FusedOps>::fused_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            keep.into_dispatch(),
            causal,
        ),
    ))
}

/// RMSNorm as HF computes it, `x * rsqrt(mean(x^2, -1) + eps) * gamma`, over the last axis.
pub fn rms_norm<const D: usize>(x: Tensor<D>, gamma: Tensor<1>, eps: f64) -> Tensor<D> {
    if fused_path(&x) && x.dims()[D - 1] == gamma.dims()[0] {
        Tensor::from_dispatch(<Dispatch as FusedOps>::fused_rms_norm(
            x.into_dispatch(),
            gamma.into_dispatch(),
            eps,
        ))
    } else {
        let rms = (x.clone().square().mean_dim(D - 1) + eps).sqrt();
        (x / rms) * gamma.unsqueeze()
    }
}

/// Rotate-half RoPE of `x` `[B, T, H, D]` (heads after time, as a projection's output reshapes
/// to) with the tables `cos`, `sin` `[B, 1, T, D]` whose two halves are equal (HF's
/// `cat(freqs, freqs)`); the tables are constants (no gradient flows into them).
pub fn rope(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
    let [b, t, _, d] = x.dims();
    if fused_path(&x) && d % 2 == 0 && cos.dims() == [b, 1, t, d] && sin.dims() == [b, 1, t, d] {
        Tensor::from_dispatch(<Dispatch as FusedOps>::fused_rope(
            x.into_dispatch(),
            cos.clone().into_dispatch(),
            sin.clone().into_dispatch(),
        ))
    } else {
        let x = x.swap_dims(1, 2);
        let [b, h, t, d] = x.dims();
        let x1 = x.clone().slice([0..b, 0..h, 0..t, 0..d / 2]);
        let x2 = x.clone().slice([0..b, 0..h, 0..t, d / 2..d]);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        (x * cos.clone() + rotated * sin.clone()).swap_dims(1, 2)
    }
}

/// `log_softmax(logits)` gathered at `targets`, and, when `with_entropy`, the entropy of each
/// row's distribution (detached: for logging), for `logits` `[N, V]` and `targets` `[N]`:
/// `(logp [N], entropy [N])`. The gradient of `logp` reaches `logits`. (The fused kernel gets
/// the entropy from the log-sum-exp's pass at no extra cost; burn's ops take three more passes.)
///
/// Why fused: burn's `log_softmax` + `gather` are ~6 passes over the `[N, V]` logits forward
/// (max, subtract, exp, sum, log, subtract; `exp` a scalar libm call) and the backward
/// scatters into a zeroed `[N, V]` tensor before the softmax's own backward; with SmolLM2's
/// 49,152-token vocabulary those passes are GBs of memory traffic per train step. Here the
/// forward is one pass per row for the max and one for the log-sum-exp and the entropy (keeping
/// the `[N]` log-sum-exps, not a `[N, V]` log-softmax), and the backward one pass that writes
/// `g (onehot - softmax)`, rows in parallel. Burn's ops elsewhere.
///
/// # Panics
/// If a target is not a valid column of `logits` (as burn's `gather`).
pub fn target_logprobs(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    with_entropy: bool,
) -> (Tensor<1>, Option<Tensor<1>>) {
    let [n, _] = logits.dims();
    if fused_path(&logits) && targets.dims() == [n] {
        let targets = targets.float();
        let out = Tensor::<2>::from_dispatch(<Dispatch as FusedOps>::fused_target_logprobs(
            logits.into_dispatch(),
            targets.into_dispatch(),
        ));
        let logp = out.clone().slice([0..n, 0..1]).reshape([n]);
        let entropy = with_entropy.then(|| out.slice([0..n, 1..2]).reshape([n]).detach());
        (logp, entropy)
    } else {
        let logp = burn::tensor::activation::log_softmax(logits, 1);
        let entropy = with_entropy.then(|| {
            let l = logp.clone().detach();
            (l.clone().exp() * l).sum_dim(1).reshape([n]).neg()
        });
        (
            logp.gather(1, targets.reshape([n, 1])).reshape([n]),
            entropy,
        )
    }
}

/// One decode step of one layer's attention over its KV cache, on the host (the CPU device,
/// f32, no autodiff). `kbuf`, `vbuf` `[B, KVH, cap, D]` are the cache buffers with `len < cap`
/// positions filled; `qkv` `[B, (H + 2 KVH) D]` holds each row's post-RoPE queries, keys and
/// values (the fused projection's layout); `keep` `[B, len + 1]` is true on the keys a row may
/// attend to. Writes the new keys and values at position `len` (in place: a buffer is copied
/// first only when it is shared or a strided view) and returns the outputs
/// `softmax(q k^T / sqrt(D)) v` `[B, H D]` (a row with no allowed key gives zeros).
///
/// Why: burn's version of this step is ~20 tensor ops per layer (slices, the cache write, two
/// batched matmuls, the mask, the softmax), each with its own dispatch and allocation; for a
/// decode step's few rows that overhead, not the arithmetic, was the attention's cost.
///
/// `None`, with the buffers untouched, where the host path does not apply (no buffers; another
/// device, dtype or autodiff; shapes that do not fit): the caller runs burn's ops.
pub(crate) fn decode_attention(
    kbuf: &mut Option<Tensor<4>>,
    vbuf: &mut Option<Tensor<4>>,
    len: usize,
    qkv: &[f32],
    heads: usize,
    keep: &[bool],
) -> Option<Vec<f32>> {
    let (kt, vt) = (kbuf.as_ref()?, vbuf.as_ref()?);
    let [b, kvh, cap, d] = kt.dims();
    let on_host = |t: &Tensor<4>| {
        t.dtype() == DType::F32 && t.device() == Device::flex() && !t.device().is_autodiff()
    };
    let fits = on_host(kt)
        && on_host(vt)
        && vt.dims() == [b, kvh, cap, d]
        && !fused_off()
        && len < cap
        && kvh > 0
        && heads.is_multiple_of(kvh)
        && qkv.len() == b * (heads + 2 * kvh) * d
        && keep.len() == b * (len + 1);
    if !fits {
        return None;
    }
    let owned = |t: Tensor<4>| {
        let t = t
            .try_into_primitive::<Flex>()
            .expect("an f32 tensor on the flex device without autodiff (checked above)");
        match t.layout().contiguous_offsets() {
            Some((0, _)) => t,
            _ => t.to_contiguous(),
        }
    };
    let (mut kt, mut vt) = (owned(kbuf.take()?), owned(vbuf.take()?));
    let dims = DecodeDims {
        b,
        kvh,
        cap,
        d,
        h: heads,
        len,
    };
    let mut out = vec![0.0f32; b * heads * d];
    decode_attention_host(
        &dims,
        kt.storage_mut::<f32>(),
        vt.storage_mut::<f32>(),
        qkv,
        keep,
        &mut out,
    );
    *kbuf = Some(Tensor::from_primitive::<Flex>(kt));
    *vbuf = Some(Tensor::from_primitive::<Flex>(vt));
    Some(out)
}

/// Shapes of one [`decode_attention`] step.
#[derive(Debug, Clone, Copy)]
pub struct DecodeDims {
    /// Rows.
    pub b: usize,
    /// Key/value heads.
    pub kvh: usize,
    /// Positions the cache buffers hold.
    pub cap: usize,
    /// Head width.
    pub d: usize,
    /// Query heads (a multiple of `kvh`).
    pub h: usize,
    /// Filled positions before this step.
    pub len: usize,
}

/// The host kernel of [`decode_attention`] on contiguous buffers `k`, `v` `[B, KVH, cap, D]`
/// (see there for the other arguments): one task per (row, key/value head), each serving the
/// `H / KVH` query heads of its group.
pub fn decode_attention_host(
    a: &DecodeDims,
    k: &mut [f32],
    v: &mut [f32],
    qkv: &[f32],
    keep: &[bool],
    out: &mut [f32],
) {
    let DecodeDims {
        b,
        kvh,
        cap,
        d,
        h,
        len,
    } = *a;
    let width = (h + 2 * kvh) * d;
    assert!(
        k.len() >= b * kvh * cap * d
            && v.len() >= b * kvh * cap * d
            && len < cap
            && kvh > 0
            && h.is_multiple_of(kvh)
            && qkv.len() == b * width
            && keep.len() == b * (len + 1)
            && out.len() == b * h * d,
        "decode attention: buffers do not match {a:?}"
    );
    for bi in 0..b {
        for g in 0..kvh {
            let at = ((bi * kvh + g) * cap + len) * d;
            let src = bi * width + (h + g) * d;
            k[at..at + d].copy_from_slice(&qkv[src..src + d]);
            let src = bi * width + (h + kvh + g) * d;
            v[at..at + d].copy_from_slice(&qkv[src..src + d]);
        }
    }
    let (k, v) = (&*k, &*v);
    let l = len + 1;
    let group = h / kvh;
    let scale = 1.0 / (d as f32).sqrt();
    let task = |t: usize, o: &mut [f32]| {
        let (bi, g) = (t / kvh, t % kvh);
        let q0 = bi * width + g * group * d;
        let span = Span {
            q: &qkv[q0..q0 + group * d],
            keys: &k[t * cap * d..(t * cap + l) * d],
            vals: &v[t * cap * d..(t * cap + l) * d],
            keep: &keep[bi * l..(bi + 1) * l],
            d,
            scale,
        };
        attend(&span, o);
    };
    let chunk = group * d;
    if b * h * l * d >= GRAIN * 4 && b * kvh > 1 {
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(t, o)| task(t, o));
    } else {
        for (t, o) in out.chunks_mut(chunk).enumerate() {
            task(t, o);
        }
    }
}

/// One (row, key/value head) task of [`decode_attention_host`]: the group's queries `q`
/// `[group, D]` over the filled `keys`, `vals` `[L, D]` where `keep` `[L]`.
struct Span<'a> {
    q: &'a [f32],
    keys: &'a [f32],
    vals: &'a [f32],
    keep: &'a [bool],
    d: usize,
    scale: f32,
}

/// [`attend_body`] compiled for AVX2 + FMA where the CPU has them (fused multiply-adds in
/// 8-wide registers: 2-3x the baseline build's 4-wide SSE2 on these short dot products).
fn attend(s: &Span<'_>, o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        if s.d.is_multiple_of(8) {
            // SAFETY: the CPU has AVX2 and FMA (checked above); D is a multiple of 8.
            unsafe { attend_avx2::attend(s, o) };
            return;
        }
        #[target_feature(enable = "avx2,fma")]
        fn avx2(s: &Span<'_>, o: &mut [f32]) {
            attend_body::<true>(s, o)
        }
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        unsafe { avx2(s, o) };
        return;
    }
    attend_body::<false>(s, o)
}

/// Softmax attention of each query row of `s.q` into the matching `D`-wide row of `o` (zeros
/// where no key is allowed). `FMA`: fused multiply-adds (only where the CPU has them: the
/// software fallback of `mul_add` is slow).
#[inline(always)]
fn attend_body<const FMA: bool>(s: &Span<'_>, o: &mut [f32]) {
    let d = s.d;
    let mut p = vec![0.0f32; s.keep.len()];
    for (q, o) in s.q.chunks_exact(d).zip(o.chunks_exact_mut(d)) {
        for ((sc, key), &kp) in p.iter_mut().zip(s.keys.chunks_exact(d)).zip(s.keep) {
            if kp {
                *sc = dot::<FMA>(q, key) * s.scale;
            }
        }
        o.fill(0.0);
        let Some(inv) = masked_exp(&mut p, s.keep) else {
            continue;
        };
        for (&sc, val) in p.iter().zip(s.vals.chunks_exact(d)) {
            if sc > 0.0 {
                let w = sc * inv;
                for (ov, &vv) in o.iter_mut().zip(val) {
                    *ov = if FMA {
                        w.mul_add(vv, *ov)
                    } else {
                        *ov + w * vv
                    };
                }
            }
        }
    }
}

/// [`attend_body`] with AVX2 + FMA intrinsics for head widths that are a multiple of 8 (the
/// models' 32, 64, 128). `attend_body` computes one score at a time: a dot product of a few
/// vectors is one serial chain of fused multiply-adds plus a horizontal sum, and its output row
/// stays in memory across keys. Here eight keys' dot products run as eight independent chains
/// and are reduced together (one horizontal-add tree per 8 scores), and the weighted sum of the
/// values keeps 32 output columns in registers across all keys.
#[cfg(target_arch = "x86_64")]
mod attend_avx2 {
    use super::Span;
    use std::arch::x86_64::*;

    /// Output columns kept in registers per pass over the keys (4 vectors).
    const COLS: usize = 32;

    /// # Safety
    /// The CPU must have AVX2 and FMA; `s.d` must be a multiple of 8; the span's slices as
    /// [`Span`] documents (`q`, `o` `[group, D]`, `keys`, `vals` `[L, D]`, `keep` `[L]`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend(s: &Span<'_>, o: &mut [f32]) {
        let d = s.d;
        let l = s.keep.len();
        assert!(
            d.is_multiple_of(8)
                && s.keys.len() >= l * d
                && s.vals.len() >= l * d
                && o.len() == s.q.len()
                && s.q.len().is_multiple_of(d.max(1)),
            "attend: spans do not match"
        );
        if d == 0 {
            return;
        }
        let mut p = vec![0.0f32; l];
        let (kp, vp) = (s.keys.as_ptr(), s.vals.as_ptr());
        for (q, o) in s.q.chunks_exact(d).zip(o.chunks_exact_mut(d)) {
            // SAFETY (whole block): key j's row is keys[j * d..(j + 1) * d] with j < l and
            // c + 8 <= d, inside the slice (asserted above); p has l entries.
            unsafe {
                let qp = q.as_ptr();
                let mut j = 0;
                while j + 8 <= l {
                    let mut acc = [_mm256_setzero_ps(); 8];
                    for c in (0..d).step_by(8) {
                        let qv = _mm256_loadu_ps(qp.add(c));
                        for (r, a) in acc.iter_mut().enumerate() {
                            *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp.add((j + r) * d + c)), *a);
                        }
                    }
                    // Lane sums of acc[0..8] into one vector: pairwise adds, then the two
                    // 128-bit halves.
                    let s01 = _mm256_hadd_ps(acc[0], acc[1]);
                    let s23 = _mm256_hadd_ps(acc[2], acc[3]);
                    let s45 = _mm256_hadd_ps(acc[4], acc[5]);
                    let s67 = _mm256_hadd_ps(acc[6], acc[7]);
                    let s0123 = _mm256_hadd_ps(s01, s23);
                    let s4567 = _mm256_hadd_ps(s45, s67);
                    let lo = _mm256_permute2f128_ps::<0x20>(s0123, s4567);
                    let hi = _mm256_permute2f128_ps::<0x31>(s0123, s4567);
                    let dots = _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(s.scale));
                    _mm256_storeu_ps(p.as_mut_ptr().add(j), dots);
                    j += 8;
                }
                for (jj, pj) in p.iter_mut().enumerate().skip(j) {
                    *pj = super::dot::<true>(q, &s.keys[jj * d..(jj + 1) * d]) * s.scale;
                }
            }
            o.fill(0.0);
            let Some(inv) = super::masked_exp(&mut p, s.keep) else {
                continue;
            };
            let op = o.as_mut_ptr();
            let mut c0 = 0;
            // SAFETY (both loops): value j's columns c0..c0 + 8 * n lie in vals[j * d..] with
            // c0 + 8 * n <= d; o has d columns.
            while c0 + COLS <= d {
                unsafe { weighted_sum::<4>(&p, vp.add(c0), d, inv, op.add(c0)) };
                c0 += COLS;
            }
            while c0 < d {
                unsafe { weighted_sum::<1>(&p, vp.add(c0), d, inv, op.add(c0)) };
                c0 += 8;
            }
        }
    }

    /// `out[0..8N] = inv * sum_j p[j] * v[j * stride..][..8N]` over the keys with `p[j] > 0`
    /// (a zero weight skips its value row, so a masked key's non-finite value cannot leak in).
    ///
    /// # Safety
    /// AVX2 + FMA; `v.add(j * stride)` readable for `8N` floats for every `j < p.len()`; `out`
    /// writable for `8N` floats.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn weighted_sum<const N: usize>(
        p: &[f32],
        v: *const f32,
        stride: usize,
        inv: f32,
        out: *mut f32,
    ) {
        let mut acc = [_mm256_setzero_ps(); N];
        for (j, &pj) in p.iter().enumerate() {
            if pj > 0.0 {
                let w = _mm256_set1_ps(pj * inv);
                for (x, a) in acc.iter_mut().enumerate() {
                    // SAFETY: per the contract.
                    *a = _mm256_fmadd_ps(
                        w,
                        unsafe { _mm256_loadu_ps(v.add(j * stride + 8 * x)) },
                        *a,
                    );
                }
            }
        }
        for (x, a) in acc.iter().enumerate() {
            // SAFETY: per the contract.
            unsafe { _mm256_storeu_ps(out.add(8 * x), *a) };
        }
    }
}

/// A query's scores `p` -> softmax numerators in place: `-inf` (weight 0) where `keep` is false,
/// `e^(p - max)` over the kept ones; returns `1 / sum`, or `None` when no key is kept.
fn masked_exp(p: &mut [f32], keep: &[bool]) -> Option<f32> {
    let mut max = f32::NEG_INFINITY;
    for (pj, &k) in p.iter_mut().zip(keep) {
        if k {
            max = max.max(*pj);
        } else {
            *pj = f32::NEG_INFINITY;
        }
    }
    (max != f32::NEG_INFINITY).then(|| 1.0 / crate::vmath::exp_shift_sum(p, max))
}

/// `a . b` in eight running sums (the compiler vectorises them; one running sum would be a
/// serial chain of adds).
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] = if FMA {
                x[i].mul_add(y[i], acc[i])
            } else {
                acc[i] + x[i] * y[i]
            };
        }
    }
    acc.iter().sum::<f32>() + tail
}

// ---------------------------------------------------------------- host kernels (f32, contiguous)

fn par_rows<F>(out: &mut [f32], row: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    let rows_per_task = (GRAIN / row.max(1)).max(1);
    if out.len() <= GRAIN {
        for (i, o) in out.chunks_mut(row).enumerate() {
            f(i, o);
        }
    } else {
        out.par_chunks_mut(rows_per_task * row)
            .enumerate()
            .for_each(|(c, chunk)| {
                for (i, o) in chunk.chunks_mut(row).enumerate() {
                    f(c * rows_per_task + i, o);
                }
            });
    }
}

/// `out = silu(a) * b`.
pub fn swiglu_forward(a: &[f32], b: &[f32], out: &mut [f32]) {
    let k = 1024;
    par_rows(out, k, |i, o| {
        let s = i * k;
        crate::vmath::silu_mul(&a[s..], &b[s..], o);
    });
}

/// `(da, db)` of [`swiglu_forward`] for the upstream gradient `g`.
pub fn swiglu_backward(a: &[f32], b: &[f32], g: &[f32], da: &mut [f32], db: &mut [f32]) {
    let k = 1024;
    let f = |(da, db): (&mut [f32], &mut [f32]), s: usize| {
        crate::vmath::silu_mul_backward(&a[s..], &b[s..], &g[s..], da, db);
    };
    if da.len() <= GRAIN {
        f((da, db), 0);
    } else {
        da.par_chunks_mut(k)
            .zip(db.par_chunks_mut(k))
            .enumerate()
            .with_min_len(GRAIN / k)
            .for_each(|(i, pair)| f(pair, i * k));
    }
}

/// Per `v`-wide row of `logits`: `out[2r] = logits[r][t_r] - lse_r` (`t_r = targets[r]`),
/// `out[2r + 1]` = the entropy of `softmax(row)`; returns the log-sum-exps `[N]`.
///
/// # Panics
/// If a target is not in `0..v`.
pub fn target_logprobs_forward(
    logits: &[f32],
    v: usize,
    targets: &[f32],
    out: &mut [f32],
) -> Vec<f32> {
    let n = targets.len();
    assert!(
        v > 0 && logits.len() == n * v && out.len() == 2 * n,
        "target log-probs: shapes"
    );
    let mut lse = vec![0.0f32; n];
    let row = |r: usize, o: &mut [f32], lse: &mut f32| {
        let x = &logits[r * v..(r + 1) * v];
        let t = targets[r];
        assert!(
            t >= 0.0 && (t as usize) < v && t.fract() == 0.0,
            "target {t} of row {r} is not a token id below the vocabulary size {v}"
        );
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (s, sx) = crate::vmath::exp_moments_f64(x, max);
        let ln_s = s.ln();
        *lse = (max as f64 + ln_s) as f32;
        o[0] = (x[t as usize] as f64 - max as f64 - ln_s) as f32;
        o[1] = (ln_s - sx / s) as f32;
    };
    out.par_chunks_mut(2)
        .zip(lse.par_iter_mut())
        .enumerate()
        .with_min_len((GRAIN / v).max(1))
        .for_each(|(r, (o, l))| row(r, o, l));
    lse
}

/// `d logits = g_r (onehot(t_r) - softmax(row))` per row of [`target_logprobs_forward`], `g`
/// `[N]` the upstream gradient of the log-probs.
pub fn target_logprobs_backward(
    logits: &[f32],
    v: usize,
    targets: &[f32],
    lse: &[f32],
    g: &[f32],
) -> Vec<f32> {
    let mut d = vec![0.0f32; logits.len()];
    d.par_chunks_mut(v)
        .enumerate()
        .with_min_len((GRAIN / v.max(1)).max(1))
        .for_each(|(r, dr)| {
            crate::vmath::scaled_exp(&logits[r * v..(r + 1) * v], lse[r], -g[r], dr);
            dr[targets[r] as usize] += g[r];
        });
    d
}

/// RMSNorm of the rows of `x` (`gamma.len()` wide) into `out`; returns `r` per row.
pub fn rms_norm_forward(x: &[f32], gamma: &[f32], eps: f32, out: &mut [f32]) -> Vec<f32> {
    let d = gamma.len();
    let mut r = vec![0.0f32; x.len() / d];
    let f = |i: usize, o: &mut [f32], r: &mut f32| {
        let row = &x[i * d..(i + 1) * d];
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        *r = 1.0 / (ms + eps).sqrt();
        for ((o, &v), &w) in o.iter_mut().zip(row).zip(gamma) {
            *o = v * *r * w;
        }
    };
    if x.len() <= GRAIN {
        for (i, (o, r)) in out.chunks_mut(d).zip(r.iter_mut()).enumerate() {
            f(i, o, r);
        }
    } else {
        out.par_chunks_mut(d)
            .zip(r.par_iter_mut())
            .enumerate()
            .with_min_len((GRAIN / d).max(1))
            .for_each(|(i, (o, r))| f(i, o, r));
    }
    r
}

/// `dx` of [`rms_norm_forward`] into `dx`, and `dgamma` when `want_dgamma`.
pub fn rms_norm_backward(
    x: &[f32],
    gamma: &[f32],
    r: &[f32],
    g: &[f32],
    dx: &mut [f32],
    want_dgamma: bool,
) -> Option<Vec<f32>> {
    let d = gamma.len();
    let rows_per_task = (GRAIN / d).max(1);
    // Each task: its rows' dx, and its partial dgamma (summed after, in task order).
    let task = |t: usize, dx: &mut [f32]| -> Vec<f32> {
        let mut dgamma = if want_dgamma {
            vec![0.0f32; d]
        } else {
            Vec::new()
        };
        for (k, dxr) in dx.chunks_mut(d).enumerate() {
            let i = t * rows_per_task + k;
            let (xr, gr, ri) = (&x[i * d..(i + 1) * d], &g[i * d..(i + 1) * d], r[i]);
            let mut dot = 0.0f32;
            for j in 0..d {
                dot += gr[j] * gamma[j] * xr[j] * ri;
            }
            let mean = dot / d as f32;
            for j in 0..d {
                let xhat = xr[j] * ri;
                dxr[j] = ri * (gr[j] * gamma[j] - xhat * mean);
            }
            if want_dgamma {
                for j in 0..d {
                    dgamma[j] += gr[j] * xr[j] * ri;
                }
            }
        }
        dgamma
    };
    let parts: Vec<Vec<f32>> = if x.len() <= GRAIN {
        vec![task(0, dx)]
    } else {
        dx.par_chunks_mut(rows_per_task * d)
            .enumerate()
            .map(|(t, c)| task(t, c))
            .collect()
    };
    want_dgamma.then(|| {
        let mut total = vec![0.0f32; d];
        for p in parts {
            for (t, v) in total.iter_mut().zip(p) {
                *t += v;
            }
        }
        total
    })
}

/// RoPE of `x` `[B, T, H, D]` with tables `[B, 1, T, D]` (only each row's first half is read);
/// `sign` = 1 forward, -1 for the backward (the transposed rotation).
pub fn rope_apply(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    heads: usize,
    d: usize,
    sign: f32,
    out: &mut [f32],
) {
    let half = d / 2;
    let row = heads * d; // one (b, t)
    par_rows(out, row, |bt, o| {
        let (c, s) = (&cos[bt * d..bt * d + half], &sin[bt * d..bt * d + half]);
        let xr = &x[bt * row..(bt + 1) * row];
        for h in 0..heads {
            let (xh, oh) = (&xr[h * d..(h + 1) * d], &mut o[h * d..(h + 1) * d]);
            let (x1, x2) = xh.split_at(half);
            let (o1, o2) = oh.split_at_mut(half);
            for j in 0..half {
                let sj = sign * s[j];
                o1[j] = x1[j] * c[j] - x2[j] * sj;
                o2[j] = x2[j] * c[j] + x1[j] * sj;
            }
        }
    });
}

/// `dst [m, n] = lhs [m, k] rhs [k, n]` (row-major `dst`; `lhs`, `rhs` given by element strides
/// `(row, col)`), into a fresh vector; rayon-parallel above ~2M multiply-adds.
///
/// # Safety
/// `lhs` and `rhs` must point to matrices of those shapes and strides.
unsafe fn gemm_new(
    m: usize,
    n: usize,
    k: usize,
    lhs: *const f32,
    (lhs_rs, lhs_cs): (isize, isize),
    rhs: *const f32,
    (rhs_rs, rhs_cs): (isize, isize),
) -> Vec<f32> {
    if k == 0 || m == 0 || n == 0 {
        return vec![0.0; m * n];
    }
    let parallelism = if m * n * k >= 1 << 21 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    let mut dst: Vec<f32> = Vec::with_capacity(m * n);
    // SAFETY: `dst` has room for m * n elements, row-major (row stride n, column stride 1);
    // `read_dst = false` (dst = 1 * lhs * rhs) writes every element without reading any, so
    // the length can be set after; the caller vouches for lhs and rhs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs,
            lhs_cs,
            lhs_rs,
            rhs,
            rhs_cs,
            rhs_rs,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
        dst.set_len(m * n);
    }
    dst
}

/// A 2-D tensor's element pointer and `(row, col)` strides.
fn matrix(t: &FlexTensor) -> (*const f32, (isize, isize)) {
    let l = t.layout();
    let s = l.strides();
    // SAFETY (of the offset): the layout's start offset lies inside its storage.
    let ptr = unsafe { t.storage::<f32>().as_ptr().add(l.start_offset()) };
    (ptr, (s[0], s[1]))
}

/// `x [.., K] W [K, N]`; `x` contiguous.
fn linear_flex(x: &FlexTensor, w: &FlexTensor) -> FlexTensor {
    let xs = shape_of(x);
    let ws = shape_of(w);
    let (k, n) = (ws[0], ws[1]);
    let m = host(x).len() / k.max(1);
    let (wp, wst) = matrix(w);
    // SAFETY: x is contiguous [m, k]; w's pointer and strides come from its own layout.
    let y = unsafe { gemm_new(m, n, k, host(x).as_ptr(), (k as isize, 1), wp, wst) };
    let mut dims: Vec<usize> = xs.iter().copied().collect();
    *dims.last_mut().expect("rank >= 2") = n;
    flex(y, Shape::from(dims))
}

/// Shapes of one attention call.
#[derive(Clone, Copy)]
struct Attn {
    b: usize,
    t: usize,
    h: usize,
    kvh: usize,
    d: usize,
    causal: bool,
    /// Queries per block (see [`QUERY_BLOCK`]).
    bq: usize,
}

/// Queries per block of the host attention: each block computes its `[bq, keys]` scores (keys
/// `0..=last query` under the causal mask, so the masked upper triangle is skipped), so the score
/// buffer stays in L2 instead of a `[T, T]` matrix per head (4.3 MB at T = 1,042). Small under
/// test, so that the tests cross block boundaries.
const QUERY_BLOCK: usize = if cfg!(test) { 8 } else { 128 };

impl Attn {
    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }
    /// Offset of (row, time 0, head) in a `[B, T, heads, D]` buffer.
    fn at(&self, bi: usize, head: usize, heads: usize) -> usize {
        bi * self.t * heads * self.d + head * self.d
    }
    fn allowed(&self, keep: &[f32], bi: usize, i: usize, j: usize) -> bool {
        (!self.causal || j <= i) && keep[bi * self.t + j] > 0.5
    }
}

/// `s [rows, keys] = scale * q k^T` for `rows` queries and the first `keys` keys of one (row,
/// head).
///
/// # Safety
/// `q` points at the first query's head element, `k` at key 0's, in `[B, T, heads, D]` buffers
/// holding `rows` queries and `keys` keys from there.
unsafe fn scores(a: &Attn, rows: usize, keys: usize, q: *const f32, k: *const f32, s: &mut [f32]) {
    let d = a.d;
    assert!(s.len() >= rows * keys);
    // SAFETY: q rows are `h * d` apart, k rows `kvh * d`; k^T reads k with swapped strides;
    // s holds a contiguous [rows, keys] (asserted above).
    unsafe {
        gemm::gemm(
            rows,
            keys,
            d,
            s.as_mut_ptr(),
            1,
            keys as isize,
            false,
            q,
            1,
            (a.h * d) as isize,
            k,
            (a.kvh * d) as isize,
            1,
            0.0f32,
            a.scale(),
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `dst [m, n] (+)= lhs [m, k] rhs [k, n]` with element strides `(row, col)`, one thread.
///
/// # Safety
/// The pointers and strides must describe valid matrices; `dst` is written (and read when
/// `accumulate`).
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_into(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    (dst_rs, dst_cs): (isize, isize),
    accumulate: bool,
    lhs: *const f32,
    (lhs_rs, lhs_cs): (isize, isize),
    rhs: *const f32,
    (rhs_rs, rhs_cs): (isize, isize),
    scale: f32,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs,
            dst_rs,
            accumulate,
            lhs,
            lhs_cs,
            lhs_rs,
            rhs,
            rhs_cs,
            rhs_rs,
            if accumulate { 1.0f32 } else { 0.0 },
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Turns the scores `s` `[lse.len(), keys]` of queries `q0..` of (row `bi`) into probabilities
/// in place (zero where not allowed, a zero row where nothing is), writing each query's
/// log-sum-exp (`+inf` for an empty row).
fn softmax_rows(a: &Attn, keep: &[f32], bi: usize, q0: usize, s: &mut [f32], lse: &mut [f32]) {
    let keys = s.len() / lse.len().max(1);
    for (r, row) in s.chunks_mut(keys).enumerate() {
        let i = q0 + r;
        let mut max = f32::NEG_INFINITY;
        for (j, &x) in row.iter().enumerate() {
            if a.allowed(keep, bi, i, j) && x > max {
                max = x;
            }
        }
        if max == f32::NEG_INFINITY {
            row.fill(0.0);
            lse[r] = f32::INFINITY;
            continue;
        }
        for (j, x) in row.iter_mut().enumerate() {
            if !a.allowed(keep, bi, i, j) {
                *x = f32::NEG_INFINITY;
            }
        }
        let sum = crate::vmath::exp_shift_sum(row, max);
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|x| *x *= inv);
        lse[r] = max + sum.ln();
    }
}

/// The query blocks `(q0, rows, keys)` of one (row, head): `keys` = the keys any of the block's
/// queries may see (`q0 + rows` under the causal mask, else all `T`).
fn query_blocks(a: &Attn) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let bq = a.bq.max(1);
    (0..a.t).step_by(bq).map(move |q0| {
        let rows = bq.min(a.t - q0);
        (q0, rows, if a.causal { q0 + rows } else { a.t })
    })
}

/// Forward: `(out [B, T, H, D], lse [B, H, T])`.
fn attention_forward(
    a: &Attn,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    keep: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let (t, d) = (a.t, a.d);
    let mut out: Vec<f32> = vec![0.0; a.b * t * a.h * d];
    let mut lse = vec![0.0f32; a.b * a.h * t];
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let group = a.h / a.kvh;
    lse.par_chunks_mut(t).enumerate().for_each(|(bh, lse)| {
        let (bi, hi) = (bh / a.h, bh % a.h);
        let kv = hi / group;
        let mut s = vec![0.0f32; a.bq.min(t) * t];
        for (q0, rows, keys) in query_blocks(a) {
            let s = &mut s[..rows * keys];
            let qo = a.at(bi, hi, a.h) + q0 * a.h * d;
            // SAFETY: offsets from `Attn::at` plus whole query rows stay inside the
            // [B, T, heads, D] buffers (q0 + rows <= T, keys <= T); each task writes only its
            // own (row, head) columns of `out`.
            unsafe {
                scores(
                    a,
                    rows,
                    keys,
                    q.as_ptr().add(qo),
                    k.as_ptr().add(a.at(bi, kv, a.kvh)),
                    s,
                );
                softmax_rows(a, keep, bi, q0, s, &mut lse[q0..q0 + rows]);
                gemm_into(
                    (rows, d, keys),
                    out_ptr.get().add(qo),
                    ((a.h * d) as isize, 1),
                    false,
                    s.as_ptr(),
                    (keys as isize, 1),
                    v.as_ptr().add(a.at(bi, kv, a.kvh)),
                    ((a.kvh * d) as isize, 1),
                    1.0,
                );
            }
        }
    });
    (out, lse)
}

/// Backward: `(dq [B, T, H, D], dk, dv [B, T, KVH, D])` for the upstream gradient `g`.
#[allow(clippy::too_many_arguments)]
fn attention_backward(
    a: &Attn,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    keep: &[f32],
    out: &[f32],
    lse: &[f32],
    g: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (t, d) = (a.t, a.d);
    let mut dq = vec![0.0f32; a.b * t * a.h * d];
    let mut dk = vec![0.0f32; a.b * t * a.kvh * d];
    let mut dv = vec![0.0f32; a.b * t * a.kvh * d];
    let (dq_ptr, dk_ptr, dv_ptr) = (
        SyncPtr(dq.as_mut_ptr()),
        SyncPtr(dk.as_mut_ptr()),
        SyncPtr(dv.as_mut_ptr()),
    );
    let group = a.h / a.kvh;
    // One task per (row, kv head): its query heads write disjoint dq columns and accumulate
    // into that kv head's dk / dv columns, which no other task touches.
    (0..a.b * a.kvh).into_par_iter().for_each(|bk| {
        let (bi, kv) = (bk / a.kvh, bk % a.kvh);
        let mut p = vec![0.0f32; a.bq.min(t) * t];
        let mut dp = vec![0.0f32; a.bq.min(t) * t];
        let ko = a.at(bi, kv, a.kvh);
        let (qs, ks) = (((a.h * d) as isize, 1), ((a.kvh * d) as isize, 1));
        for hi in kv * group..(kv + 1) * group {
            for (q0, rows, keys) in query_blocks(a) {
                let qo = a.at(bi, hi, a.h) + q0 * a.h * d;
                let lse = &lse[(bi * a.h + hi) * t + q0..(bi * a.h + hi) * t + q0 + rows];
                let (p, dp) = (&mut p[..rows * keys], &mut dp[..rows * keys]);
                // SAFETY: as in `attention_forward`; the writes are the task's own columns
                // (dq: this head's rows q0..q0 + rows; dk, dv: this kv head's).
                unsafe {
                    // P from the saved log-sum-exp.
                    scores(a, rows, keys, q.as_ptr().add(qo), k.as_ptr().add(ko), p);
                    for (r, row) in p.chunks_mut(keys).enumerate() {
                        for (j, x) in row.iter_mut().enumerate() {
                            if !(lse[r].is_finite() && a.allowed(keep, bi, q0 + r, j)) {
                                *x = f32::NEG_INFINITY;
                            }
                        }
                        crate::vmath::exp_shift_sum(
                            row,
                            if lse[r].is_finite() { lse[r] } else { 0.0 },
                        );
                    }
                    // dV[..keys] += P^T dO.
                    gemm_into(
                        (keys, d, rows),
                        dv_ptr.get().add(ko),
                        ks,
                        true,
                        p.as_ptr(),
                        (1, keys as isize),
                        g.as_ptr().add(qo),
                        qs,
                        1.0,
                    );
                    // dP = dO V[..keys]^T.
                    gemm_into(
                        (rows, keys, d),
                        dp.as_mut_ptr(),
                        (keys as isize, 1),
                        false,
                        g.as_ptr().add(qo),
                        qs,
                        v.as_ptr().add(ko),
                        (1, (a.kvh * d) as isize),
                        1.0,
                    );
                    // dS = P * (dP - rowsum(dO * O)), into dp.
                    for r in 0..rows {
                        let (gr, or) = (
                            g.as_ptr().add(qo + r * a.h * d),
                            out.as_ptr().add(qo + r * a.h * d),
                        );
                        let mut delta = 0.0f32;
                        for c in 0..d {
                            delta += *gr.add(c) * *or.add(c);
                        }
                        let (pr, dpr) = (
                            &p[r * keys..(r + 1) * keys],
                            &mut dp[r * keys..(r + 1) * keys],
                        );
                        for (x, &pv) in dpr.iter_mut().zip(pr) {
                            *x = pv * (*x - delta);
                        }
                    }
                    // dQ = scale * dS K[..keys]; dK[..keys] += scale * dS^T Q.
                    gemm_into(
                        (rows, d, keys),
                        dq_ptr.get().add(qo),
                        qs,
                        false,
                        dp.as_ptr(),
                        (keys as isize, 1),
                        k.as_ptr().add(ko),
                        ks,
                        a.scale(),
                    );
                    gemm_into(
                        (keys, d, rows),
                        dk_ptr.get().add(ko),
                        ks,
                        true,
                        dp.as_ptr(),
                        (1, keys as isize),
                        q.as_ptr().add(qo),
                        qs,
                        a.scale(),
                    );
                }
            }
        }
    });
    (dq, dk, dv)
}

// ---------------------------------------------------------------- Flex glue

/// `t` as a contiguous tensor (a copy only when it is a strided view).
fn contiguous(t: FlexTensor) -> FlexTensor {
    if t.layout().contiguous_offsets().is_some() {
        t
    } else {
        t.to_contiguous()
    }
}

/// The elements of a contiguous f32 tensor.
fn host(t: &FlexTensor) -> &[f32] {
    let (a, b) = t.layout().contiguous_offsets().expect("contiguous");
    &t.storage::<f32>()[a..b]
}

fn flex(v: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::new(Bytes::from_elems(v), Layout::contiguous(shape), DType::F32)
}

fn shape_of(t: &FlexTensor) -> Shape {
    t.layout().shape().clone()
}

fn swiglu_flex(a: &FlexTensor, b: &FlexTensor) -> FlexTensor {
    let mut out = vec![0.0; host(a).len()];
    swiglu_forward(host(a), host(b), &mut out);
    flex(out, shape_of(a))
}

fn rms_flex(x: &FlexTensor, gamma: &FlexTensor, eps: f64) -> (FlexTensor, Vec<f32>) {
    let mut out = vec![0.0; host(x).len()];
    let r = rms_norm_forward(host(x), host(gamma), eps as f32, &mut out);
    (flex(out, shape_of(x)), r)
}

fn rope_flex(x: &FlexTensor, cos: &FlexTensor, sin: &FlexTensor, sign: f32) -> FlexTensor {
    let shape = shape_of(x);
    let (h, d) = (shape[2], shape[3]);
    let mut out = vec![0.0; host(x).len()];
    rope_apply(host(x), host(cos), host(sin), h, d, sign, &mut out);
    flex(out, shape)
}

impl FusedOps for Flex {
    fn fused_swiglu(a: FlexTensor, b: FlexTensor) -> FlexTensor {
        swiglu_flex(&contiguous(a), &contiguous(b))
    }

    fn fused_rms_norm(x: FlexTensor, gamma: FlexTensor, eps: f64) -> FlexTensor {
        rms_flex(&contiguous(x), &contiguous(gamma), eps).0
    }

    fn fused_rope(x: FlexTensor, cos: FlexTensor, sin: FlexTensor) -> FlexTensor {
        rope_flex(&contiguous(x), &contiguous(cos), &contiguous(sin), 1.0)
    }

    fn fused_linear(x: FlexTensor, w: FlexTensor) -> FlexTensor {
        linear_flex(&contiguous(x), &w)
    }

    fn fused_attention(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        keep: FlexTensor,
        causal: bool,
    ) -> FlexTensor {
        let (q, k, v, keep) = (
            contiguous(q),
            contiguous(k),
            contiguous(v),
            contiguous(keep),
        );
        let a = attn_shapes(&q, &k, causal);
        flex(
            attention_forward(&a, host(&q), host(&k), host(&v), host(&keep)).0,
            shape_of(&q),
        )
    }

    fn fused_target_logprobs(logits: FlexTensor, targets: FlexTensor) -> FlexTensor {
        target_logprobs_flex(&contiguous(logits), &contiguous(targets)).0
    }
}

/// [`target_logprobs_forward`] on `[N, V]` logits: (`[N, 2]`, the log-sum-exps).
fn target_logprobs_flex(logits: &FlexTensor, targets: &FlexTensor) -> (FlexTensor, Vec<f32>) {
    let shape = shape_of(logits);
    let (n, v) = (shape[0], shape[1]);
    let mut out = vec![0.0f32; 2 * n];
    let lse = target_logprobs_forward(host(logits), v, host(targets), &mut out);
    (flex(out, Shape::new([n, 2])), lse)
}

fn attn_shapes(q: &FlexTensor, k: &FlexTensor, causal: bool) -> Attn {
    let (qs, ks) = (shape_of(q), shape_of(k));
    Attn {
        b: qs[0],
        t: qs[1],
        h: qs[2],
        kvh: ks[2],
        d: qs[3],
        causal,
        bq: QUERY_BLOCK,
    }
}

#[derive(Debug)]
struct AttentionBackward;

impl Backward<Flex, 3> for AttentionBackward {
    /// `q`, `k`, `v`, `keep`, the output, the log-sum-exp per (row, head, query), causal.
    type State = (
        FlexTensor,
        FlexTensor,
        FlexTensor,
        FlexTensor,
        FlexTensor,
        Vec<f32>,
        bool,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let g = contiguous(grads.consume::<Flex>(&ops.node));
        let (q, k, v, keep, out, lse, causal) = ops.state;
        let a = attn_shapes(&q, &k, causal);
        let (dq, dk, dv) = attention_backward(
            &a,
            host(&q),
            host(&k),
            host(&v),
            host(&keep),
            host(&out),
            &lse,
            host(&g),
        );
        for (node, grad, like) in [(node_q, dq, &q), (node_k, dk, &k), (node_v, dv, &v)] {
            if let Some(node) = node {
                grads.register::<Flex>(node.id, flex(grad, shape_of(like)));
            }
        }
    }
}

#[derive(Debug)]
struct LinearBackward;

impl Backward<Flex, 2> for LinearBackward {
    /// `x` (contiguous), `W`.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let g = contiguous(grads.consume::<Flex>(&ops.node));
        let (x, w) = ops.state;
        let ws = shape_of(&w);
        let (k, n) = (ws[0], ws[1]);
        let m = host(&x).len() / k.max(1);
        let gp = host(&g).as_ptr();
        if let Some(node) = node_x {
            // dx [m, k] = g [m, n] W^T: W^T's element (j, i) is W's (i, j).
            let (wp, (w_rs, w_cs)) = matrix(&w);
            // SAFETY: g is contiguous [m, n]; W^T is W's storage with swapped strides.
            let dx = unsafe { gemm_new(m, k, n, gp, (n as isize, 1), wp, (w_cs, w_rs)) };
            grads.register::<Flex>(node.id, flex(dx, shape_of(&x)));
        }
        if let Some(node) = node_w {
            // dW [k, n] = x^T [k, m] g [m, n].
            // SAFETY: x is contiguous [m, k], read transposed; g contiguous [m, n].
            let dw = unsafe {
                gemm_new(
                    k,
                    n,
                    m,
                    host(&x).as_ptr(),
                    (1, k as isize),
                    gp,
                    (n as isize, 1),
                )
            };
            grads.register::<Flex>(node.id, flex(dw, ws));
        }
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl Backward<Flex, 2> for SwigluBackward {
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_a, node_b] = ops.parents;
        let g = contiguous(grads.consume::<Flex>(&ops.node));
        let (a, b) = ops.state;
        let n = host(&a).len();
        let (mut da, mut db) = (vec![0.0; n], vec![0.0; n]);
        swiglu_backward(host(&a), host(&b), host(&g), &mut da, &mut db);
        if let Some(node) = node_a {
            grads.register::<Flex>(node.id, flex(da, shape_of(&a)));
        }
        if let Some(node) = node_b {
            grads.register::<Flex>(node.id, flex(db, shape_of(&b)));
        }
    }
}

#[derive(Debug)]
struct RmsNormBackward;

impl Backward<Flex, 2> for RmsNormBackward {
    /// `x`, `gamma`, `r` per row.
    type State = (FlexTensor, FlexTensor, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_gamma] = ops.parents;
        let g = contiguous(grads.consume::<Flex>(&ops.node));
        let (x, gamma, r) = ops.state;
        let mut dx = vec![0.0; host(&x).len()];
        let dgamma = rms_norm_backward(
            host(&x),
            host(&gamma),
            &r,
            host(&g),
            &mut dx,
            node_gamma.is_some(),
        );
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, flex(dx, shape_of(&x)));
        }
        if let (Some(node), Some(dg)) = (node_gamma, dgamma) {
            grads.register::<Flex>(node.id, flex(dg, shape_of(&gamma)));
        }
    }
}

#[derive(Debug)]
struct RopeBackward;

impl Backward<Flex, 1> for RopeBackward {
    /// The tables.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let g = contiguous(grads.consume::<Flex>(&ops.node));
        let (cos, sin) = ops.state;
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, rope_flex(&g, &cos, &sin, -1.0));
        }
    }
}

#[derive(Debug)]
struct TargetLogprobsBackward;

impl Backward<Flex, 1> for TargetLogprobsBackward {
    /// The logits, the targets, the log-sum-exps.
    type State = (FlexTensor, FlexTensor, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let g = contiguous(grads.consume::<Flex>(&ops.node));
        let (logits, targets, lse) = ops.state;
        if let Some(node) = node {
            let shape = shape_of(&logits);
            // Column 0 of the [N, 2] upstream gradient: the log-probs' (the entropy's is not
            // propagated).
            let g0: Vec<f32> = host(&g).chunks_exact(2).map(|c| c[0]).collect();
            let d = target_logprobs_backward(host(&logits), shape[1], host(&targets), &lse, &g0);
            grads.register::<Flex>(node.id, flex(d, shape));
        }
    }
}

/// Records `out` (computed on the inner backend) as an autodiff op with `backward` and its
/// `state`, or as an untracked result when no parent requires a gradient (the state is dropped).
fn record<BO, C, const N: usize>(
    backward: BO,
    parents: [NodeGuard; N],
    state: BO::State,
    out: FlexTensor,
) -> FloatTensor<Autodiff<Flex, C>>
where
    BO: Backward<Flex, N>,
    C: CheckpointStrategy,
{
    match backward.prepare::<C>(parents).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(state, out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

impl<C: CheckpointStrategy> FusedOps for Autodiff<Flex, C> {
    fn fused_swiglu(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        let parents = [a.node(), b.node()];
        let (a, b) = (
            contiguous(a.into_primitive()),
            contiguous(b.into_primitive()),
        );
        let out = swiglu_flex(&a, &b);
        record::<_, C, 2>(SwigluBackward, parents, (a, b), out)
    }

    fn fused_rms_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let parents = [x.node(), gamma.node()];
        let x = contiguous(x.into_primitive());
        let gamma = contiguous(gamma.into_primitive());
        let (out, r) = rms_flex(&x, &gamma, eps);
        record::<_, C, 2>(RmsNormBackward, parents, (x, gamma, r), out)
    }

    fn fused_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        let parents = [x.node(), w.node()];
        let (x, w) = (contiguous(x.into_primitive()), w.into_primitive());
        let out = linear_flex(&x, &w);
        record::<_, C, 2>(LinearBackward, parents, (x, w), out)
    }

    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        keep: FloatTensor<Self>,
        causal: bool,
    ) -> FloatTensor<Self> {
        let parents = [q.node(), k.node(), v.node()];
        let keep = contiguous(keep.into_primitive());
        let q = contiguous(q.into_primitive());
        let k = contiguous(k.into_primitive());
        let v = contiguous(v.into_primitive());
        let a = attn_shapes(&q, &k, causal);
        let (out, lse) = attention_forward(&a, host(&q), host(&k), host(&v), host(&keep));
        let out = flex(out, shape_of(&q));
        let state = (q, k, v, keep, out.clone(), lse, causal);
        record::<_, C, 3>(AttentionBackward, parents, state, out)
    }

    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let parents = [x.node()];
        let cos = contiguous(cos.into_primitive());
        let sin = contiguous(sin.into_primitive());
        let out = rope_flex(&contiguous(x.into_primitive()), &cos, &sin, 1.0);
        record::<_, C, 1>(RopeBackward, parents, (cos, sin), out)
    }

    fn fused_target_logprobs(
        logits: FloatTensor<Self>,
        targets: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let parents = [logits.node()];
        let logits = contiguous(logits.into_primitive());
        let targets = contiguous(targets.into_primitive());
        let (out, lse) = target_logprobs_flex(&logits, &targets);
        record::<_, C, 1>(TargetLogprobsBackward, parents, (logits, targets, lse), out)
    }
}

#[cfg(test)]
mod tests {
    //! Each fused op against the same arithmetic written with burn's own ops (forward values and
    //! the gradients of a random projection of the output), on the autodiff CPU device, over
    //! shapes that take both the single-thread and the rayon path.
    use super::*;
    use burn::tensor::TensorData;

    fn ad() -> Device {
        Device::flex().autodiff()
    }

    /// Uniform(-2, 2) values from a host RNG of their own (the device's RNG is global, shared
    /// with the tests running beside this one).
    fn rand<const D: usize>(dims: [usize; D], seed: u64) -> Tensor<D> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        Tensor::from_data(TensorData::new(v, dims), &ad())
    }

    fn max_diff<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f32 {
        let a = a.into_data().try_to_vec::<f32>().unwrap();
        let b = b.into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
            .fold(0.0, f32::max)
    }

    /// Forward and input gradients of `f` (fused) and `r` (reference) at `inputs`, with
    /// `L = sum(y * proj)`: the largest relative differences (forward, gradients).
    fn compare<const D: usize, const N: usize, const O: usize>(
        inputs: [Tensor<D>; N],
        f: impl Fn(&[Tensor<D>]) -> Tensor<O>,
        r: impl Fn(&[Tensor<D>]) -> Tensor<O>,
    ) -> (f32, f32) {
        let run = |g: &dyn Fn(&[Tensor<D>]) -> Tensor<O>| {
            let xs: Vec<Tensor<D>> = inputs
                .iter()
                .map(|t| Tensor::from_data(t.to_data(), &ad()).require_grad())
                .collect();
            let y = g(&xs);
            let proj = rand(y.dims(), 99);
            let grads = (y.clone() * proj).sum().backward();
            let gs: Vec<Tensor<D>> = xs
                .iter()
                .map(|x| x.grad(&grads).unwrap().autodiff())
                .collect();
            (y, gs)
        };
        let (yf, gf) = run(&f);
        let (yr, gr) = run(&r);
        let dy = max_diff(yf, yr);
        let dg = gf
            .into_iter()
            .zip(gr)
            .map(|(a, b)| max_diff(a, b))
            .fold(0.0, f32::max);
        (dy, dg)
    }

    #[test]
    fn the_cpu_devices_take_the_fused_path() {
        // The comparisons below are only meaningful when the fused kernels run.
        assert!(fused_path(&rand([2, 2], 0)));
        assert!(fused_path(&Tensor::<2>::zeros([2, 2], &Device::flex())));
        let f64_tensor = Tensor::<2>::zeros([2, 2], (&Device::flex(), DType::F64));
        assert!(!fused_path(&f64_tensor));
    }

    /// The fused target log-probs against burn's `log_softmax` + `gather` (values and the
    /// logits' gradient), one row and enough rows for the rayon path, with logits scaled so that
    /// the distributions range from flat to peaked; the entropy against its definition.
    #[test]
    fn target_logprobs_match_log_softmax_and_gather() {
        use rand::{Rng, SeedableRng};
        for (n, v, spread) in [(1, 5, 1.0), (37, 300, 8.0), (64, 4099, 3.0)] {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(n as u64);
            let ids: Vec<i64> = (0..n).map(|_| rng.random_range(0..v as i64)).collect();
            let targets = || Tensor::<1, Int>::from_data(TensorData::new(ids.clone(), [n]), &ad());
            let (dy, dg) = compare(
                [rand([n, v], 5) * spread],
                |x| target_logprobs(x[0].clone(), targets(), false).0,
                |x| {
                    burn::tensor::activation::log_softmax(x[0].clone(), 1)
                        .gather(1, targets().reshape([n, 1]))
                        .reshape([n])
                },
            );
            assert!(dy < 1e-5 && dg < 1e-5, "n {n} v {v}: {dy} {dg}");
            let logits = rand([n, v], 5) * spread;
            let entropy = target_logprobs(logits.clone(), targets(), true)
                .1
                .expect("asked for");
            let p = burn::tensor::activation::softmax(logits.clone(), 1);
            let want = (p.clone() * p.log()).sum_dim(1).reshape([n]).neg();
            let de = max_diff(entropy, want);
            assert!(de < 1e-4, "entropy n {n} v {v}: {de}");
        }
    }

    #[test]
    fn swiglu_matches_silu_times_up() {
        for n in [7, 40_000] {
            let (dy, dg) = compare(
                [rand([2, n], 1), rand([2, n], 2)],
                |x| swiglu(x[0].clone(), x[1].clone()),
                |x| silu(x[0].clone()) * x[1].clone(),
            );
            assert!(dy < 1e-5 && dg < 1e-5, "n {n}: {dy} {dg}");
        }
    }

    #[test]
    fn rms_norm_matches_the_composite_with_gamma_gradients() {
        for rows in [3, 300] {
            let (dy, dg) = compare(
                [rand([rows, 96], 3), rand([1, 96], 4)],
                |x| rms_norm(x[0].clone(), x[1].clone().reshape([96]), 1e-5),
                |x| {
                    let rms = (x[0].clone().square().mean_dim(1) + 1e-5).sqrt();
                    (x[0].clone() / rms) * x[1].clone()
                },
            );
            assert!(dy < 1e-5 && dg < 2e-5, "rows {rows}: {dy} {dg}");
        }
    }

    #[test]
    fn decode_attention_matches_an_f64_reference_on_both_paths() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
        // Small (one thread) and large enough for the rayon path; GQA groups of 3; row 1 of the
        // large case has no allowed key (zeros).
        for (b, kvh, h, d, len, cap) in [(2, 1, 3, 8, 5, 9), (3, 2, 6, 64, 200, 230)] {
            let a = DecodeDims {
                b,
                kvh,
                cap,
                d,
                h,
                len,
            };
            let l = len + 1;
            let mut u =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect() };
            let (mut k, mut v) = (u(b * kvh * cap * d), u(b * kvh * cap * d));
            let qkv = u(b * (h + 2 * kvh) * d);
            let mut keep: Vec<bool> = (0..b * l).map(|i| i % 5 != 2).collect();
            if b == 3 {
                keep[l..2 * l].fill(false);
            }
            let mut out = vec![f32::NAN; b * h * d];
            decode_attention_host(&a, &mut k, &mut v, &qkv, &keep, &mut out);
            let width = (h + 2 * kvh) * d;
            for bi in 0..b {
                for hh in 0..h {
                    let g = hh / (h / kvh);
                    // The new key and value were written at position `len`.
                    let at = ((bi * kvh + g) * cap + len) * d;
                    let kn = &qkv[bi * width + (h + g) * d..][..d];
                    assert_eq!(&k[at..at + d], kn);
                    let q = &qkv[bi * width + hh * d..][..d];
                    let base = (bi * kvh + g) * cap * d;
                    let allowed: Vec<usize> = (0..l).filter(|&j| keep[bi * l + j]).collect();
                    let s: Vec<f64> = allowed
                        .iter()
                        .map(|&j| {
                            (0..d)
                                .map(|x| q[x] as f64 * k[base + j * d + x] as f64)
                                .sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                    for x in 0..d {
                        let want: f64 = allowed
                            .iter()
                            .zip(&s)
                            .map(|(&j, sj)| (sj - m).exp() / z * v[base + j * d + x] as f64)
                            .sum();
                        let got = out[(bi * h + hh) * d + x] as f64;
                        assert!(
                            (got - want).abs() < 1e-5,
                            "b={b} row {bi} head {hh} [{x}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn decode_attention_kernels_with_and_without_fma_agree() {
        for (group, l, d) in [(3, 37, 20), (3, 37, 32), (1, 8, 64), (2, 5, 40), (1, 1, 8)] {
            kernels_agree(group, l, d);
        }
    }

    /// The dispatched kernel (on x86-64 with AVX2: the intrinsics one when `d % 8 == 0`), the
    /// generic one with and without FMA, on `l` keys with every 4th masked.
    fn kernels_agree(group: usize, l: usize, d: usize) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(22);
        let mut u =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect() };
        let (q, keys, vals) = (u(group * d), u(l * d), u(l * d));
        let keep: Vec<bool> = (0..l).map(|j| j % 4 != 1).collect();
        let span = Span {
            q: &q,
            keys: &keys,
            vals: &vals,
            keep: &keep,
            d,
            scale: 0.3,
        };
        let (mut a, mut b) = (vec![0.0; group * d], vec![0.0; group * d]);
        attend_body::<false>(&span, &mut a);
        attend_body::<true>(&span, &mut b);
        let mut c = vec![0.0; group * d];
        attend(&span, &mut c);
        for ((x, y), z) in a.iter().zip(&b).zip(&c) {
            assert!(
                (x - y).abs() < 1e-5 && (x - z).abs() < 1e-5,
                "group {group} l {l} d {d}: {x} {y} {z}"
            );
        }
        assert!(a.iter().any(|x| x.abs() > 1e-3), "not all zeros");
    }

    #[test]
    fn rope_matches_rotate_half() {
        let (b, t, h, d) = (2, 70, 3, 16);
        // Tables with equal halves, as the model builds them.
        let freqs = rand([b, 1, t, d / 2], 5);
        let emb = Tensor::cat(vec![freqs.clone(), freqs], 3);
        let (cos, sin) = (emb.clone().cos().detach(), emb.sin().detach());
        let (dy, dg) = compare(
            [rand([b, t, h, d], 6)],
            |x| rope(x[0].clone(), &cos, &sin),
            |x| {
                let x = x[0].clone().swap_dims(1, 2);
                let x1 = x.clone().slice([0..b, 0..h, 0..t, 0..d / 2]);
                let x2 = x.clone().slice([0..b, 0..h, 0..t, d / 2..d]);
                let rot = Tensor::cat(vec![x2.neg(), x1], 3);
                (x * cos.clone() + rot * sin.clone()).swap_dims(1, 2)
            },
        );
        assert!(dy < 1e-5 && dg < 1e-5, "{dy} {dg}");
    }

    #[test]
    fn linear_matches_matmul_also_with_a_transposed_weight() {
        for (m, k, n) in [(3, 5, 4), (130, 64, 300)] {
            // Weight stored [N, K] and used transposed (tied embeddings), or stored [K, N].
            let (dy, dg) = compare(
                [rand([2, m, k], 7), rand([1, n, k], 8)],
                |x| linear(x[0].clone(), x[1].clone().reshape([n, k]).transpose(), None),
                |x| {
                    x[0].clone()
                        .matmul(x[1].clone().reshape([n, k]).transpose().unsqueeze())
                },
            );
            assert!(dy < 1e-4 && dg < 1e-4, "{m}x{k}x{n} transposed: {dy} {dg}");
            let (dy, dg) = compare(
                [rand([2, m, k], 9), rand([1, k, n], 10)],
                |x| linear(x[0].clone(), x[1].clone().reshape([k, n]), None),
                |x| x[0].clone().matmul(x[1].clone()),
            );
            assert!(dy < 1e-4 && dg < 1e-4, "{m}x{k}x{n}: {dy} {dg}");
        }
    }

    /// burn's attention on heads-first tensors with the kv heads repeated.
    fn reference_attention(
        x: &[Tensor<4>],
        mask: Option<Tensor<4, burn::tensor::Bool>>,
        causal: bool,
    ) -> Tensor<4> {
        let [b, t, h, d] = x[0].dims();
        let kvh = x[1].dims()[2];
        let rep = |x: Tensor<4>| {
            x.swap_dims(1, 2)
                .reshape([b, kvh, 1, t, d])
                .expand([b, kvh, h / kvh, t, d])
                .reshape([b, h, t, d])
        };
        let options = burn::tensor::ops::AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: causal,
        };
        burn::tensor::module::attention(
            x[0].clone().swap_dims(1, 2),
            rep(x[1].clone()),
            rep(x[2].clone()),
            mask,
            None,
            options,
        )
        .swap_dims(1, 2)
    }

    #[test]
    fn attention_matches_burn_with_grouped_heads_padding_and_causality() {
        let (b, t, h, kvh, d) = (2, 37, 4, 2, 8);
        // Row 1 is left-padded by 5: under the causal mask its first 5 queries see no key.
        let mut keep = vec![true; b * t];
        keep[t..t + 5].iter_mut().for_each(|k| *k = false);
        let keep = Tensor::<2, burn::tensor::Bool>::from_data(TensorData::new(keep, [b, t]), &ad());
        let mask = keep.bool_not().reshape([b, 1, 1, t]);
        for (causal, mask) in [
            (true, Some(mask.clone())),
            (false, Some(mask)),
            (true, None),
        ] {
            let inputs = [
                rand([b, t, h, d], 11),
                rand([b, t, kvh, d], 12),
                rand([b, t, kvh, d], 13),
            ];
            let (dy, dg) = compare(
                inputs,
                |x| {
                    attention(
                        x[0].clone(),
                        x[1].clone(),
                        x[2].clone(),
                        mask.clone(),
                        causal,
                    )
                    .unwrap()
                },
                |x| reference_attention(x, mask.clone(), causal),
            );
            assert!(dy < 1e-5 && dg < 1e-4, "causal {causal}: {dy} {dg}");
            // The same forward without autodiff (scoring), against burn's own CPU kernel.
            let plain = |t: &Tensor<4>| Tensor::<4>::from_data(t.to_data(), &Device::flex());
            let x = [
                rand([b, t, h, d], 14),
                rand([b, t, kvh, d], 15),
                rand([b, t, kvh, d], 16),
            ]
            .map(|t| plain(&t));
            let m = mask
                .clone()
                .map(|m| Tensor::<4, burn::tensor::Bool>::from_data(m.to_data(), &Device::flex()));
            let fused =
                attention(x[0].clone(), x[1].clone(), x[2].clone(), m.clone(), causal).unwrap();
            let reference = reference_attention(&x, m, causal);
            // Rows with no allowed key are zero here and uniform in burn-flex's kernel: compare
            // the rows that see a key (all but row 1's first 5 queries under the causal mask).
            let skip = if causal && mask.is_some() { 5 } else { 0 };
            let rows = |y: Tensor<4>| y.slice([1..2, skip..t, 0..h, 0..d]);
            assert!(
                max_diff(rows(fused.clone()), rows(reference.clone())) < 1e-5,
                "plain, causal {causal}"
            );
            assert!(
                max_diff(
                    fused.slice([0..1, 0..t, 0..h, 0..d]),
                    reference.slice([0..1, 0..t, 0..h, 0..d])
                ) < 1e-5
            );
        }
    }

    #[test]
    fn blocked_attention_is_independent_of_the_query_block() {
        // One block of all T queries is the unblocked computation; every smaller block
        // (ragged last blocks, one query per block) must give the same values and gradients.
        let (b, t, h, kvh, d) = (2, 37, 4, 2, 8);
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
        let mut fill =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
        let (q, k, v, g) = (
            fill(b * t * h * d),
            fill(b * t * kvh * d),
            fill(b * t * kvh * d),
            fill(b * t * h * d),
        );
        let mut keep = vec![1.0f32; b * t];
        keep[t..t + 5].iter_mut().for_each(|x| *x = 0.0);
        keep[t + 20] = 0.0;
        for causal in [true, false] {
            let run = |bq: usize| {
                let a = Attn {
                    b,
                    t,
                    h,
                    kvh,
                    d,
                    causal,
                    bq,
                };
                let (out, lse) = attention_forward(&a, &q, &k, &v, &keep);
                let (dq, dk, dv) = attention_backward(&a, &q, &k, &v, &keep, &out, &lse, &g);
                [out, lse, dq, dk, dv]
            };
            let whole = run(t);
            for bq in [1, 5, 8, 36] {
                for (name, (x, y)) in ["out", "lse", "dq", "dk", "dv"]
                    .iter()
                    .zip(whole.iter().zip(run(bq)))
                {
                    let diff = x
                        .iter()
                        .zip(&y)
                        .map(|(a, b)| if a == b { 0.0 } else { (a - b).abs() })
                        .fold(0.0f32, f32::max);
                    assert!(diff < 1e-5, "causal {causal}, block {bq}, {name}: {diff}");
                }
            }
        }
    }

    #[test]
    fn linear_adds_the_bias_and_skips_untracked_weights() {
        let x = Tensor::<3>::from_data(
            TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [1, 2, 2]),
            &ad(),
        )
        .require_grad();
        let w = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 0.0, 0.0, 2.0], [2, 2]), &ad());
        let bias = Tensor::<1>::from_data(TensorData::new(vec![0.5f32, -0.5], [2]), &ad());
        let y = linear(x.clone(), w.clone(), Some(bias));
        assert_eq!(
            y.to_data().try_to_vec::<f32>().unwrap(),
            vec![1.5, 3.5, 3.5, 7.5]
        );
        let grads = y.sum().backward();
        assert_eq!(
            x.grad(&grads)
                .unwrap()
                .to_data()
                .try_to_vec::<f32>()
                .unwrap(),
            vec![1.0, 2.0, 1.0, 2.0]
        );
        assert!(w.grad(&grads).is_none());
    }
}
