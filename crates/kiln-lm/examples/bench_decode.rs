//! Benchmark: decode speed of SmolLM2-135M-Instruct against the context length it attends to.
//!
//! A search rollout decodes with long transcripts in the KV cache (400 - 1,100 tokens); the cost
//! of one decode step then has a part that grows with the context (reading, and before the
//! preallocated cache, copying every layer's keys and values). For each prompt length this
//! prefills a batch of random prompts and decodes `NEW` tokens greedily (no early stop), and
//! reports the decode time alone (prefill and the packing of the weights for the decode steps
//! excluded; `pack_s` is the latter, 0 with `KILN_DECODE=burn`), best of `REPS`.
//!
//! `cargo run --release -p kiln-lm --example bench_decode [-- B NEW LEN,LEN,...]`
//! (defaults: 20 64 64,512,1024). Prints one JSON line per length. Measures; asserts nothing.

use std::time::Instant;

use burn::tensor::Device;
use kiln_lm::{SamplingConfig, generate, load_gguf, zoo};
use rand::{Rng, SeedableRng};

const REPS: usize = 2;

fn main() {
    kiln_lm::malloc::keep_freed_memory();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let batch: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(20);
    let new_tokens: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(64);
    let lens: Vec<usize> = args
        .get(2)
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![64, 512, 1024]);
    let path = zoo::smollm2_gguf()
        .ok()
        .flatten()
        .expect("SmolLM2 GGUF not found: run `just setup`");
    let threads = rayon::current_num_threads();
    let device = Device::flex();
    let model = load_gguf(&path, &device).expect("load");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let cfg = SamplingConfig::greedy(new_tokens);
    let _ = generate(
        &model,
        &[vec![1, 2, 3]],
        &SamplingConfig::greedy(4),
        &mut rng,
        None,
    );
    for &len in &lens {
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|_| (0..len).map(|_| rng.random_range(100..40000)).collect())
            .collect();
        let mut best = f64::INFINITY;
        let mut prefill = f64::INFINITY;
        let mut pack = f64::INFINITY;
        let mut decoded = 0;
        for _ in 0..REPS {
            let t = Instant::now();
            let out = generate(&model, &prompts, &cfg, &mut rng, None);
            let total = t.elapsed().as_secs_f64();
            best = best.min(total - out.prefill_seconds - out.pack_seconds);
            prefill = prefill.min(out.prefill_seconds);
            pack = pack.min(out.pack_seconds);
            // The first token of each row comes from the prefill's logits.
            decoded = out
                .tokens
                .iter()
                .map(|t| t.len().saturating_sub(1))
                .sum::<usize>();
        }
        // Bytes of keys and values attended at the mean context of the decode (f32).
        let mean_ctx = len as f64 + new_tokens as f64 / 2.0;
        let kv_mb = batch as f64 * mean_ctx * 30.0 * 2.0 * 3.0 * 64.0 * 4.0 / 1e6;
        println!(
            "{{\"impl\":\"kiln\",\"threads\":{threads},\"batch\":{batch},\"prompt_len\":{len},\"new_tokens\":{new_tokens},\"prefill_s\":{prefill:.3},\"pack_s\":{pack:.3},\"decode_s\":{best:.3},\"decode_tok_per_s\":{:.1},\"decode_step_ms\":{:.1},\"kv_mb_per_step\":{kv_mb:.0}}}",
            decoded as f64 / best,
            best * 1e3 / (new_tokens.saturating_sub(1).max(1)) as f64,
        );
    }
}
