//! The one transformer implementation: Llama blocks (RMSNorm, RoPE, SwiGLU MLP, grouped-query
//! attention), configured by [`TransformerConfig`] into Llama, Qwen2 (q/k/v bias) or a
//! bidirectional LLaDA-style masked-diffusion denoiser (`causal: false`).
//!
//! Numerics follow HF `transformers` (rotate-half RoPE computed in f32, RMSNorm in f32), so
//! weights exported from HF give the same logits (see the parity tests).

use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::tensor::activation::softmax;
use burn::tensor::module::{attention, linear};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Device, Distribution, Int, Tensor, TensorData};

use crate::config::TransformerConfig;
use crate::fused::{rope, swiglu};
use crate::lora::{LoraAdapter, project};
use crate::skinny::{PackedMatrix, Part};

/// A `[d_in, d_out]` linear layer with normal(0, std) weights and zero bias.
pub(crate) fn init_linear(
    d_in: usize,
    d_out: usize,
    bias: bool,
    std: f64,
    device: &Device,
) -> Linear {
    let weight = Tensor::<2>::random([d_in, d_out], Distribution::Normal(0.0, std), device);
    Linear {
        weight: Param::from_tensor(weight),
        bias: bias.then(|| Param::from_tensor(Tensor::<1>::zeros([d_out], device))),
    }
}

pub(crate) fn init_rms_norm(d: usize, eps: f64, device: &Device) -> RmsNorm {
    RmsNorm {
        gamma: Param::from_tensor(Tensor::<1>::ones([d], device)),
        epsilon: eps,
    }
}

/// RMSNorm computed like HF (`x * rsqrt(mean(x^2) + eps) * weight`); one fused pass on the CPU
/// ([`crate::fused::rms_norm`]).
fn rms_norm<const D: usize>(norm: &RmsNorm, x: Tensor<D>) -> Tensor<D> {
    crate::fused::rms_norm(x, norm.gamma.val(), norm.epsilon)
}

/// Self-attention with RoPE and grouped-query heads.
#[derive(Module, Debug)]
pub struct Attention {
    /// Query projection `[hidden, heads * head_dim]`.
    pub q_proj: Linear,
    /// Key projection `[hidden, kv_heads * head_dim]`.
    pub k_proj: Linear,
    /// Value projection `[hidden, kv_heads * head_dim]`.
    pub v_proj: Linear,
    /// Output projection `[heads * head_dim, hidden]`.
    pub o_proj: Linear,
    /// LoRA adapter of `q_proj` ([`crate::lora`]); `None` = not adapted.
    pub q_lora: Option<LoraAdapter>,
    /// LoRA adapter of `k_proj`.
    pub k_lora: Option<LoraAdapter>,
    /// LoRA adapter of `v_proj`.
    pub v_lora: Option<LoraAdapter>,
    /// LoRA adapter of `o_proj`.
    pub o_lora: Option<LoraAdapter>,
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of key/value heads.
    pub n_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
}

/// SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp {
    /// Gate projection `[hidden, intermediate]`.
    pub gate_proj: Linear,
    /// Up projection `[hidden, intermediate]`.
    pub up_proj: Linear,
    /// Down projection `[intermediate, hidden]`.
    pub down_proj: Linear,
    /// LoRA adapter of `gate_proj` ([`crate::lora`]); `None` = not adapted.
    pub gate_lora: Option<LoraAdapter>,
    /// LoRA adapter of `up_proj`.
    pub up_lora: Option<LoraAdapter>,
    /// LoRA adapter of `down_proj`.
    pub down_lora: Option<LoraAdapter>,
}

/// One pre-norm transformer block.
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// Norm before attention.
    pub input_layernorm: RmsNorm,
    /// Self-attention.
    pub self_attn: Attention,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// Feed-forward block.
    pub mlp: Mlp,
}

/// The decoder-only transformer (HF `LlamaForCausalLM` / `Qwen2ForCausalLM` layout).
#[derive(Module, Debug)]
pub struct Transformer {
    /// Token embedding `[vocab, hidden]`.
    pub embed_tokens: Embedding,
    /// The blocks.
    pub layers: Vec<DecoderLayer>,
    /// Final norm.
    pub norm: RmsNorm,
    /// Output projection `[hidden, vocab]`; `None` when tied to `embed_tokens`.
    pub lm_head: Option<Linear>,
    /// The configuration this model was built from.
    #[module(skip)]
    pub config: TransformerConfig,
}

/// Key/value cache of one layer: post-RoPE keys and values in buffers
/// `[B, kv_heads, capacity, head_dim]` whose first `len` positions are filled.
///
/// Why buffers: appending by `Tensor::cat` copies every cached key and value of every layer at
/// every decoded token (for SmolLM2 at batch 20 and 1,000 cached tokens, ~0.9 GB per token).
/// Here a new position is written in place (`slice_assign` on the uniquely owned buffer) and a
/// decode step reads the filled prefix as a strided view (see [`decode_attention`]); the buffer
/// is reallocated only when full (to what [`KvCache::reserve`] asked for, else a quarter more).
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    k: Option<Tensor<4>>,
    v: Option<Tensor<4>>,
    /// Filled positions.
    len: usize,
    /// Positions beyond `len` the next allocation makes room for (from [`KvCache::reserve`]).
    spare: usize,
}

/// Smallest growth of a full cache buffer, in positions.
const GROW_MIN: usize = 64;

impl LayerCache {
    /// A cache holding exactly `k`, `v` `[B, kv_heads, T, head_dim]`.
    fn holding(k: Option<Tensor<4>>, v: Option<Tensor<4>>) -> Self {
        let len = k.as_ref().map(|k| k.dims()[2]).unwrap_or(0);
        Self {
            k,
            v,
            len,
            spare: 0,
        }
    }

    /// The filled positions of a buffer (a view; no copy).
    fn filled(buf: &Tensor<4>, len: usize) -> Tensor<4> {
        let [b, h, cap, d] = buf.dims();
        if cap == len {
            buf.clone()
        } else {
            buf.clone().slice([0..b, 0..h, 0..len, 0..d])
        }
    }

    /// Cached keys `[B, kv_heads, len, head_dim]` (a view into the buffer).
    fn keys(&self) -> Option<Tensor<4>> {
        self.k.as_ref().map(|k| Self::filled(k, self.len))
    }

    /// Cached values `[B, kv_heads, len, head_dim]` (a view into the buffer).
    fn values(&self) -> Option<Tensor<4>> {
        self.v.as_ref().map(|v| Self::filled(v, self.len))
    }

    /// Capacity of the buffers (0 when none).
    fn capacity(&self) -> usize {
        self.k.as_ref().map(|k| k.dims()[2]).unwrap_or(0)
    }

    /// Appends `k`, `v` `[B, kv_heads, T_new, head_dim]` (same batch rows as the cache).
    fn append(&mut self, k: Tensor<4>, v: Tensor<4>) {
        let t = k.dims()[2];
        let need = self.len + t;
        self.make_room(t, &k);
        let write = |buf: Option<Tensor<4>>, new: Tensor<4>| {
            let buf = buf.expect("allocated above");
            let [b, h, _, d] = buf.dims();
            buf.slice_assign([0..b, 0..h, self.len..need, 0..d], new)
        };
        self.k = Some(write(self.k.take(), k));
        self.v = Some(write(self.v.take(), v));
        self.len = need;
    }

