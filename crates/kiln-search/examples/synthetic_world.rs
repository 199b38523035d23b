//! Generates the default synthetic world, reports its size and generation time, and prints samples.
//!
//! `cargo run --release -p kiln-search --example synthetic_world [-- SEED [OUT_DIR]]`

use std::time::Instant;

use kiln_search::synthetic::{Split, WorldConfig, demonstration_turns, generate};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let seed: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(0);
    let cfg = WorldConfig {
        seed,
        ..WorldConfig::default()
    };
    let t = Instant::now();
    let world = generate(&cfg)?;
    let gen_s = t.elapsed().as_secs_f64();
    let bytes: usize = world
        .corpus
        .iter()
        .map(|d| d.title.len() + d.text.len())
        .sum();
    println!(
        "seed {seed}: {} documents ({} bytes of text), questions train/dev/test = {}/{}/{}, generated in {:.1} ms",
        world.corpus.len(),
        bytes,
        world.train.len(),
        world.dev.len(),
        world.test.len(),
        gen_s * 1e3
    );
    let mut words = std::collections::HashSet::new();
    for d in &world.corpus {
        words.extend(
            d.text
                .split_whitespace()
                .map(|w| w.trim_matches('.').to_lowercase()),
        );
    }
    println!("distinct words in the corpus: {}", words.len());
    for s in Split::ALL {
        let mut kinds = std::collections::BTreeMap::new();
        for q in world.split(s) {
            *kinds
                .entry(q.example.kind.clone().unwrap_or_default())
                .or_insert(0) += 1;
        }
        println!("{}: {kinds:?}", s.name());
    }
    for d in world.corpus.iter().step_by(world.corpus.len() / 4) {
        println!("doc {}: {} | {}", d.id, d.title, d.text);
    }
    for q in world.test.iter().take(4) {
        println!(
            "\nQ {} [{:?}]: {} -> {:?}",
            q.example.id, q.example.kind, q.example.question, q.example.golden_answers
        );
        for turn in demonstration_turns(q) {
            println!("  {}", turn.replace('\n', " "));
        }
    }
    if let Some(dir) = args.next() {
        let t = Instant::now();
        world.write(std::path::Path::new(&dir))?;
        println!(
            "written to {dir} in {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    Ok(())
}
