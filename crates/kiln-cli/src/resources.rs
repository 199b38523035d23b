//! What a recipe would allocate, estimated before anything is built, and the load-time refusal of
//! recipes that could never fit.
//!
//! A recipe names model and batch sizes that the task crates turn into tensors; a typo such as
//! `num_hidden_layers: 1000000000000` or `group_size: 1e12` used to pass validation and abort the
//! process on the first allocation. [`check`] runs in the loader right after the key check and
//! before typed deserialization (so even a float such as `hidden_size: 1e9` is refused with the
//! estimate rather than with a type error), on the recipe tree laid over the defaults of the
//! task's schema. It refuses:
//!
//! - any size beyond a sane ceiling ([`MODEL_CEILINGS`], [`BATCH_CEILING`]), whatever the machine;
//! - a recipe whose estimate exceeds the machine's memory (`MemTotal` of `/proc/meminfo`; no memory
//!   check where that is unknown).
//!
//! The estimate ([`Estimate::of`]) recognises model configurations by their field names wherever
//! they sit in the recipe: a causal / masked-diffusion transformer (kiln-lm's `TransformerConfig`:
//! `hidden_size`, `num_hidden_layers`, ...) and the Sudoku denoiser (`d_model`, `n_layers`, ...).
//! A preset next to a non-empty `pretrained:` / `model_path:` is not built and not counted (a
//! pretrained model's size is known only when its files are read). Per model it counts, in f32:
//!
//! - parameters x 16 bytes: weights, gradients and the two AdamW moments;
//! - activations kept for the backward pass of one minibatch (`trainer.mini_batch_size` rows, or the
//!   whole rollout batch when 0, or the largest `batch_size` outside a `decode:` section when that
//!   is larger: pre-training, warm start and stage-2 batches), every sequence as long as the model allows
//!   (`max_position_embeddings`; side x side cells for the denoiser): per token and layer
//!   `8 h + 3 i` floats plus `heads x T` attention weights, plus `2 V` for the logits;
//! - the key/value cache of one rollout batch (the largest `*_per_step` x the largest
//!   `group_size`).
//!
//! It is an upper-bound style estimate, not a measurement: its job is to tell a recipe that fits
//! from one that cannot, and to say how much memory a recipe asks for (`kiln train --dry-run`
//! prints it).

use std::fmt;

use serde_json::{Map, Value};

use crate::recipe::{RawRecipe, RecipeError, merge_json, yaml_to_json};

/// Ceilings of model sizes, far above any real model (so only typos and hostile recipes hit
/// them), which also keep every later `usize` product of the task crates far from overflow.
pub const MODEL_CEILINGS: &[(&str, f64, &str)] = &[
    ("hidden_size", 65_536.0, "model width"),
    ("intermediate_size", 1_048_576.0, "MLP width"),
    ("num_hidden_layers", 4_096.0, "layers"),
    ("num_attention_heads", 4_096.0, "attention heads"),
    ("num_key_value_heads", 4_096.0, "key/value heads"),
    ("head_dim", 65_536.0, "head width"),
    ("vocab_size", 16_777_216.0, "vocabulary entries"),
    ("max_position_embeddings", 16_777_216.0, "positions"),
    ("d_model", 65_536.0, "model width"),
    ("d_ff", 1_048_576.0, "feed-forward width"),
    ("n_layers", 4_096.0, "layers"),
    ("n_heads", 4_096.0, "attention heads"),
];

/// Ceiling of every batch-like size (rows, group sizes, per-step counts, generated tokens).
pub const BATCH_CEILING: f64 = 16_777_216.0;

/// Whether a field name is a batch-like size bounded by [`BATCH_CEILING`].
fn is_batch_field(name: &str) -> bool {
    matches!(
        name,
        "mini_batch_size"
            | "batch_size"
            | "max_batch"
            | "group_size"
            | "max_new_tokens"
            | "gen_length"
            | "max_prompt_tokens"
            | "orders_per_puzzle"
    ) || name.ends_with("_per_step")
}

/// One model found in the recipe and what it needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelEstimate {
    /// Dotted path of the model's mapping (`model`).
    pub path: String,
    /// Parameter count.
    pub params: f64,
    /// Bytes of weights, gradients and AdamW moments.
    pub weights_bytes: f64,
    /// Bytes of activations of one training minibatch.
    pub activation_bytes: f64,
    /// Bytes of the key/value cache of one rollout batch.
    pub kv_bytes: f64,
    /// Sequence length assumed.
    pub tokens: f64,
}

impl ModelEstimate {
    /// All bytes of this model.
    pub fn total(&self) -> f64 {
        self.weights_bytes + self.activation_bytes + self.kv_bytes
    }
}