    /// One decode step's attention on the host ([`crate::fused::decode_attention`]): appends
    /// each row's new key and value from `qkv` `[B, (H + 2 KVH) D]` and attends its queries over
    /// the cache under the key mask `keep` `[B, len + 1]`; the outputs `[B, H D]`. `None`
    /// (cache contents unchanged) where the host path does not apply: the caller runs burn's ops.
    fn decode_host(&mut self, qkv: &[f32], heads: usize, keep: &[bool]) -> Option<Vec<f32>> {
        // The buffer itself gives the shape (the clone is dropped before the in-place write,
        // which would otherwise copy the shared buffer).
        let like = self.k.clone()?;
        self.make_room(1, &like);
        drop(like);
        let out =
            crate::fused::decode_attention(&mut self.k, &mut self.v, self.len, qkv, heads, keep)?;
        self.len += 1;
        Some(out)
    }

    /// Grows the buffers, if they cannot take `t` more positions, to what [`KvCache::reserve`]
    /// asked for, else a quarter more than needed; `like` `[B, kv_heads, _, head_dim]` gives the
    /// shape and device of a first allocation.
    fn make_room(&mut self, t: usize, like: &Tensor<4>) {
        let need = self.len + t;
        if need > self.capacity() {
            let cap = if need <= self.len + self.spare {
                self.len + self.spare
            } else {
                need + (need / 4).max(GROW_MIN)
            };
            self.k = Some(Self::regrow(self.k.take(), self.len, cap, like));
            self.v = Some(Self::regrow(self.v.take(), self.len, cap, like));
            self.spare = 0;
        }
    }

    /// A zeroed buffer of `cap` positions shaped like `like`, holding the first `len` positions
    /// of `old`.
    fn regrow(old: Option<Tensor<4>>, len: usize, cap: usize, like: &Tensor<4>) -> Tensor<4> {
        let [b, h, _, d] = like.dims();
        let buf = Tensor::<4>::zeros([b, h, cap, d], &like.device());
        match old {
            Some(old) if len > 0 => {
                buf.slice_assign([0..b, 0..h, 0..len, 0..d], Self::filled(&old, len))
            }
            _ => buf,
        }
    }

    /// Makes room for `additional` positions beyond the filled ones: now when the buffers exist,
    /// else at their first allocation.
    fn reserve(&mut self, additional: usize) {
        let need = self.len + additional;
        match (&self.k, &self.v) {
            (Some(k), Some(_)) if need > self.capacity() => {
                let like = k.clone();
                self.k = Some(Self::regrow(self.k.take(), self.len, need, &like));
                self.v = Some(Self::regrow(self.v.take(), self.len, need, &like));
            }
            (Some(_), Some(_)) => {}
            _ => self.spare = additional,
        }
    }
}

/// Key/value cache for incremental decoding (one entry per layer).
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<LayerCache>,
}

impl KvCache {
    /// An empty cache for `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self {
            layers: vec![LayerCache::default(); n_layers],
        }
    }

    /// Number of cached positions (0 when empty).
    pub fn len(&self) -> usize {
        self.layers.first().map(|l| l.len).unwrap_or(0)
    }

    /// Number of layers it has room for.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions the buffers hold room for without reallocating (filled ones included).
    pub fn capacity(&self) -> usize {
        self.layers.first().map(LayerCache::capacity).unwrap_or(0)
    }

    /// Makes room for `additional` positions beyond the cached ones, so that appending them
    /// (e.g. a prefill and `max_new_tokens` decode steps) reallocates nothing: now when keys are
    /// cached, else at the first append.
    pub fn reserve(&mut self, additional: usize) {
        for l in &mut self.layers {
            l.reserve(additional);
        }
    }

    /// Keep only the batch rows `rows` (drop finished sequences).
    pub fn select_rows(&mut self, rows: Tensor<1, Int>) {
        for l in &mut self.layers {
            l.k = l.k.take().map(|k| k.select(0, rows.clone()));
            l.v = l.v.take().map(|v| v.select(0, rows.clone()));
        }
    }

    /// Batch row `row`, cached positions `keep` (in order; e.g. the real, non-padding keys of a
    /// left-padded batch), as a one-row cache.
    pub fn extract_row(&self, row: usize, keep: &[usize]) -> KvCache {
        let pick = |t: &Tensor<4>| {
            let idx = Tensor::<1, Int>::from_data(
                TensorData::new(keep.iter().map(|&i| i as i64).collect(), [keep.len()]),
                &t.device(),
            );
            let [_, h, n, d] = t.dims();
            t.clone()
                .slice([row..row + 1, 0..h, 0..n, 0..d])
                .select(2, idx)
        };
        self.map(pick)
    }

    /// The first `len` cached positions (of every row).
    pub fn truncated(&self, len: usize) -> KvCache {
        let cut = |t: &Tensor<4>| {
            let [b, h, _, d] = t.dims();
            t.clone().slice([0..b, 0..h, 0..len, 0..d])
        };
        self.map(cut)
    }

    /// `f` applied to every layer's cached keys and values (the filled positions).
    fn map(&self, f: impl Fn(&Tensor<4>) -> Tensor<4>) -> KvCache {
        KvCache {
            layers: self
                .layers
                .iter()
                .map(|l| {
                    LayerCache::holding(l.keys().as_ref().map(&f), l.values().as_ref().map(&f))
                })
                .collect(),
        }
    }

    /// One batch of one-row caches (`None` or empty = nothing cached), each left-padded with zeros
    /// to `len` positions: row `i`'s keys sit at `len - rows[i].len() .. len` (mask the rest).
    /// `like` gives the layer count and head shapes. Every row must hold at most `len` positions.
    pub fn stack_left_padded(rows: &[Option<&KvCache>], len: usize, like: &KvCache) -> KvCache {
        let n_layers = like.layers.len();
        let mut layers = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let stack = |get: fn(&LayerCache) -> Option<Tensor<4>>| -> Option<Tensor<4>> {
                let proto = get(&like.layers[l])?;
                let [_, h, _, d] = proto.dims();
                let device = proto.device();
                let parts: Vec<Tensor<4>> = rows
                    .iter()
                    .map(|r| {
                        let have = r.and_then(|c| c.layers.get(l)).and_then(get);
                        let n = have.as_ref().map(|t| t.dims()[2]).unwrap_or(0);
                        let pad = Tensor::<4>::zeros([1, h, len - n, d], &device);
                        match have {
                            Some(t) if n > 0 => Tensor::cat(vec![pad, t], 2),
                            _ => pad,
                        }
                    })
                    .collect();
                Some(Tensor::cat(parts, 0))
            };
            layers.push(LayerCache::holding(
                stack(LayerCache::keys),
                stack(LayerCache::values),
            ));
        }
        KvCache { layers }
    }
}

