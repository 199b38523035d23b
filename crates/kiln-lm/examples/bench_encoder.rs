//! Benchmark: the sentence encoder (all-MiniLM-L6-v2) on burn-flex, encoding the first N passages
//! (the `text` field) of a corpus JSONL file as passages. Prints one JSON line with passages/s and
//! tokens/s (tokens: special tokens included, after truncation to max_seq_len, no padding), and
//! passages per CPU-second (process CPU time, steadier than wall time on a shared machine).
//! Threads: RAYON_NUM_THREADS (default: all cores).
//!
//! `RAYON_NUM_THREADS=1 cargo run --release -p kiln-lm --example bench_encoder -- [CORPUS]
//! [--n 2000] [--batch-size 32] [--model all-minilm-l6-v2]` (the sentence-transformers side:
//! `scripts/lm/bench_st.py`). CORPUS defaults to ../shared/datasets/corpus/gold_context_union.jsonl
//! (from the repo root). Measures; asserts nothing.

use std::io::BufRead;
use std::time::Instant;

use kiln_lm::{SentenceEncoder, TextKind};

fn main() {
    let mut corpus = "../shared/datasets/corpus/gold_context_union.jsonl".to_string();
    let mut n = 2000usize;
    let mut batch = 32usize;
    let mut model = std::env::var("KILN_MINILM_DIR").unwrap_or_else(|_| "all-minilm-l6-v2".into());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |flag: &str| {
            args.next()
                .unwrap_or_else(|| panic!("{flag} needs a value"))
        };
        match a.as_str() {
            "--n" => n = value("--n").parse().expect("--n: a number"),
            "--batch-size" => {
                batch = value("--batch-size")
                    .parse()
                    .expect("--batch-size: a number")
            }
            "--model" => model = value("--model"),
            _ if a.starts_with("--") => panic!("unknown flag {a}"),
            _ => corpus = a,
        }
    }
    let threads = rayon::current_num_threads();
    let file = std::fs::File::open(&corpus).unwrap_or_else(|e| panic!("{corpus}: {e}"));
    let texts: Vec<String> = std::io::BufReader::new(file)
        .lines()
        .take(n)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(&l.expect("read")).expect("JSON line");
            v["text"].as_str().expect("a `text` field").to_string()
        })
        .collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let t = Instant::now();
    let enc = SentenceEncoder::load(&model).unwrap_or_else(|e| panic!("{e}"));
    let load_s = t.elapsed().as_secs_f64();
    // Token counts as the encoder sees them (truncated, special tokens included).
    let tokens: usize = enc
        .token_counts(&refs, TextKind::Passage)
        .expect("tokenize")
        .iter()
        .sum();
    enc.encode(&refs[..refs.len().min(64)], TextKind::Passage, batch)
        .expect("warm-up");
    let (t, cpu0) = (Instant::now(), cpu_seconds());
    let v = enc.encode(&refs, TextKind::Passage, batch).expect("encode");
    let (s, cpu) = (t.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    assert_eq!(v.len(), refs.len() * enc.dim());
    println!(
        "{{\"impl\":\"kiln\",\"backend\":\"burn-flex\",\"threads\":{threads},\"batch_size\":{batch},\"passages\":{},\"tokens\":{tokens},\"dim\":{},\"load_s\":{load_s:.3},\"seconds\":{s:.3},\"cpu_seconds\":{cpu:.2},\"passages_per_s\":{:.1},\"tokens_per_s\":{:.1},\"passages_per_cpu_s\":{:.1}}}",
        refs.len(),
        enc.dim(),
        refs.len() as f64 / s,
        tokens as f64 / s,
        refs.len() as f64 / cpu
    );
}

/// CPU time of the whole process (all threads), from /proc/self/stat (10 ms ticks): on a
/// shared machine it is steadier than wall time.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the `(comm)`: state is field 3; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / 100.0
}
