//! Model configuration: one [`TransformerConfig`] describes every architecture kiln runs
//! (Llama, Qwen2, LLaDA-style bidirectional denoisers). Field names follow HF `config.json`, so
//! HF configs and the `configs/model/*.yaml` presets deserialize into it directly.
//!
//! Config files are untrusted input: parsing and [`TransformerConfig::validate`] never panic,
//! files are read only up to [`MAX_CONFIG_BYTES`], and every size is held to a ceiling
//! ([`limits`]) with the parameter count computed in checked arithmetic, so a forged
//! `num_hidden_layers: 1000000000000` is an error here, before any allocation.

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Largest config file (`config.json`, YAML preset) kiln reads: real ones are a few KiB.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Ceilings on the sizes a config may declare. They sit far above every model kiln targets
/// (Llama-3-405B: 126 layers, width 16384, MLP 53248, vocabulary 128256; Qwen2.5: vocabulary
/// 152064) and low enough that products of them cannot overflow a `u64`, so that a corrupt or
/// forged config is rejected by [`TransformerConfig::validate`] instead of aborting the process
/// in an allocation.
pub mod limits {
    /// Largest `vocab_size`.
    pub const MAX_VOCAB: usize = 1 << 22;
    /// Largest `hidden_size`.
    pub const MAX_HIDDEN: usize = 1 << 16;
    /// Largest `intermediate_size`.
    pub const MAX_INTERMEDIATE: usize = 1 << 20;
    /// Largest `num_hidden_layers`.
    pub const MAX_LAYERS: usize = 1 << 10;
    /// Largest `num_attention_heads` (and `num_key_value_heads`).
    pub const MAX_HEADS: usize = 1 << 10;
    /// Largest `head_dim`.
    pub const MAX_HEAD_DIM: usize = 1 << 12;
    /// Largest `max_position_embeddings`.
    pub const MAX_POSITIONS: usize = 1 << 24;
    /// Largest parameter count ([`super::TransformerConfig::parameter_count`]), ~1.1e12.
    pub const MAX_PARAMETERS: u64 = 1 << 40;
}

/// Read a text file of at most `max` bytes (the size is checked before reading, so a huge or
/// endless file costs nothing); invalid UTF-8 is an `InvalidData` error.
pub(crate) fn read_text_bounded(path: &Path, max: u64) -> std::io::Result<String> {
    use std::io::Read;
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("the file has {len} bytes, more than the {max} a file of this kind may have"),
        ));
    }
    let mut text = String::new();
    // `take` also bounds a file that grows while it is read.
    f.take(max).read_to_string(&mut text)?;
    Ok(text)
}

/// Errors raised while reading or validating a model configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read model config {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid JSON/YAML for a model config.
    #[error("invalid model config {path}: {message}")]
    Parse {
        /// The file (or `<string>`).
        path: String,
        /// What was wrong, with line/column where known.
        message: String,
    },
    /// The values are inconsistent (e.g. hidden size not divisible by the head count).
    #[error("invalid model config: {0}")]
    Invalid(String),
}

/// One token id or several (HF allows both for `eos_token_id`).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq)]
#[serde(untagged)]
pub enum TokenIds {
    /// A single id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// All ids as a vector.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

/// RoPE frequency scaling (HF `rope_scaling`).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RopeScaling {
    /// Scaling kind: `default` (none), `linear` (positions divided by `factor`) or `llama3`
    /// (Llama-3.1 frequency-dependent scaling). HF also spells this key `type`.
    #[serde(alias = "type")]
    pub rope_type: String,
    /// Scaling factor (`linear`, `llama3`). Default 1.0.
    pub factor: f64,
    /// `llama3`: low-frequency factor. Default 1.0.
    pub low_freq_factor: f64,
    /// `llama3`: high-frequency factor. Default 4.0.
    pub high_freq_factor: f64,
    /// `llama3`: the context length the base model was trained with. Default 8192.
    pub original_max_position_embeddings: usize,
}

impl Default for RopeScaling {
    fn default() -> Self {
        Self {
            rope_type: "default".into(),
            factor: 1.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }
    }
}