/// The memory a recipe asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    /// Every model built by the recipe.
    pub models: Vec<ModelEstimate>,
    /// Rows of one training minibatch.
    pub train_rows: f64,
    /// Rows of one rollout batch.
    pub rollout_rows: f64,
}

/// Bytes as a short human figure: `512 B`, `3.2 MiB`, `41.0 GiB`, `7.3e17 bytes (650 PiB)`.
pub fn fmt_bytes(b: f64) -> String {
    const UNITS: &[&str] = &["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if !b.is_finite() {
        return "an unbounded amount".into();
    }
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b:.0} B")
    } else if v >= 1024.0 {
        format!("{b:.1e} bytes")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn fmt_count(n: f64) -> String {
    if n >= 1e9 {
        format!("{:.2e}", n)
    } else if n >= 1e6 {
        format!("{:.1}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}k", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

impl fmt::Display for Estimate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.models.is_empty() {
            return write!(
                f,
                "no model built from the recipe's sizes (a pretrained model is sized when its files are read)"
            );
        }
        write!(f, "≈ {} in all", fmt_bytes(self.total()))?;
        for m in &self.models {
            write!(
                f,
                "; `{}`: {} parameters -> {} of weights, gradients and AdamW state, {} of activations \
                 ({} rows x {} tokens), {} of KV cache ({} rollout rows)",
                m.path,
                fmt_count(m.params),
                fmt_bytes(m.weights_bytes),
                fmt_bytes(m.activation_bytes),
                fmt_count(self.train_rows),
                fmt_count(m.tokens),
                fmt_bytes(m.kv_bytes),
                fmt_count(self.rollout_rows),
            )?;
        }
        Ok(())
    }
}

fn num(o: &Map<String, Value>, key: &str) -> Option<f64> {
    o.get(key).and_then(Value::as_f64).filter(|v| v.is_finite())
}

/// Every object of `v` with its dotted path, parents before children.
fn objects<'a>(v: &'a Value, path: &str, out: &mut Vec<(String, &'a Map<String, Value>)>) {
    match v {
        Value::Object(o) => {
            out.push((path.to_string(), o));
            for (k, child) in o {
                objects(child, &crate::recipe::join(path, k), out);
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                objects(child, &crate::recipe::join(path, &i.to_string()), out);
            }
        }
        _ => {}
    }
}

/// The object at dotted `path` below `root` (the parent of a model, to look for `pretrained`).
fn parent_of<'a>(root: &'a Value, path: &str) -> Option<&'a Map<String, Value>> {
    let parent = match path.rfind('.') {
        Some(i) => &path[..i],
        None => "",
    };
    let mut cur = root;
    if !parent.is_empty() {
        for seg in parent.split('.') {
            cur = match cur {
                Value::Object(o) => o.get(seg)?,
                Value::Array(a) => a.get(seg.parse::<usize>().ok()?)?,
                _ => return None,
            };
        }
    }
    cur.as_object()
}

/// Whether the model preset at `path` is replaced by a pretrained model named next to it.
fn replaced_by_pretrained(root: &Value, path: &str) -> bool {
    parent_of(root, path).is_some_and(|p| {
        ["pretrained", "model_path"].iter().any(|k| {
            p.get(*k)
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty())
        })
    })
}

/// Sizes of one transformer-like model, read from its mapping.
struct Dims {
    hidden: f64,
    inter: f64,
    layers: f64,
    heads: f64,
    kv_width: f64,
    q_width: f64,
    vocab: f64,
    tokens: f64,
    lm_heads: f64,
}

impl Dims {
    fn transformer(o: &Map<String, Value>) -> Self {
        let hidden = num(o, "hidden_size").unwrap_or(256.0);
        let heads = num(o, "num_attention_heads").unwrap_or(4.0).max(1.0);
        let kv_heads = num(o, "num_key_value_heads").unwrap_or(heads);
        let head_dim = num(o, "head_dim").unwrap_or((hidden / heads).floor());
        let tied = o
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Self {
            hidden,
            inter: num(o, "intermediate_size").unwrap_or(688.0),
            layers: num(o, "num_hidden_layers").unwrap_or(4.0),
            heads,
            kv_width: kv_heads * head_dim,
            q_width: heads * head_dim,
            vocab: num(o, "vocab_size").unwrap_or(32_000.0),
            tokens: num(o, "max_position_embeddings").unwrap_or(2048.0),
            lm_heads: if tied { 1.0 } else { 2.0 },
        }
    }

    fn denoiser(o: &Map<String, Value>) -> Self {
        let hidden = num(o, "d_model").unwrap_or(128.0);
        let side = num(o, "side").unwrap_or(9.0);
        Self {
            hidden,
            inter: num(o, "d_ff").unwrap_or(512.0),
            layers: num(o, "n_layers").unwrap_or(3.0),
            heads: num(o, "n_heads").unwrap_or(4.0).max(1.0),
            kv_width: hidden,
            q_width: hidden,
            // mask + digits in, digits out; cell, row, column and box embeddings
            vocab: side + 1.0 + side * side + 3.0 * side,
            tokens: side * side,
            lm_heads: 1.0,
        }
    }

