//! The one transformer implementation: Llama blocks (RMSNorm, RoPE, SwiGLU MLP, grouped-query
//! attention), configured by [`TransformerConfig`] into Llama, Qwen2 (q/k/v bias) or a
//! bidirectional LLaDA-style masked-diffusion denoiser (`causal: false`).
//!
//! Numerics follow HF `transformers` (rotate-half RoPE computed in f32, RMSNorm in f32), so
//! weights exported from HF give the same logits (see the parity tests).

use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::tensor::activation::silu;
use burn::tensor::module::{attention, linear};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Device, Distribution, Int, Tensor, TensorData};

use crate::config::TransformerConfig;
use crate::lora::{LoraAdapter, project};

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

/// RMSNorm computed like HF (`x * rsqrt(mean(x^2) + eps) * weight`).
fn rms_norm<const D: usize>(norm: &RmsNorm, x: Tensor<D>) -> Tensor<D> {
    let rms = (x.clone().square().mean_dim(D - 1) + norm.epsilon).sqrt();
    (x / rms) * norm.gamma.val().unsqueeze()
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

/// Key/value cache of one layer: post-RoPE keys and values, `[B, kv_heads, T_cached, head_dim]`.
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    k: Option<Tensor<4>>,
    v: Option<Tensor<4>>,
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
        self.layers
            .first()
            .and_then(|l| l.k.as_ref())
            .map(|k| k.dims()[2])
            .unwrap_or(0)
    }

    /// Number of layers it has room for.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

    /// `f` applied to every layer's keys and values.
    fn map(&self, f: impl Fn(&Tensor<4>) -> Tensor<4>) -> KvCache {
        KvCache {
            layers: self
                .layers
                .iter()
                .map(|l| LayerCache {
                    k: l.k.as_ref().map(&f),
                    v: l.v.as_ref().map(&f),
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
            let stack = |get: fn(&LayerCache) -> Option<&Tensor<4>>| -> Option<Tensor<4>> {
                let proto = get(&like.layers[l])?;
                let [_, h, _, d] = proto.dims();
                let device = proto.device();
                let parts: Vec<Tensor<4>> = rows
                    .iter()
                    .map(|r| {
                        let have = r.and_then(|c| c.layers.get(l)).and_then(get);
                        let n = have.map(|t| t.dims()[2]).unwrap_or(0);
                        let pad = Tensor::<4>::zeros([1, h, len - n, d], &device);
                        match have {
                            Some(t) if n > 0 => Tensor::cat(vec![pad, t.clone()], 2),
                            _ => pad,
                        }
                    })
                    .collect();
                Some(Tensor::cat(parts, 0))
            };
            layers.push(LayerCache {
                k: stack(|c| c.k.as_ref()),
                v: stack(|c| c.v.as_ref()),
            });
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

fn rotate_half(x: Tensor<4>) -> Tensor<4> {
    let [b, h, t, d] = x.dims();
    let x1 = x.clone().slice([0..b, 0..h, 0..t, 0..d / 2]);
    let x2 = x.slice([0..b, 0..h, 0..t, d / 2..d]);
    Tensor::cat(vec![x2.neg(), x1], 3)
}

fn apply_rope(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
    x.clone() * cos.clone() + rotate_half(x) * sin.clone()
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
        rope: &(Tensor<4>, Tensor<4>),
        mask: Option<Tensor<4, Bool>>,
        is_causal: bool,
        cache: Option<&mut LayerCache>,
    ) -> Tensor<3> {
        let [b, t, _] = x.dims();
        let (h, kvh, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let q = project(&self.q_proj, &self.q_lora, x.clone())
            .reshape([b, t, h, hd])
            .swap_dims(1, 2);
        let k = project(&self.k_proj, &self.k_lora, x.clone())
            .reshape([b, t, kvh, hd])
            .swap_dims(1, 2);
        let v = project(&self.v_proj, &self.v_lora, x)
            .reshape([b, t, kvh, hd])
            .swap_dims(1, 2);
        let q = apply_rope(q, &rope.0, &rope.1);
        let mut k = apply_rope(k, &rope.0, &rope.1);
        let mut v = v;
        if let Some(cache) = cache {
            if let (Some(pk), Some(pv)) = (cache.k.take(), cache.v.take()) {
                k = Tensor::cat(vec![pk, k], 2);
                v = Tensor::cat(vec![pv, v], 2);
            }
            cache.k = Some(k.clone());
            cache.v = Some(v.clone());
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

fn x_needs_repeat(q: &Tensor<4>, h: usize, kvh: usize) -> bool {
    h != kvh && q.device().is_autodiff()
}

impl Mlp {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let g = silu(project(&self.gate_proj, &self.gate_lora, x.clone()));
        let u = project(&self.up_proj, &self.up_lora, x);
        project(&self.down_proj, &self.down_lora, g * u)
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
            Some(head) => head.forward(normed),
            None => linear(normed, self.embed_tokens.weight.val().transpose(), None),
        }
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
