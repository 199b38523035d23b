//! Command-line entry points wired into the `kiln` binary (`kiln generate`, `kiln export`).

use std::path::PathBuf;
use std::time::Instant;

use burn::tensor::Device;
use rand::SeedableRng;

use crate::generate::{SamplingConfig, generate};
use crate::tokenizer::ChatMessage;
use crate::weights::{WeightsError, load_hf_dir, save_hf_dir};
use crate::zoo::{ZooError, load_with_tokenizer};

/// Errors of the model commands.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Model lookup / loading failed.
    #[error(transparent)]
    Zoo(#[from] ZooError),
    /// Weights failed to load or save.
    #[error(transparent)]
    Weights(#[from] WeightsError),
    /// Tokenization failed.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// Bad arguments.
    #[error("{0}")]
    Usage(String),
    /// The prompt's ids do not fit the model.
    #[error("{0}")]
    Prompt(String),
}

/// `kiln generate --model NAME_OR_DIR --prompt TEXT`.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// A recorded model name (`smollm2-135m`, installed by `just setup`), an HF model folder
    /// (config.json + safetensors + tokenizer.json) or a .gguf file.
    #[arg(long)]
    pub model: String,
    /// The prompt (wrapped in the model's chat template unless --raw).
    #[arg(long)]
    pub prompt: String,
    /// Use the prompt as is, without the chat template (special-token strings in it, such as
    /// `<|im_start|>`, stay plain text).
    #[arg(long)]
    pub raw: bool,
    /// Use the prompt as is and parse special-token strings in it as control tokens (for a
    /// hand-written template; only for prompts you trust). Implies --raw.
    #[arg(long)]
    pub raw_special: bool,
    /// System prompt for the chat template (default: the model's own).
    #[arg(long)]
    pub system: Option<String>,
    /// Maximum number of new tokens.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Top-k sampling (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// RNG seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Generate this many copies of the prompt as one batch (throughput check).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
}

/// `kiln export CHECKPOINT --hf OUT_DIR`.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// A kiln checkpoint directory (config.json + model.safetensors, as written by
    /// `kiln_lm::save_hf_dir`), an HF model folder or a .gguf file.
    pub checkpoint: PathBuf,
    /// Output folder in HF layout (config.json + model.safetensors, f32).
    #[arg(long)]
    pub hf: PathBuf,
}

/// Run `kiln generate`.
pub fn run_generate(args: GenerateArgs) -> Result<(), CliError> {
    if args.batch == 0 {
        return Err(CliError::Usage("--batch must be >= 1".into()));
    }
    let device = Device::flex();
    let t0 = Instant::now();
    let (model, tok) = load_with_tokenizer(&args.model, &device)?;
    let load_s = t0.elapsed().as_secs_f64();
    // The prompt is text from outside: only the chat template (or --raw-special) makes
    // control tokens.
    let ids = if args.raw_special {
        tok.encode_special(&args.prompt, true)?
    } else if args.raw {
        tok.encode(&args.prompt, true)?
    } else {
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(ChatMessage::system(s.clone()));
        }
        msgs.push(ChatMessage::user(args.prompt.clone()));
        tok.encode_chat(&msgs, true, true)?
    };
    if ids.is_empty() {
        return Err(CliError::Usage("the prompt encodes to no tokens".into()));
    }
    crate::generate::check_prompts(model.config().vocab_size, std::slice::from_ref(&ids))
        .map_err(CliError::Prompt)?;
    let mut cfg = SamplingConfig {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        greedy: args.temperature <= 0.0,
        ..SamplingConfig::default()
    };
    cfg.stop_token_ids = tok.stop_ids();
    let cfg = cfg.with_model_stops(&model);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    let prompts = vec![ids.clone(); args.batch];
    let t1 = Instant::now();
    let out = generate(&model, &prompts, &cfg, &mut rng, Some(&tok));
    let gen_s = t1.elapsed().as_secs_f64();
    let completion = tok.decode(&out.tokens[0], true)?;
    println!("{completion}");
    let n: usize = out.tokens.iter().map(Vec::len).sum();
    eprintln!(
        "[kiln] {} prompt tokens, {n} generated tokens (batch {}) in {gen_s:.2}s: {:.1} tokens/s (load {load_s:.2}s, backend flex CPU)",
        ids.len(),
        args.batch,
        n as f64 / gen_s.max(1e-9)
    );
    Ok(())
}

