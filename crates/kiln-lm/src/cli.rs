//! Command-line entry points wired into the `kiln` binary (`kiln generate`, `kiln export`).

use std::path::PathBuf;

/// Errors of the model commands.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The command is not available in this build yet.
    #[error("`kiln {0}` is not available yet in this build")]
    Unavailable(&'static str),
}

/// `kiln generate --model NAME_OR_DIR --prompt TEXT`.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// A preset name (e.g. `smollm2-135m`) or a local HF model folder.
    #[arg(long)]
    pub model: String,
    /// The prompt.
    #[arg(long)]
    pub prompt: String,
}

/// `kiln export CHECKPOINT --hf OUT_DIR`.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// A kiln checkpoint directory.
    pub checkpoint: PathBuf,
    /// Output folder in HF layout (config.json + model.safetensors).
    #[arg(long)]
    pub hf: PathBuf,
}

/// Run `kiln generate`.
pub fn run_generate(_args: GenerateArgs) -> Result<(), CliError> {
    Err(CliError::Unavailable("generate"))
}

/// Run `kiln export`.
pub fn run_export(_args: ExportArgs) -> Result<(), CliError> {
    Err(CliError::Unavailable("export"))
}