/// Configuration of the decoder-only transformer (Llama blocks: RMSNorm, RoPE, SwiGLU, GQA).
///
/// Field names are those of HF `config.json`. Every field has a default (HF Llama's for the
/// architecture fields, scaled down), so a preset only lists what it changes. Use
/// [`TransformerConfig::from_hf_config_json`] for real HF files, which carry many extra keys.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TransformerConfig {
    /// Architecture family as in HF `model_type`: `llama`, `qwen2` or `llada`. Only used to
    /// pick defaults when reading HF files and written back on export. Default `llama`.
    pub model_type: String,
    /// Vocabulary size (rows of the embedding matrix). Default 32000.
    pub vocab_size: usize,
    /// Model width d_model. Default 256.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP. Default 688.
    pub intermediate_size: usize,
    /// Number of transformer blocks. Default 4.
    pub num_hidden_layers: usize,
    /// Number of query heads. Default 4.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention); `null` = same as
    /// `num_attention_heads`. Default null.
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; `null` = `hidden_size / num_attention_heads`. Default null.
    pub head_dim: Option<usize>,
    /// Longest position the RoPE tables are meant for (not enforced). Default 2048.
    pub max_position_embeddings: usize,
    /// RoPE base frequency. Default 10000.
    pub rope_theta: f64,
    /// Optional RoPE scaling (`linear`, `llama3`). Default null.
    pub rope_scaling: Option<RopeScaling>,
    /// Epsilon of the RMSNorm layers. Default 1e-6.
    pub rms_norm_eps: f64,
    /// Share the input embedding with the output projection (`lm_head`). Default false.
    pub tie_word_embeddings: bool,
    /// Bias on the q/k/v projections (Qwen2 has it). Default false.
    pub attention_bias: bool,
    /// Bias on the MLP projections. Default false.
    pub mlp_bias: bool,
    /// MLP activation; only `silu` (SwiGLU) is supported. Default `silu`.
    pub hidden_act: String,
    /// Causal self-attention (decoders). `false` makes a bidirectional masked-diffusion
    /// denoiser (LLaDA). Default true.
    pub causal: bool,
    /// Id of the mask token of a masked-diffusion model (LLaDA: 126336). Default null.
    pub mask_token_id: Option<u32>,
    /// Beginning-of-sequence token id. Default null.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id(s), used as default stop tokens. Default null.
    pub eos_token_id: Option<TokenIds>,
    /// Padding token id. Default null.
    pub pad_token_id: Option<u32>,
    /// Standard deviation of the normal initialisation of fresh weights. Default 0.02.
    pub initializer_range: f64,
}

impl Default for TransformerConfig {
    fn default() -> Self {
        Self {
            model_type: "llama".into(),
            vocab_size: 32000,
            hidden_size: 256,
            intermediate_size: 688,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: None,
            head_dim: None,
            max_position_embeddings: 2048,
            rope_theta: 10000.0,
            rope_scaling: None,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            hidden_act: "silu".into(),
            causal: true,
            mask_token_id: None,
            bos_token_id: None,
            eos_token_id: None,
            pad_token_id: None,
            initializer_range: 0.02,
        }
    }
}

/// The HF keys [`TransformerConfig`] understands (everything else in an HF file is ignored).
const KNOWN_KEYS: &[&str] = &[
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "causal",
    "mask_token_id",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
];