    fn params(&self) -> f64 {
        let h = self.hidden;
        let per_layer =
            h * self.q_width * 2.0 + h * self.kv_width * 2.0 + 3.0 * h * self.inter + 2.0 * h;
        self.vocab * h * self.lm_heads + self.layers * per_layer + h
    }

    fn estimate(&self, path: &str, train_rows: f64, rollout_rows: f64) -> ModelEstimate {
        let params = self.params();
        let per_token = self.layers
            * (8.0 * self.hidden + 3.0 * self.inter + self.heads * self.tokens)
            + 2.0 * self.vocab;
        ModelEstimate {
            path: path.to_string(),
            params,
            weights_bytes: 16.0 * params,
            activation_bytes: 4.0 * train_rows * self.tokens * per_token,
            kv_bytes: 4.0 * rollout_rows * self.tokens * self.layers * 2.0 * self.kv_width,
            tokens: self.tokens,
        }
    }
}

fn is_transformer(o: &Map<String, Value>) -> bool {
    o.contains_key("hidden_size") && o.contains_key("num_hidden_layers")
}

fn is_denoiser(o: &Map<String, Value>) -> bool {
    o.contains_key("d_model") && o.contains_key("n_layers")
}

impl Estimate {
    /// Estimate the memory of the recipe tree `v` (the resolved recipe, or a raw tree over the
    /// schema defaults).
    pub fn of(v: &Value) -> Self {
        let mut objs = Vec::new();
        objects(v, "", &mut objs);
        let mut per_step: f64 = 1.0;
        let mut group: f64 = 1.0;
        for (_, o) in &objs {
            for (k, x) in o.iter() {
                let Some(x) = x.as_f64().filter(|x| x.is_finite()) else {
                    continue;
                };
                if k.ends_with("_per_step") {
                    per_step = per_step.max(x);
                } else if k == "group_size" {
                    group = group.max(x);
                }
            }
        }
        let rollout_rows = per_step * group;
        let mini = v
            .get("trainer")
            .and_then(|t| t.get("mini_batch_size"))
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        let mut train_rows = if mini >= 1.0 {
            mini.min(rollout_rows.max(1.0))
        } else {
            rollout_rows
        };
        // supervised batches (pre-training, warm start, stage 2) go through a backward pass too;
        // `decode` batches are inference only
        for (p, o) in &objs {
            if p.rsplit('.').next() == Some("decode") {
                continue;
            }
            if let Some(b) = num(o, "batch_size") {
                train_rows = train_rows.max(b);
            }
        }
        let models = objs
            .iter()
            .filter(|(p, _)| !replaced_by_pretrained(v, p))
            .filter_map(|(p, o)| {
                let dims = if is_transformer(o) {
                    Dims::transformer(o)
                } else if is_denoiser(o) {
                    Dims::denoiser(o)
                } else {
                    return None;
                };
                Some(dims.estimate(p, train_rows, rollout_rows))
            })
            .collect();
        Estimate {
            models,
            train_rows,
            rollout_rows,
        }
    }

    /// All bytes.
    pub fn total(&self) -> f64 {
        self.models.iter().map(ModelEstimate::total).sum()
    }
}

/// Total memory of this machine in bytes (`MemTotal`), when known.
pub fn machine_memory() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024.0)
}

fn machine_phrase(mem: Option<f64>) -> String {
    match mem {
        Some(m) => format!("this machine has {} of memory", fmt_bytes(m)),
        None => "this machine's memory is unknown".into(),
    }
}

/// The recipe tree laid over the root defaults of `schemas` (what the typed structs will hold,
/// up to defaults of partly written nested sections).
pub fn with_defaults(raw: &RawRecipe, schemas: &[schemars::Schema]) -> Value {
    let mut v = Value::Object(Map::new());
    for s in schemas {
        if let Some(d) = s.as_value().get("default") {
            merge_json(&mut v, d.clone());
        }
    }
    merge_json(&mut v, yaml_to_json(&raw.value));
    v
}