/// RoPE inverse frequencies (HF `_compute_default_rope_parameters` and the `linear` / `llama3`
/// variants), in f32 like HF.
pub(crate) fn rope_inv_freq(cfg: &TransformerConfig) -> Vec<f32> {
    let hd = cfg.head_dim();
    let mut inv: Vec<f32> = (0..hd / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / hd as f32;
            1.0 / (cfg.rope_theta as f32).powf(exponent)
        })
        .collect();
    if let Some(s) = &cfg.rope_scaling {
        match s.rope_type.as_str() {
            "linear" => inv.iter_mut().for_each(|f| *f /= s.factor as f32),
            "llama3" => {
                let factor = s.factor as f32;
                let low = s.low_freq_factor as f32;
                let high = s.high_freq_factor as f32;
                let old_ctx = s.original_max_position_embeddings as f32;
                let low_wavelen = old_ctx / low;
                let high_wavelen = old_ctx / high;
                for f in inv.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old_ctx / wavelen - low) / (high - low);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
            _ => {}
        }
    }
    inv
}

/// `cos` and `sin` tables `[B, 1, T, head_dim]` for the given positions `[B, T]`.
fn rope_tables(
    inv_freq: &[f32],
    positions: Tensor<2, Int>,
    device: &Device,
) -> (Tensor<4>, Tensor<4>) {
    let [b, t] = positions.dims();
    let half = inv_freq.len();
    let inv = Tensor::<1>::from_data(TensorData::new(inv_freq.to_vec(), [half]), device)
        .reshape([1, 1, half]);
    let freqs = positions.float().reshape([b, t, 1]) * inv;
    let emb = Tensor::cat(vec![freqs.clone(), freqs], 2).reshape([b, 1, t, 2 * half]);
    // The tables are constants: keep them off the autodiff graph.
    (emb.clone().cos().detach(), emb.sin().detach())
}

/// Repeat each key/value head `n` times along dim 1 (`[B, kvh, T, d] -> [B, kvh*n, T, d]`).
fn repeat_kv(x: Tensor<4>, n: usize) -> Tensor<4> {
    if n == 1 {
        return x;
    }
    let [b, kvh, t, d] = x.dims();
    x.reshape([b, kvh, 1, t, d])
        .expand([b, kvh, n, t, d])
        .reshape([b, kvh * n, t, d])
}

impl Attention {
    fn forward(
        &self,
        x: Tensor<3>,
        rope_tables: &(Tensor<4>, Tensor<4>),
        mask: Option<Tensor<4, Bool>>,
        is_causal: bool,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let [b, t, _] = x.dims();
        let (h, kvh, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        // RoPE on the projections' own `[B, T, heads, head_dim]` layout.
        let q = rope(
            project(&self.q_proj, &self.q_lora, x.clone()).reshape([b, t, h, hd]),
            &rope_tables.0,
            &rope_tables.1,
        );
        let k = rope(
            project(&self.k_proj, &self.k_lora, x.clone()).reshape([b, t, kvh, hd]),
            &rope_tables.0,
            &rope_tables.1,
        );
        let v = project(&self.v_proj, &self.v_lora, x).reshape([b, t, kvh, hd]);
        // Full forwards on the CPU (training, scoring, and a generation's prefill into an empty
        // cache): the fused attention (with its own backward pass on autodiff devices) on that
        // layout, no head-first copies or repeated kv heads (scoring 4 x 1,042 tokens: 4.7-4.8 s
        // vs 5.0-5.1 s with burn-flex's kernel). A prefill's padding queries, whose keys are all
        // masked, get zeros instead of burn's uniform average: only their own (unused) hidden
        // states see the difference, never a real token's.
        if cache.as_ref().is_none_or(|c| c.len == 0)
            && let Some(out) =
                crate::fused::attention(q.clone(), k.clone(), v.clone(), mask.clone(), is_causal)
        {
            if let Some(cache) = cache {
                cache.append(k.swap_dims(1, 2), v.swap_dims(1, 2));
            }
            return project(&self.o_proj, &self.o_lora, out.reshape([b, t, h * hd]));
        }
        let q = q.swap_dims(1, 2);
        let mut k = k.swap_dims(1, 2);
        let mut v = v.swap_dims(1, 2);
        if let Some(cache) = cache {
            let had = cache.len > 0;
            cache.append(k.clone(), v.clone());
            if had {
                k = cache.keys().expect("appended");
                v = cache.values().expect("appended");
                if t == 1 && !q.device().is_autodiff() {
                    let out = decode_attention(q, k, v, mask, kvh);
                    let out = out.swap_dims(1, 2).reshape([b, t, h * hd]);
                    return project(&self.o_proj, &self.o_lora, out);
                }
            }
        }
        // burn-flex's attention kernel handles grouped-query heads itself; the autodiff
        // fallback needs equal head counts.
        if x_needs_repeat(&q, h, kvh) {
            k = repeat_kv(k, h / kvh);
            v = repeat_kv(v, h / kvh);
        }
        let options = AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal,
        };
        let out = attention(q, k, v, mask, None, options);
        let out = out.swap_dims(1, 2).reshape([b, t, h * hd]);
        project(&self.o_proj, &self.o_lora, out)
    }
}

/// Burn's decode attention, where the host kernel ([`crate::fused::decode_attention`]) does not
/// apply (other backends). Attention of one new query per row (`q` `[B, heads, 1, head_dim]`) over the cached keys and
/// values `[B, kv_heads, L, head_dim]`, as two batched matmuls: `softmax(q k^T / sqrt(d)) v`
/// with the key-padding `mask` `[B, 1, 1, L]` (true = forbidden). The query heads that share a
/// key/value head are stacked as rows of one matrix (grouped-query attention without repeating
/// the keys). Why not the fused kernel: the cache's keys are a strided view of a longer buffer,
/// which burn-flex's matmul reads in place while its attention kernel copies them first, and
/// that copy is what the preallocated cache exists to avoid.
fn decode_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    kvh: usize,
) -> Tensor<4> {
    let [b, h, t, hd] = q.dims();
    let l = k.dims()[2];
    let rows = h / kvh * t;
    let q = q.reshape([b, kvh, rows, hd]);
    let scores = q.matmul(k.swap_dims(2, 3)) * (1.0 / (hd as f64).sqrt());
    let scores = match mask {
        // A finite fill: a row whose keys were all masked stays finite (uniform), as in the
        // fused kernel; in generation the newest key is always real.
        Some(m) => scores.mask_fill(m.expand([b, kvh, rows, l]), -1e30),
        None => scores,
    };
    softmax(scores, 3).matmul(v).reshape([b, h, t, hd])
}

fn x_needs_repeat(q: &Tensor<4>, h: usize, kvh: usize) -> bool {
    h != kvh && q.device().is_autodiff()
}

impl Mlp {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let g = project(&self.gate_proj, &self.gate_lora, x.clone());
        let u = project(&self.up_proj, &self.up_lora, x);
        project(&self.down_proj, &self.down_lora, swiglu(g, u))
    }
}

impl DecoderLayer {
    fn forward(
        &self,
        x: Tensor<3>,
        rope: &(Tensor<4>, Tensor<4>),
        mask: Option<Tensor<4, Bool>>,
        is_causal: bool,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let h = x.clone()
            + self.self_attn.forward(
                rms_norm(&self.input_layernorm, x),
                rope,
                mask,
                is_causal,
                cache,
            );
        h.clone()
            + self
                .mlp
                .forward(rms_norm(&self.post_attention_layernorm, h))
    }
}

