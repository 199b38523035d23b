//! LoRA (Hu et al. 2021, "LoRA: low-rank adaptation of large language models") for the Llama /
//! Qwen2 projections of [`Transformer`].
//!
//! An adapted projection computes `y = x W + b + scale * dropout(x) A B` with the base `W`, `b`
//! frozen, `A` `[d_in, r]`, `B` `[r, d_out]` trainable and `scale = alpha / r`. The adapters are
//! separate parameters beside the base `Linear` (fields `q_lora`, ..., `down_lora` of
//! [`crate::model::Attention`] and [`crate::model::Mlp`]), not a reparameterised weight: the
//! backward pass then never forms a weight-shaped gradient of the frozen `W` (burn's own
//! `apply_lora` composes `W + scale * A B` and differentiates that dense weight), so a LoRA
//! train step saves the `dW = x^T dy` matmul of every adapted layer and the optimiser holds state
//! for the factors only (the base parameters do not require gradients).
//!
//! Initialisation follows peft: `A` Kaiming-uniform (`U(-1/sqrt(d_in), 1/sqrt(d_in))`, peft's
//! `kaiming_uniform_(a = sqrt(5))`), `B = 0`, so a freshly adapted model computes exactly the
//! base model's logits (the adapter adds exact zeros). [`Transformer::merge_lora`] folds the
//! adapters into the base weights (for export); [`Transformer::without_lora`] is the base model
//! with the adapters off, sharing the base tensors (the RL reference policy without a second
//! copy of the weights). Parity with peft (forward, gradients and one AdamW step) is tested
//! against a fixture made by `scripts/lm/make_lora_fixture.py`.

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig, Linear};
use burn::tensor::module::linear;
use burn::tensor::{Distribution, Tensor};
use serde::{Deserialize, Serialize};

use crate::model::Transformer;

/// The projections LoRA can adapt (HF / peft names).
pub const TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// LoRA settings (a recipe's `lora:` section).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank r of the factors. Default 16.
    pub rank: usize,
    /// Scaling numerator: the update is `alpha / rank * A B`. Default 32.
    pub alpha: f64,
    /// Dropout on the adapter's input during training (0 = off). Default 0. On-policy RL wants 0:
    /// with dropout the re-scored log-probs differ from the sampled ones and the trainer's ratio
    /// check (`trainer.ratio_tolerance`) fails the step.
    pub dropout: f64,
    /// Projections to adapt, of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj.
    /// Default: all seven.
    pub target_modules: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            target_modules: TARGETS.iter().map(|s| s.to_string()).collect(),
        }
    }
}

impl LoraConfig {
    /// Checks the settings; the message names the field and the allowed values.
    pub fn validate(&self) -> Result<(), String> {
        if self.rank == 0 {
            return Err("lora.rank must be at least 1".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(format!(
                "lora.alpha must be a positive number, got {}",
                self.alpha
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!(
                "lora.dropout must be in [0, 1), got {}",
                self.dropout
            ));
        }
        if self.target_modules.is_empty() {
            return Err(format!(
                "lora.target_modules is empty; name some of {}",
                TARGETS.join(", ")
            ));
        }
        for t in &self.target_modules {
            if !TARGETS.contains(&t.as_str()) {
                return Err(format!(
                    "lora.target_modules: unknown module `{t}`; use {}",
                    TARGETS.join(", ")
                ));
            }
        }
        Ok(())
    }

    fn targets(&self, name: &str) -> bool {
        self.target_modules.iter().any(|t| t == name)
    }
}

/// The trainable factors of one adapted projection.
#[derive(Module, Debug)]
pub struct LoraAdapter {
    /// Down-projection `[d_in, r]`.
    pub a: Param<Tensor<2>>,
    /// Up-projection `[r, d_out]`.
    pub b: Param<Tensor<2>>,
    /// Dropout on the adapter's input (active only on an autodiff device).
    pub dropout: Dropout,
    /// `alpha / r`.
    #[module(skip)]
    pub scale: f64,
}

impl LoraAdapter {
    /// A peft-initialised adapter for a `[d_in, d_out]` projection: `A ~ U(-1/sqrt(d_in),
    /// 1/sqrt(d_in))`, `B = 0`.
    pub fn new(d_in: usize, d_out: usize, cfg: &LoraConfig, device: &burn::tensor::Device) -> Self {
        let bound = 1.0 / (d_in as f64).sqrt();
        let a = Tensor::<2>::random(
            [d_in, cfg.rank],
            Distribution::Uniform(-bound, bound),
            device,
        );
        let b = Tensor::<2>::zeros([cfg.rank, d_out], device);
        Self::from_factors(a, b, cfg)
    }

    /// An adapter with the given factors (`a` `[d_in, r]`, `b` `[r, d_out]`).
    pub fn from_factors(a: Tensor<2>, b: Tensor<2>, cfg: &LoraConfig) -> Self {
        let rank = a.dims()[1];
        LoraAdapter {
            a: Param::from_tensor(a),
            b: Param::from_tensor(b),
            dropout: DropoutConfig::new(cfg.dropout).init(),
            scale: cfg.alpha / rank as f64,
        }
    }

    /// `scale * dropout(x) A B`, `[.., d_out]`.
    pub fn delta<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let xa = linear(self.dropout.forward(x), self.a.val(), None);
        linear(xa, self.b.val(), None).mul_scalar(self.scale)
    }

    /// The dense update `scale * A B`, `[d_in, d_out]`.
    pub fn weight_delta(&self) -> Tensor<2> {
        self.a.val().matmul(self.b.val()).mul_scalar(self.scale)
    }
}

/// `linear(x)` plus the adapter's update when there is one.
pub(crate) fn project<const D: usize>(
    linear: &Linear,
    lora: &Option<LoraAdapter>,
    x: Tensor<D>,
) -> Tensor<D> {
    let base = |x| {
        crate::fused::linear(
            x,
            linear.weight.val(),
            linear.bias.as_ref().map(|b| b.val()),
        )
    };
    match lora {
        Some(l) => base(x.clone()) + l.delta(x),
        None => base(x),
    }
}

fn adapter_for(linear: &Linear, name: &str, cfg: &LoraConfig) -> Option<LoraAdapter> {
    if !cfg.targets(name) {
        return None;
    }
    let w = linear.weight.val();
    let [d_in, d_out] = w.dims();
    Some(LoraAdapter::new(d_in, d_out, cfg, &w.device()))
}

fn merged(linear: &Linear, lora: &Option<LoraAdapter>) -> Linear {
    match lora {
        None => linear.clone(),
        Some(l) => {
            let w = linear.weight.val().detach() + l.weight_delta().detach();
            Linear {
                weight: Param::from_tensor(w),
                bias: linear.bias.clone(),
            }
        }
    }
}

impl Transformer {
    /// Freezes every base parameter and attaches fresh adapters (peft initialisation, so the
    /// logits are unchanged) to the projections `cfg` names. Seed the device first for
    /// reproducible factors. Replaces adapters already attached.
    pub fn with_lora(self, cfg: &LoraConfig) -> Transformer {
        let mut m = self.without_lora().no_grad();
        for layer in m.layers.iter_mut() {
            let a = &mut layer.self_attn;
            a.q_lora = adapter_for(&a.q_proj, "q_proj", cfg);
            a.k_lora = adapter_for(&a.k_proj, "k_proj", cfg);
            a.v_lora = adapter_for(&a.v_proj, "v_proj", cfg);
            a.o_lora = adapter_for(&a.o_proj, "o_proj", cfg);
            let f = &mut layer.mlp;
            f.gate_lora = adapter_for(&f.gate_proj, "gate_proj", cfg);
            f.up_lora = adapter_for(&f.up_proj, "up_proj", cfg);
            f.down_lora = adapter_for(&f.down_proj, "down_proj", cfg);
        }
        m
    }

