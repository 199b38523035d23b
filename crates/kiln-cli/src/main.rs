//! The `kiln` command-line tool.

use clap::{Parser, Subcommand};

/// kiln: reinforcement-learning training for LLM agents and masked-diffusion schedulers.
#[derive(Parser, Debug)]
#[command(name = "kiln", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Build a BM25 index from JSONL corpora.
    Index(kiln_retrieval::cli::IndexArgs),
    /// Serve a BM25 index over HTTP with Search-R1's `/retrieve` API.
    ServeRetriever(kiln_retrieval::cli::ServeArgs),
    /// Benchmark index build, search QPS and server latency.
    BenchRetriever(kiln_retrieval::cli::BenchArgs),
    /// Write plots and a report for a run directory.
    Report(kiln_track::cli::ReportArgs),
    /// Generate a completion with a model.
    Generate(kiln_lm::cli::GenerateArgs),
    /// Export a checkpoint as an HF model folder.
    Export(kiln_lm::cli::ExportArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Index(a) => kiln_retrieval::cli::run_index(a)?,
        Command::ServeRetriever(a) => kiln_retrieval::cli::run_serve(a)?,
        Command::BenchRetriever(a) => kiln_retrieval::cli::run_bench(a)?,
        Command::Report(a) => kiln_track::cli::run_report(a)?,
        Command::Generate(a) => kiln_lm::cli::run_generate(a)?,
        Command::Export(a) => kiln_lm::cli::run_export(a)?,
    }
    Ok(())
}
