//! `kiln bench-retriever` without building the whole `kiln` binary:
//! `cargo run --release -p kiln-retrieval --example bench_retriever -- --corpus C.jsonl --queries QA.jsonl`.

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: kiln_retrieval::cli::BenchArgs,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    kiln_retrieval::cli::run_bench(Cli::parse().args)?;
    Ok(())
}
