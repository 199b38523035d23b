//! Command-line entry points of kiln-search (wired into the `kiln` binary by kiln-cli).

use std::path::PathBuf;
use std::time::Instant;

use crate::Error;
use crate::synthetic::{Split, WorldConfig, default_cache_root, load_or_generate};

/// `kiln synthetic-world`: generate (or reuse from the cache) the seeded synthetic multi-hop world.
#[derive(clap::Args, Debug, Clone)]
pub struct SyntheticArgs {
    /// RNG seed of the world.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Cache root (default: `$KILN_SYNTHETIC_CACHE` or `datasets/cache/synthetic`).
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,
    /// Training questions.
    #[arg(long)]
    pub train_questions: Option<usize>,
    /// Development questions.
    #[arg(long)]
    pub dev_questions: Option<usize>,
    /// Test questions.
    #[arg(long)]
    pub test_questions: Option<usize>,
}

/// Runs `kiln synthetic-world`: prints where the corpus and the splits are, and how to index the corpus.
pub fn run_synthetic(args: SyntheticArgs) -> Result<(), Error> {
    let mut cfg = WorldConfig {
        seed: args.seed,
        ..WorldConfig::default()
    };
    if let Some(n) = args.train_questions {
        cfg.train.questions = n;
    }
    if let Some(n) = args.dev_questions {
        cfg.dev.questions = n;
    }
    if let Some(n) = args.test_questions {
        cfg.test.questions = n;
    }
    let root = args.cache.unwrap_or_else(default_cache_root);
    let t = Instant::now();
    let (world, dir) = load_or_generate(&cfg, &root)?;
    println!(
        "synthetic world (seed {}) in {} ({:.0} ms)",
        cfg.seed,
        dir.display(),
        t.elapsed().as_secs_f64() * 1e3
    );
    println!("  corpus.jsonl: {} documents", world.corpus.len());
    for s in Split::ALL {
        println!("  {}.jsonl: {} questions", s.name(), world.split(s).len());
    }
    println!(
        "index it with: kiln index --corpus {} --out {}",
        dir.join("corpus.jsonl").display(),
        dir.join("index").display()
    );
    Ok(())
}
