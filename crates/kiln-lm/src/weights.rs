//! HF safetensors weights: loading (single file or sharded `model.safetensors.index.json`;
//! f32 / f16 / bf16 upcast to f32) into a [`Transformer`], and saving back in the layout
//! `transformers` opens (`config.json` + `model.safetensors`).
//!
//! Names follow HF Llama/Qwen2 (`model.layers.N.self_attn.q_proj.weight`, ...); checkpoints with
//! LLaDA's own naming (`model.transformer.blocks.N.attn_out.weight`, ...) are mapped too.
//! HF stores linear weights as `[out, in]`; burn's [`Linear`] holds `[in, out]`, so they are
//! transposed on the way in and out.
//!
//! **No panic, no unbounded allocation.** Weight files and configs are untrusted input. The
//! safetensors header is validated by the `safetensors` crate (header at most 100 MB, every
//! tensor's byte range inside the file, tensors tiling the data without overlap, sizes in
//! checked arithmetic); the shard index is read only up to [`MAX_INDEX_BYTES`]; the config is
//! held to the ceilings of [`crate::config::limits`]; and [`load_transformer`] checks that the
//! files hold at least as many elements as the config's parameter count before it allocates
//! anything, and every tensor's shape before reading it. So a forged file or config is an
//! error, and the memory a load takes is bounded by what the files really hold
//! (`tests/untrusted_files.rs` fuzzes this).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::tensor::{Device, Tensor, TensorData};
use safetensors::{Dtype, SafeTensors, View};

use crate::config::{ConfigError, TransformerConfig};
use crate::model::{Attention, DecoderLayer, Mlp, Transformer};

/// Largest `model.safetensors.index.json` kiln reads (a real one is ~100 KB).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

/// Errors raised while reading or writing weights.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a valid safetensors file (truncated, corrupt header, ...).
    #[error(
        "{path}: not a valid safetensors file ({message}); the file may be truncated or corrupt: download it again"
    )]
    Safetensors {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
    /// `model.safetensors.index.json` is malformed.
    #[error("{path}: invalid shard index: {message}")]
    Index {
        /// The index file.
        path: String,
        /// What was wrong.
        message: String,
    },
    /// The folder holds no weights.
    #[error(
        "{0}: no model.safetensors or model.safetensors.index.json found (expected an HF model folder)"
    )]
    NoWeights(String),
    /// A tensor the config requires is absent.
    #[error(
        "tensor `{name}` is missing from {files} (the weights do not match config.json: wrong model_type, layer count or tie_word_embeddings?)"
    )]
    Missing {
        /// HF tensor name.
        name: String,
        /// The files searched.
        files: String,
    },
    /// A tensor has a different shape than the config implies.
    #[error(
        "tensor `{name}` has shape {found:?} but config.json implies {expected:?} (config and weights disagree)"
    )]
    Shape {
        /// HF tensor name.
        name: String,
        /// Shape implied by the config.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A tensor uses an element type kiln cannot read.
    #[error("tensor `{name}` has dtype {dtype}; supported: F32, F16, BF16, F64")]
    Dtype {
        /// HF tensor name.
        name: String,
        /// The dtype.
        dtype: String,
    },
    /// A GGUF file is malformed or unsupported.
    #[error("{path}: {message}")]
    Gguf {
        /// The file.
        path: String,
        /// What was wrong.
        message: String,
    },
    /// The config describes more parameters than the weight files hold.
    #[error(
        "{files}: the config describes a model of {needed} parameters but the weight files hold only {available} values (config and weights do not belong together, or the config is corrupt)"
    )]
    TooFewWeights {
        /// The files.
        files: String,
        /// The config's parameter count.
        needed: u64,
        /// Elements in the files.
        available: u64,
    },
    /// The config is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// Anything that yields f32 tensors under HF names (safetensors folders, GGUF files).