/// One decode step of one layer on the host residual stream `x` `[B, hidden]` (row-major),
/// updated in place: RMSNorm, the fused q/k/v product, RoPE at `rope` (`[B, head_dim]` cos
/// and sin per row), the cache write and the attention under the key mask `key_mask` `[B, L]`
/// (true = real key) on the host ([`crate::fused::decode_attention`]; burn's
/// [`decode_attention`] where that does not apply), the output projection, the residual, RMSNorm, the fused gate/up product, SiLU x up, the down
/// product, the residual. Same arithmetic as [`DecoderLayer::forward`] up to float rounding.
fn decode_layer(
    x: &mut [f32],
    packed: &LayerPacked,
    rope: &(Vec<f32>, Vec<f32>),
    key_mask: &[bool],
    cache: &mut LayerCache,
    device: &Device,
) {
    let d = packed.o.n();
    let b = x.len() / d;
    let (h, kvh, hd) = (packed.heads, packed.kv_heads, packed.head_dim);
    let mut qkv = packed
        .qkv
        .matmul(&host_rms_norm(x, &packed.input_norm, packed.eps));
    // RoPE (rotate-half) on the query and key heads of every row.
    let width = (h + 2 * kvh) * hd;
    let half = hd / 2;
    for (r, row) in qkv.chunks_exact_mut(width).enumerate() {
        let (cos, sin) = (&rope.0[r * hd..(r + 1) * hd], &rope.1[r * hd..(r + 1) * hd]);
        for head in row[..(h + kvh) * hd].chunks_exact_mut(hd) {
            for j in 0..half {
                let (x1, x2) = (head[j], head[j + half]);
                head[j] = x1 * cos[j] - x2 * sin[j];
                head[j + half] = x2 * cos[j + half] + x1 * sin[j + half];
            }
        }
    }
    let attn = match cache.decode_host(&qkv, h, key_mask) {
        Some(out) => out,
        None => {
            let qkv = Tensor::<3>::from_data(TensorData::new(qkv, [b, 1, width]), device);
            let part = |from: usize, heads: usize| {
                qkv.clone()
                    .slice([0..b, 0..1, from * hd..(from + heads) * hd])
                    .reshape([b, 1, heads, hd])
                    .swap_dims(1, 2)
            };
            cache.append(part(h, kvh), part(h + kvh, kvh));
            let keys = cache.keys().expect("appended");
            let values = cache.values().expect("appended");
            let l = key_mask.len() / b.max(1);
            let mask = key_padding_mask(Tensor::<2, Bool>::from_data(
                TensorData::new(key_mask.to_vec(), [b, l]),
                device,
            ));
            host(
                decode_attention(part(0, h), keys, values, Some(mask), kvh)
                    .swap_dims(1, 2)
                    .reshape([b, 1, h * hd]),
            )
        }
    };
    for (xv, o) in x.iter_mut().zip(packed.o.matmul(&attn)) {
        *xv += o;
    }
    let gu = packed
        .gate_up
        .matmul(&host_rms_norm(x, &packed.post_norm, packed.eps));
    let inter = packed.down.k();
    let mut act = vec![0.0f32; gu.len() / 2];
    for (row, a) in gu.chunks_exact(2 * inter).zip(act.chunks_exact_mut(inter)) {
        let (g, u) = row.split_at(inter);
        crate::vmath::silu_mul(g, u, a);
    }
    for (xv, o) in x.iter_mut().zip(packed.down.matmul(&act)) {
        *xv += o;
    }
}

/// [`rms_norm`] of the rows of `x` `[B, gamma.len()]` on the host.
fn host_rms_norm(x: &[f32], gamma: &[f32], eps: f64) -> Vec<f32> {
    let d = gamma.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let rms = (ms + eps as f32).sqrt();
        out.extend(row.iter().zip(gamma).map(|(v, g)| v / rms * g));
    }
    out
}

/// The host values of a tensor, row-major.
fn host<const D: usize>(x: Tensor<D>) -> Vec<f32> {
    x.into_data()
        .try_into_vec_as::<f32>()
        .expect("float tensor")
}

/// One layer's projections packed for decode steps: q/k/v fused, o, gate/up fused, down.
#[derive(Debug, Clone)]
struct LayerPacked {
    qkv: PackedMatrix,
    o: PackedMatrix,
    gate_up: PackedMatrix,
    down: PackedMatrix,
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    eps: f64,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Every projection of a [`Transformer`] packed for the decode steps of generation
/// ([`crate::skinny`]), LoRA adapters merged in: built by [`Transformer::decode_weights`] once
/// per generation call, valid while the model's weights do not change.
#[derive(Debug, Clone)]
pub struct DecodeWeights {
    layers: Vec<LayerPacked>,
    head: PackedMatrix,
    norm: Vec<f32>,
    norm_eps: f64,
    inv_freq: Vec<f32>,
}

impl DecodeWeights {
    /// Bytes the packed copies hold.
    pub fn bytes(&self) -> usize {
        self.head.bytes()
            + self
                .layers
                .iter()
                .map(|l| l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes())
                .sum::<usize>()
    }

    /// Logits `[M, vocab]` (row-major) of already-normed hidden states `[M, hidden]`.
    pub fn logits(&self, normed: &[f32]) -> Vec<f32> {
        self.head.matmul(normed)
    }
}

/// Largest model (f32 projection bytes) whose projections generation packs: the packed copy
/// costs as much memory again.
pub const DECODE_PACK_MAX_BYTES: usize = 4 << 30;

/// A linear layer's merged weight `[d_in, n]` and bias on the host.
struct HostLinear {
    w: Vec<f32>,
    n: usize,
    bias: Option<Vec<f32>>,
}

/// The host copy of `linear` with its LoRA adapter (if any) merged in.
fn host_linear(linear: &Linear, lora: &Option<LoraAdapter>) -> HostLinear {
    let w = linear.weight.val().detach();
    let w = match lora {
        Some(l) => w + l.weight_delta().detach(),
        None => w,
    };
    let n = w.dims()[1];
    let bias = linear.bias.as_ref().map(|b| host(b.val().detach()));
    HostLinear {
        w: host(w),
        n,
        bias,
    }
}

fn pack_parts(k: usize, parts: &[HostLinear]) -> PackedMatrix {
    let refs: Vec<Part<'_>> = parts
        .iter()
        .map(|p| Part {
            w: &p.w,
            n: p.n,
            bias: p.bias.as_deref(),
        })
        .collect();
    PackedMatrix::pack(k, &refs)
}

impl Transformer {
    /// A freshly initialised model (prefer [`TransformerConfig::init`], which validates).
    pub(crate) fn init(cfg: &TransformerConfig, device: &Device) -> Self {
        let d = cfg.hidden_size;
        let hd = cfg.head_dim();
        let (h, kvh) = (cfg.num_attention_heads, cfg.kv_heads());
        let std = cfg.initializer_range;
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| DecoderLayer {
                input_layernorm: init_rms_norm(d, cfg.rms_norm_eps, device),
                self_attn: Attention {
                    q_proj: init_linear(d, h * hd, cfg.attention_bias, std, device),
                    k_proj: init_linear(d, kvh * hd, cfg.attention_bias, std, device),
                    v_proj: init_linear(d, kvh * hd, cfg.attention_bias, std, device),
                    o_proj: init_linear(h * hd, d, false, std, device),
                    n_heads: h,
                    n_kv_heads: kvh,
                    head_dim: hd,
                    q_lora: None,
                    k_lora: None,
                    v_lora: None,
                    o_lora: None,
                },
                post_attention_layernorm: init_rms_norm(d, cfg.rms_norm_eps, device),
                mlp: Mlp {
                    gate_proj: init_linear(d, cfg.intermediate_size, cfg.mlp_bias, std, device),
                    up_proj: init_linear(d, cfg.intermediate_size, cfg.mlp_bias, std, device),
                    down_proj: init_linear(cfg.intermediate_size, d, cfg.mlp_bias, std, device),
                    gate_lora: None,
                    up_lora: None,
                    down_lora: None,
                },
            })
            .collect();
        let embed =
            Tensor::<2>::random([cfg.vocab_size, d], Distribution::Normal(0.0, std), device);
        Transformer {
            embed_tokens: Embedding {
                weight: Param::from_tensor(embed),
            },
            layers,
            norm: init_rms_norm(d, cfg.rms_norm_eps, device),
            lm_head: (!cfg.tie_word_embeddings)
                .then(|| init_linear(d, cfg.vocab_size, false, std, device)),
            config: cfg.clone(),
        }
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }

    /// The device holding the weights.
    pub fn device(&self) -> Device {
        self.embed_tokens.weight.val().device()
    }

    /// tokens `[B, T]` (Int) -> logits `[B, T, vocab]`. Causal when `config.causal`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..t as i64, &device)
            .reshape([1, t])
            .expand([b, t]);
        let hidden = self.hidden_states(tokens, positions, None, self.config.causal, None);
        self.logits(hidden)
    }

    /// Same as [`Self::forward`] with left padding: `attention_mask` `[B, T]` is true on real
    /// tokens; padded keys are masked out and positions count real tokens only (position 0 is
    /// the first real token), as HF `generate` does. Logits at padded positions are
    /// meaningless.
    pub fn forward_masked(
        &self,
        tokens: Tensor<2, Int>,
        attention_mask: Tensor<2, Bool>,
    ) -> Tensor<3> {
        self.logits(self.hidden_masked(tokens, attention_mask))
    }

    /// The hidden states of [`Self::forward_masked`] before the final norm and the output
    /// projection, `[B, T, hidden]`: for callers that need the logits at a few positions only
    /// (gather the positions, then [`Self::logits`]), where the projection to a large vocabulary
    /// would otherwise dominate the cost and the memory.
    pub fn hidden_masked(
        &self,
        tokens: Tensor<2, Int>,
        attention_mask: Tensor<2, Bool>,
    ) -> Tensor<3> {
        let positions = positions_from_mask(attention_mask.clone());
        let mask = key_padding_mask(attention_mask);
        self.hidden_states(tokens, positions, Some(mask), self.config.causal, None)
    }

    /// Incremental forward for generation: runs `tokens` `[B, T_new]` at `positions`
    /// `[B, T_new]`, attending to everything in `cache` plus the new tokens; `key_mask`
    /// `[B, T_cached + T_new]` is true on real (non-padding) keys. Appends the new keys/values to
    /// `cache` and returns the final hidden states `[B, T_new, hidden]` (after the final norm);
    /// use [`Self::logits_from_normed`] on the positions you need.
    pub fn forward_cached(
        &self,
        tokens: Tensor<2, Int>,
        positions: Tensor<2, Int>,
        key_mask: Tensor<2, Bool>,
        cache: &mut KvCache,
    ) -> Tensor<3> {
        if cache.layers.len() != self.layers.len() {
            *cache = KvCache::new(self.layers.len());
        }
        let mask = key_padding_mask(key_mask);
        let h = self.hidden_states(
            tokens,
            positions,
            Some(mask),
            self.config.causal,
            Some(cache),
        );
        rms_norm(&self.norm, h)
    }

    /// Hidden states before the final norm, `[B, T, hidden]`. `mask` `[B, 1, T_q|1, T_k]` is
    /// true where attention is forbidden; `is_causal` adds the causal constraint aligned at the
    /// bottom-right (so it composes with a KV cache).
    pub fn hidden_states(
        &self,
        tokens: Tensor<2, Int>,
        positions: Tensor<2, Int>,
        mask: Option<Tensor<4, Bool>>,
        is_causal: bool,
        mut cache: Option<&mut KvCache>,
    ) -> Tensor<3> {
        let device = tokens.device();
        let inv_freq = rope_inv_freq(&self.config);
        let rope = rope_tables(&inv_freq, positions, &device);
        let mut x = self.embed_tokens.forward(tokens);
        for (i, layer) in self.layers.iter().enumerate() {
            let lc = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            x = layer.forward(x, &rope, mask.clone(), is_causal, lc);
        }
        x
    }

    /// Final norm + output projection: hidden `[B, T, hidden]` -> logits `[B, T, vocab]`.
    pub fn logits(&self, hidden: Tensor<3>) -> Tensor<3> {
        self.logits_from_normed(rms_norm(&self.norm, hidden))
    }

    /// The output projection `[hidden, vocab]` as a contiguous, detached tensor, for
    /// inference loops that call [`Self::logits_with_head`] many times (with tied embeddings
    /// the projection is a transposed view, which is slow for small batches).
    pub fn inference_head(&self) -> Tensor<2> {
        let w = match &self.lm_head {
            Some(head) => head.weight.val(),
            None => self.embed_tokens.weight.val().transpose(),
        };
        let device = w.device();
        Tensor::from_data(w.into_data(), &device)
    }

    /// Output projection with a head from [`Self::inference_head`] (not differentiable).
    pub fn logits_with_head(&self, normed: Tensor<3>, head: &Tensor<2>) -> Tensor<3> {
        linear(normed, head.clone(), None)
    }

    /// Output projection of already-normed hidden states `[B, T, hidden]` -> `[B, T, vocab]`.
    pub fn logits_from_normed(&self, normed: Tensor<3>) -> Tensor<3> {
        match &self.lm_head {
            Some(head) => crate::fused::linear(
                normed,
                head.weight.val(),
                head.bias.as_ref().map(|b| b.val()),
            ),
            None => crate::fused::linear(normed, self.embed_tokens.weight.val().transpose(), None),
        }
    }

    /// The projections packed for generation's decode steps ([`DecodeWeights`]), or `None`
    /// where the packed path does not apply: an autodiff or non-CPU device (the GPU backends
    /// keep their own kernels), a model above [`DECODE_PACK_MAX_BYTES`], or
    /// `KILN_DECODE=burn` in the environment (burn's matmul for every step, for comparison).
    pub fn decode_weights(&self) -> Option<DecodeWeights> {
        let device = self.device();
        if device.is_autodiff()
            || device != Device::flex()
            || std::env::var("KILN_DECODE").is_ok_and(|v| v == "burn")
        {
            tracing::debug!(?device, "decode steps on burn's matmul (no packed weights)");
            return None;
        }
        let cfg = &self.config;
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (h, kvh, hd) = (cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let per_layer = d * (h + 2 * kvh) * hd + h * hd * d + 3 * d * i;
        let bytes = 4 * (cfg.num_hidden_layers * per_layer + d * cfg.vocab_size);
        if bytes > DECODE_PACK_MAX_BYTES {
            return None;
        }
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let a = &l.self_attn;
                let m = &l.mlp;
                LayerPacked {
                    qkv: pack_parts(
                        d,
                        &[
                            host_linear(&a.q_proj, &a.q_lora),
                            host_linear(&a.k_proj, &a.k_lora),
                            host_linear(&a.v_proj, &a.v_lora),
                        ],
                    ),
                    o: pack_parts(h * hd, &[host_linear(&a.o_proj, &a.o_lora)]),
                    gate_up: pack_parts(
                        d,
                        &[
                            host_linear(&m.gate_proj, &m.gate_lora),
                            host_linear(&m.up_proj, &m.up_lora),
                        ],
                    ),
                    down: pack_parts(i, &[host_linear(&m.down_proj, &m.down_lora)]),
                    input_norm: host(l.input_layernorm.gamma.val().detach()),
                    post_norm: host(l.post_attention_layernorm.gamma.val().detach()),
                    eps: l.input_layernorm.epsilon,
                    heads: h,
                    kv_heads: kvh,
                    head_dim: hd,
                }
            })
            .collect();
        let head = host(self.inference_head());
        let head = PackedMatrix::pack(
            d,
            &[Part {
                w: &head,
                n: cfg.vocab_size,
                bias: None,
            }],
        );
        Some(DecodeWeights {
            layers,
            head,
            norm: host(self.norm.gamma.val().detach()),
            norm_eps: self.norm.epsilon,
            inv_freq: rope_inv_freq(cfg),
        })
    }

    /// [`Self::forward_cached`] for one new token per row, `tokens` at `positions` (one
    /// each per row), `key_mask` `[B, T_cached + 1]` true on real keys, with the projections of
    /// `weights`: the residual stream, norms, RoPE and MLP run on the host, the attention over the
    /// cache in burn ([`decode_attention`]). Returns the logits `[B, vocab]`
    /// on the host. Same results as `forward_cached` + [`Self::logits_with_head`] up to float
    /// rounding (tested).
    ///
    /// # Panics
    /// If `tokens` and `positions` differ in length, `key_mask` is not `[B, T_cached + 1]`, or
    /// `weights` belong to a model of another depth.
    pub fn forward_decode(
        &self,
        tokens: &[u32],
        positions: &[i64],
        key_mask: &[bool],
        cache: &mut KvCache,
        weights: &DecodeWeights,
    ) -> Vec<f32> {
        assert_eq!(tokens.len(), positions.len(), "one position per token");
        assert_eq!(
            weights.layers.len(),
            self.layers.len(),
            "weights of another model"
        );
        if cache.layers.len() != self.layers.len() {
            *cache = KvCache::new(self.layers.len());
        }
        let device = self.device();
        let b = tokens.len();
        let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, 1]), &device);
        let mut x = host(self.embed_tokens.forward(ids));
        // cos / sin tables [B, head_dim] as `rope_tables` computes them (f32 angles).
        let half = weights.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(b * 2 * half), Vec::new());
        sin.reserve(b * 2 * half);
        for &p in positions {
            for _ in 0..2 {
                for &f in &weights.inv_freq {
                    let angle = p as f32 * f;
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        let rope = (cos, sin);
        let l = key_mask.len() / b.max(1);
        assert_eq!(
            key_mask.len(),
            b * l,
            "key mask of {} for {b} rows",
            key_mask.len()
        );
        // The step runs on a rayon worker: its ~4 parallel products per layer then fork from
        // inside the pool instead of each one parking the calling thread until the pool is
        // done with it (measured ~8% of a SmolLM2 decode step at batch 8).
        rayon::scope(|_| {
            for (lc, packed) in cache.layers.iter_mut().zip(&weights.layers) {
                decode_layer(&mut x, packed, &rope, key_mask, lc, &device);
            }
            weights.logits(&host_rms_norm(&x, &weights.norm, weights.norm_eps))
        })
    }
}

/// Positions `[B, T]` from a left-padding mask (true = real token): the number of real tokens
/// before each position, 0 on padding.
pub fn positions_from_mask(attention_mask: Tensor<2, Bool>) -> Tensor<2, Int> {
    let m = attention_mask.int();
    (m.cumsum(1) - 1).clamp_min(0)
}

/// `[B, T]` true-on-real-token mask -> `[B, 1, 1, T]` true-on-padding attention mask.
fn key_padding_mask(attention_mask: Tensor<2, Bool>) -> Tensor<4, Bool> {
    let [b, t] = attention_mask.dims();
    attention_mask.bool_not().reshape([b, 1, 1, t])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::activation::log_softmax;

    fn tiny(causal: bool, kv: usize) -> TransformerConfig {
        TransformerConfig {
            vocab_size: 50,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: Some(kv),
            causal,
            ..Default::default()
        }
    }

    fn ids(device: &Device, rows: &[&[i64]]) -> Tensor<2, Int> {
        let t = rows[0].len();
        let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_data(TensorData::new(flat, [rows.len(), t]), device)
    }

    fn vec3(x: Tensor<3>) -> Vec<f32> {
        x.into_data().try_into_vec_as::<f32>().unwrap()
    }

    #[test]
    fn causal_prefix_is_independent_of_suffix() {
        let device = Device::flex();
        device.seed(1);
        let model = tiny(true, 2).init(&device);
        let a = model.forward(ids(&device, &[&[1, 2, 3, 4, 5]]));
        let b = model.forward(ids(&device, &[&[1, 2, 3, 9, 9]]));
        let a = vec3(a.slice([0..1, 0..3, 0..50]));
        let b = vec3(b.slice([0..1, 0..3, 0..50]));
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-5);
        }
    }

    #[test]
    fn bidirectional_prefix_depends_on_suffix() {
        let device = Device::flex();
        device.seed(1);
        let model = tiny(false, 4).init(&device);
        let a = vec3(model.forward(ids(&device, &[&[1, 2, 3, 4, 5]])));
        let b = vec3(model.forward(ids(&device, &[&[1, 2, 3, 9, 9]])));
        assert!((a[0] - b[0]).abs() > 1e-7);
    }

    #[test]
    fn left_padding_matches_unpadded() {
        let device = Device::flex();
        device.seed(2);
        let model = tiny(true, 2).init(&device);
        let plain = vec3(model.forward(ids(&device, &[&[7, 8, 9]])));
        let toks = ids(&device, &[&[0, 0, 7, 8, 9], &[1, 2, 3, 4, 5]]);
        let mask = Tensor::<2, Bool>::from_data(
            TensorData::new(
                vec![false, false, true, true, true, true, true, true, true, true],
                [2, 5],
            ),
            &device,
        );
        let padded = model.forward_masked(toks, mask);
        let padded = vec3(padded.slice([0..1, 2..5, 0..50]));
        for (x, y) in plain.iter().zip(&padded) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
    }

    #[test]
    fn kv_cache_matches_full_forward() {
        let device = Device::flex();
        device.seed(3);
        let model = tiny(true, 2).init(&device);
        let full = vec3(model.forward(ids(&device, &[&[4, 5, 6, 7]])));
        let mut cache = KvCache::new(2);
        let mut got = Vec::new();
        let all_true = |n: usize| {
            Tensor::<2, Bool>::from_data(TensorData::new(vec![true; n], [1, n]), &device)
        };
        let h = model.forward_cached(
            ids(&device, &[&[4, 5]]),
            ids(&device, &[&[0, 1]]),
            all_true(2),
            &mut cache,
        );
        got.extend(vec3(model.logits_from_normed(h)));
        for (i, tok) in [6i64, 7].into_iter().enumerate() {
            let p = 2 + i as i64;
            let h = model.forward_cached(
                ids(&device, &[&[tok]]),
                ids(&device, &[&[p]]),
                all_true(3 + i),
                &mut cache,
            );
            got.extend(vec3(model.logits_from_normed(h)));
        }
        assert_eq!(cache.len(), 4);
        for (x, y) in full.iter().zip(&got) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
    }

    /// Decoding through the preallocated cache: a left-padded batch of two, past the buffer's
    /// first capacity (it regrows) or inside a reserved one, a row dropped half-way; every
    /// step's logits equal a full forward of the sequence so far.
    /// Decode step `s`'s token for each row (a fixed pattern) and its position (the row's real
    /// tokens so far); appends the tokens to `seqs` and a real key to `real`.
    fn next_tokens(
        s: usize,
        seqs: &mut [Vec<i64>],
        real: &mut [Vec<bool>],
    ) -> (Vec<u32>, Vec<i64>) {
        let toks: Vec<u32> = (0..seqs.len())
            .map(|r| ((s * 7 + r * 3) % 50) as u32)
            .collect();
        let pos: Vec<i64> = real
            .iter()
            .map(|m| m.iter().filter(|&&x| x).count() as i64)
            .collect();
        for ((seq, m), &t) in seqs.iter_mut().zip(real.iter_mut()).zip(&toks) {
            seq.push(i64::from(t));
            m.push(true);
        }
        (toks, pos)
    }

    fn decode_against_full_forward(kv: usize, reserve: bool) {
        let device = Device::flex();
        device.seed(5);
        let model = tiny(true, kv).init(&device);
        let steps = 80;
        let mut seqs: Vec<Vec<i64>> = vec![vec![0, 0, 7, 8, 9], vec![1, 2, 3, 4, 5]];
        let mut real: Vec<Vec<bool>> = vec![vec![false, false, true, true, true], vec![true; 5]];
        let bool2 = |rows: &[Vec<bool>]| {
            let t = rows[0].len();
            Tensor::<2, Bool>::from_data(TensorData::new(rows.concat(), [rows.len(), t]), &device)
        };
        let last_logits = |seqs: &[Vec<i64>], real: &[Vec<bool>]| {
            let rows: Vec<&[i64]> = seqs.iter().map(Vec::as_slice).collect();
            let t = seqs[0].len();
            let full = model.forward_masked(ids(&device, &rows), bool2(real));
            vec3(full.slice([0..seqs.len(), t - 1..t, 0..50]))
        };
        let mut cache = KvCache::new(2);
        if reserve {
            cache.reserve(5 + steps);
        }
        let h = model.forward_cached(
            ids(&device, &[seqs[0].as_slice(), seqs[1].as_slice()]),
            ids(&device, &[&[0, 0, 0, 1, 2], &[0, 1, 2, 3, 4]]),
            bool2(&real),
            &mut cache,
        );
        let first = vec3(model.logits_from_normed(h.slice([0..2, 4..5, 0..32])));
        let mut worst = 0f32;
        for (x, y) in first.iter().zip(&last_logits(&seqs, &real)) {
            worst = worst.max((x - y).abs());
        }
        let first_capacity = cache.capacity();
        let mut capacities = vec![first_capacity];
        for s in 0..steps {
            if s == 40 {
                cache.select_rows(Tensor::<1, Int>::from_data(
                    TensorData::new(vec![1i64], [1]),
                    &device,
                ));
                seqs.remove(0);
                real.remove(0);
            }
            let (toks, pos) = next_tokens(s, &mut seqs, &mut real);
            let toks: Vec<i64> = toks.into_iter().map(i64::from).collect();
            let n = seqs.len();
            let h = model.forward_cached(
                Tensor::from_data(TensorData::new(toks, [n, 1]), &device),
                Tensor::from_data(TensorData::new(pos, [n, 1]), &device),
                bool2(&real),
                &mut cache,
            );
            let got = vec3(model.logits_from_normed(h));
            let want = last_logits(&seqs, &real);
            for (x, y) in got.iter().zip(&want) {
                worst = worst.max((x - y).abs());
            }
            capacities.push(cache.capacity());
        }
        assert_eq!(cache.len(), 5 + steps);
        assert!(
            worst < 1e-4,
            "kv {kv} reserve {reserve}: max |cached - full| = {worst}"
        );
        if reserve {
            assert_eq!(
                first_capacity,
                5 + steps,
                "the reserved room is allocated at once"
            );
            assert!(
                capacities.iter().all(|&c| c == first_capacity),
                "{capacities:?}"
            );
        } else {
            assert!(first_capacity < 5 + steps, "{first_capacity}");
            assert!(
                capacities.last() > Some(&first_capacity),
                "it regrew: {capacities:?}"
            );
        }
    }

    #[test]
    fn preallocated_cache_decodes_like_a_full_forward() {
        for kv in [1, 2, 4] {
            for reserve in [false, true] {
                decode_against_full_forward(kv, reserve);
            }
        }
    }

    /// A tiny GQA model with q/k/v biases and LoRA adapters whose `B` is not zero on every
    /// projection, so that packing must merge them.
    fn adapted_model(device: &Device) -> Transformer {
        device.seed(9);
        let cfg = TransformerConfig {
            attention_bias: true,
            ..tiny(true, 2)
        };
        let lora = crate::LoraConfig {
            rank: 3,
            ..Default::default()
        };
        let mut model = cfg.init(device).with_lora(&lora);
        let random =
            |shape: [usize; 2]| Tensor::<2>::random(shape, Distribution::Normal(0.0, 0.2), device);
        let adapt = |slot: &mut Option<LoraAdapter>| {
            let [d_in, r] = slot.as_ref().expect("adapted").a.val().dims();
            let d_out = slot.as_ref().expect("adapted").b.val().dims()[1];
            *slot = Some(LoraAdapter::from_factors(
                random([d_in, r]),
                random([r, d_out]),
                &lora,
            ));
        };
        for layer in model.layers.iter_mut() {
            let a = &mut layer.self_attn;
            for slot in [&mut a.q_lora, &mut a.k_lora, &mut a.v_lora, &mut a.o_lora] {
                adapt(slot);
            }
            for lin in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj] {
                let n = lin.weight.val().dims()[1];
                lin.bias = Some(Param::from_tensor(Tensor::<1>::random(
                    [n],
                    Distribution::Normal(0.0, 0.2),
                    device,
                )));
            }
            let m = &mut layer.mlp;
            for slot in [&mut m.gate_lora, &mut m.up_lora, &mut m.down_lora] {
                adapt(slot);
            }
        }
        model
    }

    #[test]
    fn packed_decode_matches_a_full_forward_with_adapters_and_biases() {
        let device = Device::flex();
        let model = adapted_model(&device);
        let weights = model.decode_weights().expect("CPU, small model: packed");
        assert!(weights.bytes() > 0);
        let mut seqs: Vec<Vec<i64>> = vec![vec![0, 0, 7, 8, 9], vec![1, 2, 3, 4, 5]];
        let mut real: Vec<Vec<bool>> = vec![vec![false, false, true, true, true], vec![true; 5]];
        let bool2 = |rows: &[Vec<bool>]| {
            let t = rows[0].len();
            Tensor::<2, Bool>::from_data(TensorData::new(rows.concat(), [rows.len(), t]), &device)
        };
        let mut cache = KvCache::new(2);
        cache.reserve(5 + 30);
        model.forward_cached(
            ids(&device, &[seqs[0].as_slice(), seqs[1].as_slice()]),
            ids(&device, &[&[0, 0, 0, 1, 2], &[0, 1, 2, 3, 4]]),
            bool2(&real),
            &mut cache,
        );
        let mut worst = 0f32;
        for s in 0..30 {
            if s == 12 {
                // A finished row leaves the batch, as in generation.
                cache.select_rows(Tensor::<1, Int>::from_data(
                    TensorData::new(vec![0i64], [1]),
                    &device,
                ));
                seqs.truncate(1);
                real.truncate(1);
            }
            let (toks, pos) = next_tokens(s, &mut seqs, &mut real);
            let got = model.forward_decode(&toks, &pos, &real.concat(), &mut cache, &weights);
            let rows: Vec<&[i64]> = seqs.iter().map(Vec::as_slice).collect();
            let t = seqs[0].len();
            let full = model.forward_masked(ids(&device, &rows), bool2(&real));
            let want = vec3(full.slice([0..seqs.len(), t - 1..t, 0..50]));
            assert_eq!(got.len(), want.len());
            for (x, y) in got.iter().zip(&want) {
                worst = worst.max((x - y).abs());
            }
        }
        assert!(worst < 1e-4, "max |packed decode - full forward| = {worst}");
        // The check can fail: the same step without the adapters' merge is far off.
        let unmerged = model.without_lora().decode_weights().expect("packed");
        let mut cache2 = KvCache::new(2);
        model.forward_cached(
            ids(&device, &[&[1, 2, 3]]),
            ids(&device, &[&[0, 1, 2]]),
            bool2(&[vec![true; 3]]),
            &mut cache2,
        );
        let mut cache3 = cache2.clone();
        let a = model.forward_decode(&[4], &[3], &[true; 4], &mut cache2, &weights);
        let b = model.forward_decode(&[4], &[3], &[true; 4], &mut cache3, &unmerged);
        let gap = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(gap > 1e-2, "adapters changed nothing: {gap}");
    }

    #[test]
    fn host_decode_attention_grows_the_cache_and_leaves_shared_clones_alone() {
        let device = Device::flex();
        let model = adapted_model(&device);
        let weights = model.decode_weights().expect("CPU, small model: packed");
        let all = |n: usize| {
            Tensor::<2, Bool>::from_data(TensorData::new(vec![true; n], [1, n]), &device)
        };
        // No reserve: the prefill's buffers hold exactly its 3 positions, so the host steps must
        // regrow them (twice over 70 steps).
        let prefill = |cache: &mut KvCache| {
            model.forward_cached(
                ids(&device, &[&[1, 2, 3]]),
                ids(&device, &[&[0, 1, 2]]),
                all(3),
                cache,
            )
        };
        let mut cache = KvCache::new(2);
        prefill(&mut cache);
        // The reference: burn's cached decode (its own cache write and attention).
        let mut burn_cache = cache.clone();
        let mut worst = 0f32;
        for s in 0..70usize {
            let tok = 3 + (s * 7 % 40) as u32;
            let pos = 3 + s as i64;
            let got =
                model.forward_decode(&[tok], &[pos], &vec![true; 4 + s], &mut cache, &weights);
            let h = model.forward_cached(
                ids(&device, &[&[tok as i64]]),
                ids(&device, &[&[pos]]),
                all(4 + s),
                &mut burn_cache,
            );
            let want = vec3(model.logits_from_normed(h));
            assert_eq!(got.len(), want.len());
            for (x, y) in got.iter().zip(&want) {
                worst = worst.max((x - y).abs());
            }
        }
        assert!(worst < 1e-4, "max |host decode - burn decode| = {worst}");
        assert_eq!(cache.len(), 73);
        assert!(cache.capacity() >= 73);

        // Two clones share one reserved buffer: each step writes in place, so the first write
        // must copy, or the second clone's key at position 3 would overwrite the first's.
        let mut shared = KvCache::new(2);
        shared.reserve(10);
        prefill(&mut shared);
        let (mut a, mut b) = (shared.clone(), shared.clone());
        let mut reference = shared.clone();
        model.forward_decode(&[5], &[3], &[true; 4], &mut a, &weights);
        model.forward_decode(&[9], &[3], &[true; 4], &mut b, &weights);
        let got = model.forward_decode(&[6], &[4], &[true; 5], &mut a, &weights);
        for (tok, pos) in [(5, 3), (6, 4)] {
            let h = model.forward_cached(
                ids(&device, &[&[tok]]),
                ids(&device, &[&[pos]]),
                all(pos as usize + 1),
                &mut reference,
            );
            if tok == 6 {
                let want = vec3(model.logits_from_normed(h));
                let gap = got
                    .iter()
                    .zip(&want)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(gap < 1e-4, "a clone's step changed another's cache: {gap}");
            }
        }
    }

    #[test]
    fn packed_weights_on_the_cpu_device_only() {
        let device = Device::flex().autodiff();
        device.seed(1);
        let model = tiny(true, 2).init(&device);
        assert!(model.decode_weights().is_none());
        // The trainer's rollout snapshot (`valid()`: the inner, no-grad device) packs.
        assert!(model.valid().decode_weights().is_some());
    }

    #[test]
    fn backward_reaches_every_parameter() {
        let device = Device::flex().autodiff();
        device.seed(4);
        let model = tiny(true, 2).init(&device);
        let toks = ids(&device, &[&[1, 2, 3, 4], &[5, 6, 7, 8]]);
        let mask = Tensor::<2, Bool>::from_data(
            TensorData::new(
                vec![false, true, true, true, true, true, true, true],
                [2, 4],
            ),
            &device,
        );
        let logits = model.forward_masked(toks, mask);
        let loss = log_softmax(logits, 2).mean().neg();
        let grads = loss.backward();
        let g = model.layers[0]
            .self_attn
            .k_proj
            .weight
            .grad(&grads)
            .expect("k_proj grad");
        let s: f32 = g.abs().sum().into_scalar();
        assert!(s > 0.0);
        assert!(model.embed_tokens.weight.grad(&grads).is_some());
    }
}
