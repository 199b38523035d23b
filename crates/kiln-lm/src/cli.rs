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
    /// Use the prompt as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
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
    let text = if args.raw {
        args.prompt.clone()
    } else {
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(ChatMessage::system(s.clone()));
        }
        msgs.push(ChatMessage::user(args.prompt.clone()));
        tok.apply_chat_template(&msgs, true)
    };
    let ids = tok.encode(&text, true)?;
    if ids.is_empty() {
        return Err(CliError::Usage("the prompt encodes to no tokens".into()));
    }
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