pub trait TensorSource {
    /// True if a tensor of that HF name exists.
    fn contains(&self, name: &str) -> bool;
    /// Read tensor `name` as f32 (row-major), checking it has shape `expected`.
    fn read_f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, WeightsError>;
    /// The files behind this source, for messages.
    fn describe(&self) -> String;
    /// An upper bound on the f32 elements all of the source's readable tensors hold, when
    /// known: [`load_transformer`] refuses a config with more parameters before allocating.
    fn element_count(&self) -> Option<u64> {
        None
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WeightsError + '_ {
    move |source| WeightsError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Memory-mapped safetensors files with a name -> file lookup.
pub struct SafetensorsSource {
    files: Vec<(PathBuf, memmap2::Mmap)>,
    index: HashMap<String, usize>,
    /// Every tensor's shape, from the headers.
    shapes: HashMap<String, Vec<usize>>,
    /// Elements of the tensors of a dtype kiln reads (F32, F16, BF16, F64), over all files.
    elements: u64,
}

impl SafetensorsSource {
    /// Open the weights of an HF folder: `model.safetensors`, or the shards listed by
    /// `model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<Self, WeightsError> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let text = crate::config::read_text_bounded(&index, MAX_INDEX_BYTES)
                .map_err(io_err(&index))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| WeightsError::Index {
                    path: index.display().to_string(),
                    message: e.to_string(),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| WeightsError::Index {
                    path: index.display().to_string(),
                    message: "no `weight_map` object".into(),
                })?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            shards.sort();
            shards.dedup();
            for s in &shards {
                if s.contains('/') || s.contains('\\') || s.contains("..") {
                    return Err(WeightsError::Index {
                        path: index.display().to_string(),
                        message: format!("shard name `{s}` is not a plain file name"),
                    });
                }
            }
            let paths: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
            Self::open_files(&paths)
        } else if single.exists() {
            Self::open_files(&[single])
        } else {
            Err(WeightsError::NoWeights(dir.display().to_string()))
        }
    }

    /// Open explicit safetensors files.
    pub fn open_files(paths: &[PathBuf]) -> Result<Self, WeightsError> {
        let mut files = Vec::new();
        let mut index = HashMap::new();
        let mut shapes = HashMap::new();
        let mut elements = 0u64;
        for (i, p) in paths.iter().enumerate() {
            let f = std::fs::File::open(p).map_err(io_err(p))?;
            // SAFETY: the map is read-only and lives as long as `self`; a file truncated by
            // another process while mapped is outside what we can defend against.
            let mmap = unsafe { memmap2::Mmap::map(&f) }.map_err(io_err(p))?;
            let st = SafeTensors::deserialize(&mmap).map_err(|e| WeightsError::Safetensors {
                path: p.display().to_string(),
                message: e.to_string(),
            })?;
            for (name, view) in st.tensors() {
                if matches!(
                    view.dtype(),
                    Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64
                ) {
                    // The crate checked that shape x dtype size fits the file.
                    let n = view.shape().iter().map(|&d| d as u64).product::<u64>();
                    elements = elements.saturating_add(n);
                }
                shapes.insert(name.clone(), view.shape().to_vec());
                index.insert(name, i);
            }
            files.push((p.clone(), mmap));
        }
        Ok(Self {
            files,
            index,
            shapes,
            elements,
        })
    }