/// Refuse sizes beyond the ceilings and recipes whose estimate exceeds `memory` (bytes; `None` =
/// unknown: ceilings only). Errors point at the field to edit and give the estimate.
pub fn check_against(
    raw: &RawRecipe,
    tree: &Value,
    memory: Option<f64>,
) -> Result<Estimate, RecipeError> {
    let est = Estimate::of(tree);
    let mut objs = Vec::new();
    objects(tree, "", &mut objs);
    for (path, o) in &objs {
        let model = is_transformer(o) || is_denoiser(o);
        for (k, x) in o.iter() {
            let Some(x) = x.as_f64() else { continue };
            let ceiling = if model {
                MODEL_CEILINGS
                    .iter()
                    .find(|(n, _, _)| n == k)
                    .map(|(_, c, what)| (*c, *what))
            } else {
                None
            }
            .or_else(|| is_batch_field(k).then_some((BATCH_CEILING, "rows / items")));
            let Some((ceiling, what)) = ceiling else {
                continue;
            };
            if !(x.is_finite() && x <= ceiling) {
                let full = crate::recipe::join(path, k);
                return Err(RecipeError::Invalid {
                    at: raw.origin(&full),
                    path: full,
                    msg: format!(
                        "{x} is beyond the ceiling of {ceiling} {what}; the recipe would need {est}, and {}; lower it",
                        machine_phrase(memory)
                    ),
                });
            }
        }
    }
    if let Some(mem) = memory
        && est.total() > mem
    {
        let worst = est
            .models
            .iter()
            .max_by(|a, b| a.total().total_cmp(&b.total()))
            .map(|m| m.path.clone())
            .unwrap_or_default();
        return Err(RecipeError::Invalid {
            at: raw.origin(&worst),
            path: worst,
            msg: format!(
                "the recipe does not fit in memory: it would need {est}, but {}; make the model \
                 smaller or lower trainer.mini_batch_size / the rollout batch (`*_per_step` x `group_size`)",
                machine_phrase(memory)
            ),
        });
    }
    Ok(est)
}

/// [`check_against`] this machine's memory, on the recipe laid over the task's schema defaults.
pub fn check(raw: &RawRecipe, schemas: &[schemars::Schema]) -> Result<Estimate, RecipeError> {
    check_against(raw, &with_defaults(raw, schemas), machine_memory())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn raw() -> RawRecipe {
        RawRecipe {
            value: serde_norway::Value::Mapping(Default::default()),
            origins: Default::default(),
            file: None,
        }
    }

    fn recipe(model: Value) -> Value {
        json!({"trainer": {"mini_batch_size": 64},
               "sequence": {"prompts_per_step": 16, "group_size": 8},
               "model": model})
    }

    #[test]
    fn counts_transformer_parameters_exactly() {
        // 2 layers of width 64, MLP 128, vocab 12, untied: the tiny-policy preset
        let m = json!({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 12,
                       "max_position_embeddings": 64, "tie_word_embeddings": false});
        let e = Estimate::of(&recipe(m));
        assert_eq!(e.models.len(), 1);
        let per_layer = 4.0 * 64.0 * 64.0 + 3.0 * 64.0 * 128.0 + 2.0 * 64.0;
        assert_eq!(
            e.models[0].params,
            2.0 * 12.0 * 64.0 + 2.0 * per_layer + 64.0
        );
        assert_eq!(e.train_rows, 64.0);
        assert_eq!(e.rollout_rows, 128.0);
        assert!(check_against(&raw(), &recipe(json!({})), Some(1e9)).is_ok());
    }

    #[test]
    fn refuses_sizes_beyond_ceilings_with_the_estimate() {
        let huge = recipe(json!({"hidden_size": 64, "num_hidden_layers": 1e12}));
        let err = check_against(&raw(), &huge, Some(8e9))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`model.num_hidden_layers`"), "{err}");
        assert!(err.contains("ceiling"), "{err}");
        assert!(err.contains("would need ≈"), "{err}");
        assert!(err.contains("this machine has 7.5 GiB"), "{err}");
        let group = json!({"sequence": {"group_size": 1e13}});
        let err = check_against(&raw(), &group, None).unwrap_err().to_string();
        assert!(err.contains("`sequence.group_size`"), "{err}");
    }

    #[test]
    fn refuses_recipes_larger_than_the_machine() {
        // under every ceiling, but ~6e13 parameters
        let big =
            recipe(json!({"hidden_size": 65536, "num_hidden_layers": 1024, "vocab_size": 32000}));
        let err = check_against(&raw(), &big, Some(64e9))
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not fit in memory"), "{err}");
        assert!(err.contains("this machine has 59.6 GiB"), "{err}");
        assert!(
            check_against(&raw(), &big, None).is_ok(),
            "unknown memory: ceilings only"
        );
    }

    #[test]
    fn a_preset_replaced_by_a_pretrained_model_is_not_counted() {
        let mut v = recipe(json!({"hidden_size": 65536, "num_hidden_layers": 1024}));
        v["pretrained"] = json!("models/big");
        assert!(Estimate::of(&v).models.is_empty());
    }

    #[test]
    fn bytes_are_printed_readably() {
        assert_eq!(fmt_bytes(512.0), "512 B");
        assert_eq!(fmt_bytes(3.0 * 1024.0 * 1024.0), "3.0 MiB");
        assert!(fmt_bytes(1e30).ends_with("bytes"));
    }
}
