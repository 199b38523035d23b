//! Model lookup: a name recorded by `just setup` in `.kiln/models.json` (e.g. `smollm2-135m`,
//! see `scripts/lm/setup_smollm2.sh`), an HF model folder, or a `.gguf` file, loaded together
//! with its tokenizer.

use std::path::{Path, PathBuf};

use burn::tensor::Device;

use crate::config::TransformerConfig;
use crate::gguf::{GgufFile, GgufSource};
use crate::model::Transformer;
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::weights::{SafetensorsSource, WeightsError, load_transformer};

/// Errors of model lookup and loading.
#[derive(Debug, thiserror::Error)]
pub enum ZooError {
    /// The name is neither a path nor a recorded model.
    #[error(
        "unknown model `{0}`: not a folder or .gguf file, and not recorded in .kiln/models.json (run `just setup` to install smollm2-135m)"
    )]
    Unknown(String),
    /// `.kiln/models.json` is unreadable.
    #[error("{path}: {message}")]
    Registry {
        /// The registry file.
        path: String,
        /// What was wrong.
        message: String,
    },
    /// Weights failed to load.
    #[error(transparent)]
    Weights(#[from] WeightsError),
    /// The tokenizer failed to load.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Where a model's files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// HF folder: config.json + safetensors + tokenizer.json.
    HfDir(PathBuf),
    /// A GGUF file (weights, config and tokenizer inside).
    Gguf(PathBuf),
}

/// `.kiln/models.json` files to consult: in the current directory and its ancestors, then
/// next to this crate's workspace (for tests and `cargo run`).
fn registries() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(mut dir) = std::env::current_dir() {
        loop {
            out.push(dir.join(".kiln/models.json"));
            if !dir.pop() {
                break;
            }
        }
    }
    out.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.kiln/models.json"));
    out
}

/// Every `(name, path, registry file)` recorded in the `.kiln/models.json` registries, nearest
/// registry first (a name recorded in several registries is listed once, from the nearest).
/// Unreadable registries are skipped; paths are listed whether or not they exist.
pub fn recorded() -> Vec<(String, PathBuf, PathBuf)> {
    let mut out: Vec<(String, PathBuf, PathBuf)> = Vec::new();
    let mut seen_regs = std::collections::BTreeSet::new();
    for reg in registries() {
        let canon = reg.canonicalize().unwrap_or_else(|_| reg.clone());
        if !seen_regs.insert(canon) {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&reg) else {
            continue;
        };
        let Ok(serde_json::Value::Object(map)) = serde_json::from_str(&text) else {
            continue;
        };
        for (name, p) in map {
            if let Some(p) = p.as_str()
                && !out.iter().any(|(n, _, _)| *n == name)
            {
                out.push((name, PathBuf::from(p), reg.clone()));
            }
        }
    }
    out
}

/// Look a name up in the `.kiln/models.json` registries.
pub fn lookup_name(name: &str) -> Result<Option<PathBuf>, ZooError> {
    for reg in registries() {
        let Ok(text) = std::fs::read_to_string(&reg) else {
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ZooError::Registry {
            path: reg.display().to_string(),
            message: e.to_string(),
        })?;
        if let Some(p) = v.get(name).and_then(|p| p.as_str()) {
            let p = PathBuf::from(p);
            if p.exists() {
                return Ok(Some(p));
            }
        }
    }
    Ok(None)
}

/// The SmolLM2-135M-Instruct GGUF the tests and benches use: `KILN_SMOLLM2_GGUF` when set, else
/// the `smollm2-135m` that `just setup` recorded (`None` when neither).
pub fn smollm2_gguf() -> Result<Option<PathBuf>, ZooError> {
    match std::env::var_os("KILN_SMOLLM2_GGUF") {
        Some(p) => Ok(Some(PathBuf::from(p))),
        None => lookup_name("smollm2-135m"),
    }
}

/// Resolve a model spec: an existing folder or `.gguf` path, or a recorded name.
pub fn resolve(spec: &str) -> Result<ModelSource, ZooError> {
    let p = Path::new(spec);
    let classify = |p: &Path| {
        if p.is_dir() {
            ModelSource::HfDir(p.to_path_buf())
        } else {
            ModelSource::Gguf(p.to_path_buf())
        }
    };
    if p.exists() {
        return Ok(classify(p));
    }
    match lookup_name(spec)? {
        Some(p) => Ok(classify(&p)),
        None => Err(ZooError::Unknown(spec.into())),
    }
}

/// Load only the tokenizer of a spec (see [`resolve`]): `tokenizer.json` of an HF folder, or the
/// tokenizer a GGUF file embeds (its weights are not read).
pub fn load_tokenizer(spec: &str) -> Result<Tokenizer, ZooError> {
    match resolve(spec)? {
        ModelSource::HfDir(dir) => Ok(Tokenizer::from_hf_dir(&dir)?),
        ModelSource::Gguf(path) => Ok(Tokenizer::from_gguf(&GgufFile::open(&path)?)?),
    }
}

/// Load a model and its tokenizer from a spec (see [`resolve`]). A tokenizer with ids the
/// model's vocabulary lacks is an error ([`Tokenizer::check_vocab`]), found before the weights
/// are read. Never panics on corrupt files (see [`crate::weights`], [`crate::gguf`]).
pub fn load_with_tokenizer(
    spec: &str,
    device: &Device,
) -> Result<(Transformer, Tokenizer), ZooError> {
    match resolve(spec)? {
        ModelSource::HfDir(dir) => {
            let tok = Tokenizer::from_hf_dir(&dir)?;
            let cfg = TransformerConfig::from_hf_config_file(dir.join("config.json"))
                .map_err(WeightsError::from)?;
            tok.check_vocab(cfg.vocab_size)?;
            let src = SafetensorsSource::open_dir(&dir)?;
            let model = load_transformer(&cfg, &src, device)?;
            Ok((model, tok))
        }
        ModelSource::Gguf(path) => {
            let file = GgufFile::open(&path)?;
            let cfg = file.config()?;
            let tok = Tokenizer::from_gguf(&file)?;
            tok.check_vocab(cfg.vocab_size)?;
            let model = load_transformer(&cfg, &GgufSource::new(&file, &cfg), device)?;
            Ok((model, tok))
        }
    }
}