impl TransformerConfig {
    /// Number of key/value heads (resolving the `null` default).
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width (resolving the `null` default).
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Check that the values describe a buildable model.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.kv_heads()),
        ] {
            if v == 0 {
                return bad(format!("{name} must be > 0"));
            }
        }
        for (name, v, max) in [
            ("vocab_size", self.vocab_size, limits::MAX_VOCAB),
            ("hidden_size", self.hidden_size, limits::MAX_HIDDEN),
            (
                "intermediate_size",
                self.intermediate_size,
                limits::MAX_INTERMEDIATE,
            ),
            (
                "num_hidden_layers",
                self.num_hidden_layers,
                limits::MAX_LAYERS,
            ),
            (
                "num_attention_heads",
                self.num_attention_heads,
                limits::MAX_HEADS,
            ),
            ("num_key_value_heads", self.kv_heads(), limits::MAX_HEADS),
            ("head_dim", self.head_dim(), limits::MAX_HEAD_DIM),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                limits::MAX_POSITIONS,
            ),
        ] {
            if v > max {
                return bad(format!(
                    "{name} = {v} is larger than kiln's ceiling of {max}: the config is corrupt or describes a model far beyond what kiln runs"
                ));
            }
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad(format!(
                "hidden_size {} is not divisible by num_attention_heads {}; set head_dim explicitly",
                self.hidden_size, self.num_attention_heads
            ));
        }
        let hd = self.head_dim();
        if hd == 0 || !hd.is_multiple_of(2) {
            return bad(format!(
                "head_dim {hd} must be even and > 0 (RoPE rotates pairs)"
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return bad(format!(
                "num_attention_heads {} must be a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        if self.hidden_act != "silu" {
            return bad(format!(
                "hidden_act `{}` is not supported (only `silu`)",
                self.hidden_act
            ));
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return bad("rms_norm_eps must be > 0".into());
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return bad("rope_theta must be > 0".into());
        }
        if let Some(s) = &self.rope_scaling {
            match s.rope_type.as_str() {
                "default" | "linear" | "llama3" => {}
                other => {
                    return bad(format!(
                        "rope_scaling.rope_type `{other}` is not supported (default, linear, llama3)"
                    ));
                }
            }
            if s.factor.is_nan() || s.factor <= 0.0 {
                return bad("rope_scaling.factor must be > 0".into());
            }
        }
        if let Some(m) = self.mask_token_id
            && m as usize >= self.vocab_size
        {
            return bad(format!(
                "mask_token_id {m} is outside the vocabulary (vocab_size {})",
                self.vocab_size
            ));
        }
        if let Some(p) = self.pad_token_id
            && p as usize >= self.vocab_size
        {
            return bad(format!(
                "pad_token_id {p} is outside the vocabulary (vocab_size {})",
                self.vocab_size
            ));
        }
        match self.parameter_count() {
            Some(n) if n <= limits::MAX_PARAMETERS => {}
            n => {
                return bad(format!(
                    "the sizes describe {} parameters, more than kiln's ceiling of {}: the config is corrupt",
                    n.map_or_else(|| "over 2^64".to_string(), |n| n.to_string()),
                    limits::MAX_PARAMETERS
                ));
            }
        }
        Ok(())
    }

    /// Number of parameters of the model this config describes (embedding, every layer's
    /// projections, norms and biases, final norm, untied `lm_head`), in checked arithmetic:
    /// `None` if it overflows a `u64`. The weight loaders compare it with what the files hold
    /// before allocating anything.
    pub fn parameter_count(&self) -> Option<u64> {
        let u = |x: usize| x as u64;
        let (v, d, inter) = (
            u(self.vocab_size),
            u(self.hidden_size),
            u(self.intermediate_size),
        );
        let q = u(self.num_attention_heads).checked_mul(u(self.head_dim()))?;
        let kv = u(self.kv_heads()).checked_mul(u(self.head_dim()))?;
        let embed = v.checked_mul(d)?;
        // q, k, v and o projections.
        let mut layer = d
            .checked_mul(q)?
            .checked_mul(2)?
            .checked_add(d.checked_mul(kv)?.checked_mul(2)?)?;
        if self.attention_bias {
            layer = layer.checked_add(q)?.checked_add(kv.checked_mul(2)?)?;
        }
        // gate, up and down projections.
        layer = layer.checked_add(d.checked_mul(inter)?.checked_mul(3)?)?;
        if self.mlp_bias {
            layer = layer.checked_add(inter.checked_mul(2)?)?.checked_add(d)?;
        }
        // the two norms.
        layer = layer.checked_add(d.checked_mul(2)?)?;
        let mut total = layer
            .checked_mul(u(self.num_hidden_layers))?
            .checked_add(embed)?
            .checked_add(d)?;
        if !self.tie_word_embeddings {
            total = total.checked_add(embed)?;
        }
        Some(total)
    }

    /// Parse a strict kiln config (YAML or JSON; unknown keys are errors).
    pub fn from_yaml_str(text: &str) -> Result<Self, ConfigError> {
        let de = serde_norway::Deserializer::from_str(text);
        let cfg: Self = serde_path_to_error::deserialize(de).map_err(|e| ConfigError::Parse {
            path: "<string>".into(),
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Read a strict kiln preset file (`configs/model/*.yaml`; JSON is valid YAML too).
    pub fn from_yaml_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = read_text_bounded(path, MAX_CONFIG_BYTES).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml_str(&text).map_err(|e| locate(e, path))
    }

    /// Parse a real HF `config.json` text, ignoring keys kiln does not use, and applying the
    /// architecture conventions HF leaves implicit (Qwen2 always has q/k/v bias; LLaDA is
    /// bidirectional and its mask token defaults to 126336).
    pub fn from_hf_config_json(text: &str) -> Result<Self, ConfigError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ConfigError::Parse {
                path: "config.json".into(),
                message: e.to_string(),
            })?;
        let serde_json::Value::Object(map) = value else {
            return Err(ConfigError::Parse {
                path: "config.json".into(),
                message: "expected a JSON object".into(),
            });
        };
        let model_type = map
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("llama")
            .to_string();
        let mut map = map;
        // transformers >= 5 writes `rope_parameters {rope_type, rope_theta, factor, ...}` in place
        // of the older `rope_theta` + `rope_scaling` keys.
        if let Some(serde_json::Value::Object(rp)) = map.remove("rope_parameters") {
            if let Some(theta) = rp.get("rope_theta") {
                map.insert("rope_theta".into(), theta.clone());
            }
            let kind = rp
                .get("rope_type")
                .or_else(|| rp.get("type"))
                .and_then(|v| v.as_str())
                .unwrap_or("default");
            if kind != "default" {
                map.insert("rope_scaling".into(), serde_json::Value::Object(rp));
            }
        }
        let mut kept = serde_json::Map::new();
        for (k, v) in map {
            // HF writes explicit nulls for absent optional values; treat them as defaults.
            if KNOWN_KEYS.contains(&k.as_str()) && !v.is_null() {
                kept.insert(k, v);
            }
        }
        if let Some(serde_json::Value::Object(rs)) = kept.get_mut("rope_scaling") {
            rs.retain(|k, _| {
                matches!(
                    k.as_str(),
                    "rope_type"
                        | "type"
                        | "factor"
                        | "low_freq_factor"
                        | "high_freq_factor"
                        | "original_max_position_embeddings"
                )
            });
            if rs.contains_key("rope_type") {
                rs.remove("type");
            }
        }
        let mut cfg: Self = serde_path_to_error::deserialize(serde_json::Value::Object(kept))
            .map_err(|e| ConfigError::Parse {
                path: "config.json".into(),
                message: e.to_string(),
            })?;
        match model_type.as_str() {
            "qwen2" => cfg.attention_bias = true,
            "llada" => {
                cfg.causal = false;
                cfg.mask_token_id.get_or_insert(126336);
            }
            _ => {}
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Read an HF `config.json` file leniently (see [`Self::from_hf_config_json`]).
    pub fn from_hf_config_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = read_text_bounded(path, MAX_CONFIG_BYTES).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_hf_config_json(&text).map_err(|e| locate(e, path))
    }

    /// An HF `config.json` for this model (what `transformers` needs to open an export).
    pub fn to_hf_config_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("config serializes");
        let map = v.as_object_mut().expect("object");
        let arch = match self.model_type.as_str() {
            "qwen2" => "Qwen2ForCausalLM",
            "llada" => "LLaDAModelLM",
            _ => "LlamaForCausalLM",
        };
        map.insert("architectures".into(), serde_json::json!([arch]));
        map.insert("torch_dtype".into(), serde_json::json!("float32"));
        map.insert(
            "num_key_value_heads".into(),
            serde_json::json!(self.kv_heads()),
        );
        map.insert("head_dim".into(), serde_json::json!(self.head_dim()));
        map.retain(|_, v| !v.is_null());
        if self.model_type == "qwen2" {
            map.remove("attention_bias");
            map.remove("mlp_bias");
        }
        v
    }

    /// Build a freshly initialised model on `device` (normal(0, initializer_range) weights,
    /// zero biases, unit norms).
    ///
    /// # Panics
    /// Panics if the config is invalid; call [`Self::validate`] first for untrusted configs.
    pub fn init(&self, device: &burn::tensor::Device) -> crate::model::Transformer {
        if let Err(e) = self.validate() {
            panic!("{e}");
        }
        crate::model::Transformer::init(self, device)
    }
}

/// Name the file in a parse or validation error of its text.
fn locate(e: ConfigError, path: &Path) -> ConfigError {
    match e {
        ConfigError::Parse { message, .. } => ConfigError::Parse {
            path: path.display().to_string(),
            message,
        },
        ConfigError::Invalid(m) => ConfigError::Invalid(format!("{}: {m}", path.display())),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_config_ignores_unknown_keys_and_applies_qwen2_bias() {
        let text = r#"{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","vocab_size":100,
            "hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"rope_theta":1000000.0,"rms_norm_eps":1e-6,"sliding_window":null,
            "use_sliding_window":false,"torch_dtype":"bfloat16","eos_token_id":[1,2]}"#;
        let cfg = TransformerConfig::from_hf_config_json(text).unwrap();
        assert!(cfg.attention_bias);
        assert_eq!(cfg.kv_heads(), 2);
        assert_eq!(cfg.head_dim(), 16);
        assert_eq!(cfg.eos_token_id, Some(TokenIds::Many(vec![1, 2])));
    }

    #[test]
    fn strict_yaml_rejects_unknown_keys() {
        let err = TransformerConfig::from_yaml_str("hidden_size: 64\nnum_heads: 4\n").unwrap_err();
        assert!(err.to_string().contains("num_heads"), "{err}");
    }

    #[test]
    fn invalid_shapes_are_reported() {
        let err = TransformerConfig::from_yaml_str("hidden_size: 65\nnum_attention_heads: 4\n")
            .unwrap_err();
        assert!(err.to_string().contains("divisible"), "{err}");
    }

    #[test]
    fn huge_sizes_are_an_error_before_any_allocation() {
        let base =
            r#""vocab_size":100,"hidden_size":64,"intermediate_size":128,"num_attention_heads":4"#;
        for (extra, field) in [
            (r#""num_hidden_layers":1000000000000"#, "num_hidden_layers"),
            (
                r#""num_hidden_layers":2,"hidden_size":1000000000"#,
                "hidden_size",
            ),
            (
                r#""num_hidden_layers":2,"vocab_size":4000000000"#,
                "vocab_size",
            ),
            (r#""num_hidden_layers":2,"head_dim":1000000"#, "head_dim"),
        ] {
            let text = format!("{{{base},{extra}}}");
            let err = TransformerConfig::from_hf_config_json(&text).unwrap_err();
            assert!(err.to_string().contains(field), "{extra}: {err}");
        }
        // A float where a size belongs is a type error, not a truncated size.
        let text = format!(r#"{{{base},"num_hidden_layers":2,"hidden_size":1e9}}"#);
        assert!(TransformerConfig::from_hf_config_json(&text).is_err());
        // Within every per-field ceiling, but the product is absurd.
        let cfg = TransformerConfig {
            vocab_size: limits::MAX_VOCAB,
            hidden_size: limits::MAX_HIDDEN,
            intermediate_size: limits::MAX_INTERMEDIATE,
            num_hidden_layers: limits::MAX_LAYERS,
            num_attention_heads: 256,
            ..TransformerConfig::default()
        };
        let err = cfg.validate().unwrap_err();
        assert!(err.to_string().contains("parameters"), "{err}");
    }

    #[test]
    fn parameter_count_matches_a_built_model() {
        for yaml in [
            "vocab_size: 50\nhidden_size: 16\nintermediate_size: 24\nnum_hidden_layers: 2\nnum_attention_heads: 4\nnum_key_value_heads: 2\n",
            "vocab_size: 50\nhidden_size: 16\nintermediate_size: 24\nnum_hidden_layers: 1\nnum_attention_heads: 2\nattention_bias: true\nmlp_bias: true\ntie_word_embeddings: true\n",
        ] {
            let cfg = TransformerConfig::from_yaml_str(yaml).unwrap();
            let model = cfg.init(&burn::tensor::Device::flex());
            assert_eq!(
                cfg.parameter_count(),
                Some(burn::module::Module::num_params(&model) as u64),
                "{yaml}"
            );
        }
    }

    #[test]
    fn presets_parse_and_build() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/model");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "yaml") {
                let cfg = TransformerConfig::from_yaml_file(&path)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                let model = cfg.init(&burn::tensor::Device::flex());
                assert_eq!(model.layers.len(), cfg.num_hidden_layers);
                n += 1;
            }
        }
        assert!(n >= 3, "expected the tiny presets in {}", dir.display());
    }
}