/// Run `kiln export`.
pub fn run_export(args: ExportArgs) -> Result<(), CliError> {
    check_export_target(&args.checkpoint, &args.hf)?;
    let device = Device::flex();
    let model = if args.checkpoint.is_dir() {
        load_hf_dir(&args.checkpoint, &device)?
    } else if args
        .checkpoint
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        crate::gguf::load_gguf(&args.checkpoint, &device)?
    } else {
        return Err(CliError::Usage(format!(
            "{}: expected a checkpoint folder (config.json + model.safetensors) or a .gguf file",
            args.checkpoint.display()
        )));
    };
    save_hf_dir(&model, &args.hf)?;
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        let src = args.checkpoint.join(name);
        if src.is_file() {
            std::fs::copy(&src, args.hf.join(name)).map_err(|source| WeightsError::Io {
                path: src.display().to_string(),
                source,
            })?;
        }
    }
    eprintln!(
        "[kiln] exported {} ({} parameters) to {} (config.json + model.safetensors)",
        args.checkpoint.display(),
        burn::module::Module::num_params(&model),
        args.hf.display()
    );
    Ok(())
}

/// The files `kiln export` writes into its output folder.
const EXPORT_WRITES: &[&str] = &[
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// Refuse an export that would write over its own input.
///
/// Writing `config.json` / `model.safetensors` over the folder being read, or copying
/// `tokenizer.json` onto itself (which truncates it to 0 bytes), destroys the model being
/// exported. Refused: an output folder that is the input folder (compared after resolving
/// symlinks, `.` and `..`, and by device + inode, so `./m`, `m/` and a symlink to `m` are all
/// caught), and an output file that already exists as a file of the input (a symlink or hard link
/// into the input folder, or the input `.gguf` itself).
fn check_export_target(input: &std::path::Path, out: &std::path::Path) -> Result<(), CliError> {
    let refuse = |why: String| {
        CliError::Usage(format!(
            "refusing to export {} to {}: {why}; nothing was written. Give another output folder, \
             e.g. --hf {}-hf",
            input.display(),
            out.display(),
            input.display().to_string().trim_end_matches('/')
        ))
    };
    let Ok(input_real) = input.canonicalize() else {
        return Ok(()); // a missing input is reported by the loader
    };
    let out_real = resolve_lenient(out);
    if out_real == input_real || same_file(&input_real, &out_real) {
        return Err(refuse(format!(
            "that is the input folder ({}), and the export would overwrite its config.json, \
             model.safetensors and tokenizer files",
            input_real.display()
        )));
    }
    // every file of the input that must survive: the input file, or the files in the input folder
    let inputs: Vec<std::path::PathBuf> = if input_real.is_dir() {
        std::fs::read_dir(&input_real)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.is_file())
                    .collect()
            })
            .unwrap_or_default()
    } else {
        vec![input_real.clone()]
    };
    for name in EXPORT_WRITES {
        let target = out_real.join(name);
        let Ok(target_real) = target.canonicalize() else {
            continue; // does not exist yet: a new file
        };
        if let Some(hit) = inputs
            .iter()
            .find(|i| **i == target_real || same_file(i, &target_real))
        {
            return Err(refuse(format!(
                "{} is (a link to) {}, a file of the input, which the export would overwrite",
                target.display(),
                hit.display()
            )));
        }
    }
    Ok(())
}

/// `p` made absolute with symlinks, `.` and `..` resolved, also where its tail does not exist yet:
/// each existing prefix is canonicalised, missing components are appended (and `..` pops them),
/// which is how `create_dir_all` and the writes after it walk the path.
fn resolve_lenient(p: &std::path::Path) -> std::path::PathBuf {
    use std::path::Component;
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(p)
    };
    let mut cur = std::path::PathBuf::new();
    for c in abs.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                cur.pop();
            }
            other => cur.push(other),
        }
        if let Ok(real) = cur.canonicalize() {
            cur = real;
        }
    }
    cur
}

/// Whether `a` and `b` are the same file or folder (same device and inode; bind mounts and
/// hard links included). False when either does not exist.
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::metadata(a), std::fs::metadata(b)) {
            (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
    }
}