    /// All tensor names.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.index.keys().cloned().collect();
        v.sort();
        v
    }

    /// The shape of tensor `name` as its file's header declares it (nothing is read).
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.shapes.get(name).map(Vec::as_slice)
    }

    /// Each file's mapped bytes, in the order they were opened (sorted shard names).
    pub fn file_bytes(&self) -> impl Iterator<Item = &[u8]> {
        self.files.iter().map(|(_, m)| &m[..])
    }

    fn file_list(&self) -> String {
        self.files
            .iter()
            .map(|(p, _)| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl TensorSource for SafetensorsSource {
    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn describe(&self) -> String {
        self.file_list()
    }

    fn element_count(&self) -> Option<u64> {
        Some(self.elements)
    }

    fn read_f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, WeightsError> {
        let i = *self.index.get(name).ok_or_else(|| WeightsError::Missing {
            name: name.into(),
            files: self.file_list(),
        })?;
        let (path, mmap) = &self.files[i];
        let st = SafeTensors::deserialize(mmap).map_err(|e| WeightsError::Safetensors {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let view = st.tensor(name).map_err(|e| WeightsError::Safetensors {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        if view.shape() != expected {
            return Err(WeightsError::Shape {
                name: name.into(),
                expected: expected.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        let data = view.data();
        let out: Vec<f32> = match view.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F64 => data
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
                .collect(),
            other => {
                return Err(WeightsError::Dtype {
                    name: name.into(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        Ok(out)
    }
}

/// Transpose a row-major `[rows, cols]` matrix.
pub(crate) fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = data[r * cols + c];
        }
    }
    out
}

/// Where each parameter of the model lives in an HF checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameScheme {
    /// HF Llama / Qwen2 (`model.layers.N.self_attn.q_proj.weight`).
    Llama,
    /// LLaDA's own modelling code (`model.transformer.blocks.N.q_proj.weight`).
    Llada,
}

impl NameScheme {
    /// Pick the scheme from the tensor names present.
    pub fn detect(src: &dyn TensorSource) -> Self {
        if src.contains("model.transformer.wte.weight") {
            NameScheme::Llada
        } else {
            NameScheme::Llama
        }
    }

    fn embed(self) -> String {
        match self {
            NameScheme::Llama => "model.embed_tokens.weight".into(),
            NameScheme::Llada => "model.transformer.wte.weight".into(),
        }
    }
    fn final_norm(self) -> String {
        match self {
            NameScheme::Llama => "model.norm.weight".into(),
            NameScheme::Llada => "model.transformer.ln_f.weight".into(),
        }
    }
    fn lm_head(self) -> String {
        match self {
            NameScheme::Llama => "lm_head.weight".into(),
            NameScheme::Llada => "model.transformer.ff_out.weight".into(),
        }
    }
    /// Name of a per-layer tensor given its HF Llama suffix (e.g. `self_attn.q_proj.weight`).
    fn layer(self, i: usize, llama_suffix: &str) -> String {
        match self {
            NameScheme::Llama => format!("model.layers.{i}.{llama_suffix}"),
            NameScheme::Llada => {
                let (module, kind) = llama_suffix.rsplit_once('.').expect("suffix has a dot");
                let m = match module {
                    "input_layernorm" => "attn_norm",
                    "post_attention_layernorm" => "ff_norm",
                    "self_attn.q_proj" => "q_proj",
                    "self_attn.k_proj" => "k_proj",
                    "self_attn.v_proj" => "v_proj",
                    "self_attn.o_proj" => "attn_out",
                    "mlp.gate_proj" => "ff_proj",
                    "mlp.up_proj" => "up_proj",
                    "mlp.down_proj" => "ff_out",
                    other => other,
                };
                format!("model.transformer.blocks.{i}.{m}.{kind}")
            }
        }
    }
}

fn param1(data: Vec<f32>, device: &Device) -> Param<Tensor<1>> {
    let n = data.len();
    Param::from_tensor(Tensor::from_data(TensorData::new(data, [n]), device))
}

fn param2(data: Vec<f32>, shape: [usize; 2], device: &Device) -> Param<Tensor<2>> {
    Param::from_tensor(Tensor::from_data(TensorData::new(data, shape), device))
}

/// Build a [`Transformer`] for `cfg` from the tensors in `src`. Never panics; allocates
/// nothing before checking that `src` holds at least the config's parameter count (when the
/// source knows its size), and reads each tensor only once its shape matched the config.
pub fn load_transformer(
    cfg: &TransformerConfig,
    src: &dyn TensorSource,
    device: &Device,
) -> Result<Transformer, WeightsError> {
    cfg.validate()?;
    let scheme = NameScheme::detect(src);
    // Every tensor the config needs must exist (the first missing one is named), and the files
    // must hold at least the config's parameter count: both before anything is allocated.
    let mut names = vec![scheme.embed(), scheme.final_norm()];
    if !cfg.tie_word_embeddings {
        names.push(scheme.lm_head());
    }
    for i in 0..cfg.num_hidden_layers {
        for suffix in [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ] {
            names.push(scheme.layer(i, suffix));
        }
    }
    if let Some(name) = names.into_iter().find(|n| !src.contains(n)) {
        return Err(WeightsError::Missing {
            name,
            files: src.describe(),
        });
    }
    // `validate` bounds the count (no overflow below: every product is at most it).
    let needed = cfg.parameter_count().unwrap_or(u64::MAX);
    if let Some(available) = src.element_count()
        && needed > available
    {
        return Err(WeightsError::TooFewWeights {
            files: src.describe(),
            needed,
            available,
        });
    }
    let d = cfg.hidden_size;
    let hd = cfg.head_dim();
    let (h, kvh) = (cfg.num_attention_heads, cfg.kv_heads());
    let inter = cfg.intermediate_size;

    let lin =
        |name: String, d_in: usize, d_out: usize, bias: bool| -> Result<Linear, WeightsError> {
            let w = src.read_f32(&name, &[d_out, d_in])?;
            let w = transpose(&w, d_out, d_in);
            let b = if bias {
                let bname = name.replace(".weight", ".bias");
                Some(param1(src.read_f32(&bname, &[d_out])?, device))
            } else {
                None
            };
            Ok(Linear {
                weight: param2(w, [d_in, d_out], device),
                bias: b,
            })
        };
    let norm = |name: String| -> Result<RmsNorm, WeightsError> {
        Ok(RmsNorm {
            gamma: param1(src.read_f32(&name, &[d])?, device),
            epsilon: cfg.rms_norm_eps,
        })
    };

    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        let n = |s: &str| scheme.layer(i, s);
        layers.push(DecoderLayer {
            input_layernorm: norm(n("input_layernorm.weight"))?,
            self_attn: Attention {
                q_proj: lin(n("self_attn.q_proj.weight"), d, h * hd, cfg.attention_bias)?,
                k_proj: lin(
                    n("self_attn.k_proj.weight"),
                    d,
                    kvh * hd,
                    cfg.attention_bias,
                )?,
                v_proj: lin(
                    n("self_attn.v_proj.weight"),
                    d,
                    kvh * hd,
                    cfg.attention_bias,
                )?,
                o_proj: lin(n("self_attn.o_proj.weight"), h * hd, d, false)?,
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: hd,
                q_lora: None,
                k_lora: None,
                v_lora: None,
                o_lora: None,
            },
            post_attention_layernorm: norm(n("post_attention_layernorm.weight"))?,
            mlp: Mlp {
                gate_proj: lin(n("mlp.gate_proj.weight"), d, inter, cfg.mlp_bias)?,
                up_proj: lin(n("mlp.up_proj.weight"), d, inter, cfg.mlp_bias)?,
                down_proj: lin(n("mlp.down_proj.weight"), inter, d, cfg.mlp_bias)?,
                gate_lora: None,
                up_lora: None,
                down_lora: None,
            },
        });
    }
    let embed = src.read_f32(&scheme.embed(), &[cfg.vocab_size, d])?;
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(lin(scheme.lm_head(), d, cfg.vocab_size, false)?)
    };
    Ok(Transformer {
        embed_tokens: Embedding {
            weight: param2(embed, [cfg.vocab_size, d], device),
        },
        layers,
        norm: norm(scheme.final_norm())?,
        lm_head,
        config: cfg.clone(),
    })
}

/// Load an HF model folder (`config.json` + safetensors) onto `device`. Never panics and never
/// allocates more than the files can back (see the module docs).
pub fn load_hf_dir(dir: impl AsRef<Path>, device: &Device) -> Result<Transformer, WeightsError> {
    let dir = dir.as_ref();
    let cfg = TransformerConfig::from_hf_config_file(dir.join("config.json"))?;
    let src = SafetensorsSource::open_dir(dir)?;
    load_transformer(&cfg, &src, device)
}

/// An owned f32 tensor for safetensors serialisation.
struct OwnedF32 {
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &OwnedF32 {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn to_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .try_into_vec_as::<f32>()
        .expect("float tensor converts to f32")
}

/// All parameters under their HF (Llama/Qwen2 scheme) names, linear weights as `[out, in]`.
pub fn hf_state_dict(model: &Transformer) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let mut out = BTreeMap::new();
    let mut put_lin = |name: String, l: &Linear| {
        let w = l.weight.val();
        let [d_in, d_out] = w.dims();
        let data = transpose(&to_f32(w), d_in, d_out);
        out.insert(name.clone(), (vec![d_out, d_in], data));
        if let Some(b) = &l.bias {
            out.insert(
                name.replace(".weight", ".bias"),
                (vec![d_out], to_f32(b.val())),
            );
        }
    };
    for (i, layer) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        put_lin(
            format!("{p}.self_attn.q_proj.weight"),
            &layer.self_attn.q_proj,
        );
        put_lin(
            format!("{p}.self_attn.k_proj.weight"),
            &layer.self_attn.k_proj,
        );
        put_lin(
            format!("{p}.self_attn.v_proj.weight"),
            &layer.self_attn.v_proj,
        );
        put_lin(
            format!("{p}.self_attn.o_proj.weight"),
            &layer.self_attn.o_proj,
        );
        put_lin(format!("{p}.mlp.gate_proj.weight"), &layer.mlp.gate_proj);
        put_lin(format!("{p}.mlp.up_proj.weight"), &layer.mlp.up_proj);
        put_lin(format!("{p}.mlp.down_proj.weight"), &layer.mlp.down_proj);
    }
    if let Some(head) = &model.lm_head {
        put_lin("lm_head.weight".into(), head);
    }
    let d = model.config.hidden_size;
    for (i, layer) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        out.insert(
            format!("{p}.input_layernorm.weight"),
            (vec![d], to_f32(layer.input_layernorm.gamma.val())),
        );
        out.insert(
            format!("{p}.post_attention_layernorm.weight"),
            (vec![d], to_f32(layer.post_attention_layernorm.gamma.val())),
        );
    }
    out.insert(
        "model.norm.weight".into(),
        (vec![d], to_f32(model.norm.gamma.val())),
    );
    out.insert(
        "model.embed_tokens.weight".into(),
        (
            vec![model.config.vocab_size, d],
            to_f32(model.embed_tokens.weight.val()),
        ),
    );
    out
}

/// Save `model` as an HF folder: `config.json` + `model.safetensors` (f32), which
/// `transformers` opens with `AutoModelForCausalLM.from_pretrained(dir)` (Llama / Qwen2). LoRA
/// adapters are merged into the weights first ([`Transformer::merge_lora`]).
pub fn save_hf_dir(model: &Transformer, dir: impl AsRef<Path>) -> Result<(), WeightsError> {
    // An HF folder has no place for adapters: LoRA updates are folded into the weights.
    let merged;
    let model = if model.has_lora() {
        merged = model.merge_lora();
        &merged
    } else {
        model
    };
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let cfg_path = dir.join("config.json");
    let cfg =
        serde_json::to_string_pretty(&model.config.to_hf_config_json()).expect("config serializes");
    std::fs::write(&cfg_path, cfg).map_err(io_err(&cfg_path))?;
    let owned: Vec<(String, OwnedF32)> = hf_state_dict(model)
        .into_iter()
        .map(|(name, (shape, data))| {
            let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
            (name, OwnedF32 { shape, bytes })
        })
        .collect();
    let path = dir.join("model.safetensors");
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    safetensors::serialize_to_file(
        owned.iter().map(|(n, t)| (n.as_str(), t)),
        Some(meta),
        &path,
    )
    .map_err(|e| WeightsError::Safetensors {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}