    /// True when any projection carries an adapter.
    pub fn has_lora(&self) -> bool {
        self.layers.iter().any(|l| {
            let a = &l.self_attn;
            let f = &l.mlp;
            a.q_lora.is_some()
                || a.k_lora.is_some()
                || a.v_lora.is_some()
                || a.o_lora.is_some()
                || f.gate_lora.is_some()
                || f.up_lora.is_some()
                || f.down_lora.is_some()
        })
    }

    /// The base model with the adapters off. The base tensors are shared with `self`, not
    /// copied: this is the frozen reference policy of a LoRA run at the cost of no weights.
    pub fn without_lora(&self) -> Transformer {
        let mut m = self.clone();
        for layer in m.layers.iter_mut() {
            let a = &mut layer.self_attn;
            (a.q_lora, a.k_lora, a.v_lora, a.o_lora) = (None, None, None, None);
            let f = &mut layer.mlp;
            (f.gate_lora, f.up_lora, f.down_lora) = (None, None, None);
        }
        m
    }

    /// A plain model whose weights are `W + alpha / r * A B` (the adapters folded in; what
    /// `kiln export --hf` writes). Equal to the adapted model up to float rounding.
    pub fn merge_lora(&self) -> Transformer {
        let mut m = self.without_lora();
        for (dst, src) in m.layers.iter_mut().zip(&self.layers) {
            let (a, s) = (&mut dst.self_attn, &src.self_attn);
            a.q_proj = merged(&s.q_proj, &s.q_lora);
            a.k_proj = merged(&s.k_proj, &s.k_lora);
            a.v_proj = merged(&s.v_proj, &s.v_lora);
            a.o_proj = merged(&s.o_proj, &s.o_lora);
            let (f, s) = (&mut dst.mlp, &src.mlp);
            f.gate_proj = merged(&s.gate_proj, &s.gate_lora);
            f.up_proj = merged(&s.up_proj, &s.up_lora);
            f.down_proj = merged(&s.down_proj, &s.down_lora);
        }
        m
    }

    /// Parameters in the adapters (what a LoRA run trains).
    pub fn lora_parameter_count(&self) -> usize {
        let count = |l: &Option<LoraAdapter>| {
            l.as_ref()
                .map(|l| {
                    l.a.val().dims().iter().product::<usize>()
                        + l.b.val().dims().iter().product::<usize>()
                })
                .unwrap_or(0)
        };
        self.layers
            .iter()
            .map(|l| {
                let a = &l.self_attn;
                let f = &l.mlp;
                count(&a.q_lora)
                    + count(&a.k_lora)
                    + count(&a.v_lora)
                    + count(&a.o_lora)
                    + count(&f.gate_lora)
                    + count(&f.up_lora)
                    + count(&f.down_lora)
            })
            .sum()
    }
}
