//! kiln side of `scripts/bench/side_by_side.sh` (the PyTorch side is `scripts/bench/side_by_side.py`; the
//! two run the same workloads, same shapes, same thread count, and the shell script prints the ratios):
//!
//! - `smollm2_gen_8x128`, `smollm2_gen_32x64`: SmolLM2-135M-Instruct greedy generation (prompts of 8 random
//!   tokens, no early stop, KV cache);
//! - `smollm2_train_full_4x256`, `smollm2_train_lora_4x256`: forward + backward of the mean token NLL, every
//!   weight / LoRA r = 16 on the seven projections (base frozen);
//! - `tiny_gen_b20`, `tiny_gen_b64`: the 1.3M search agent's architecture (`configs/model/tiny-agent.yaml`,
//!   random weights) generating 48 tokens after 64-token prompts;
//! - `grpo_step`: the compute of one default Search-R1 GRPO step on SmolLM2 with LoRA: rollouts of 20
//!   trajectories (4 questions x G = 5) with 4 turns of 48 sampled tokens after a 400-token prompt, 150
//!   observation tokens appended after each of the first 3 turns (kiln continues each row from its kept
//!   KV cache, as its actor does; the PyTorch loop re-prefills each turn's context, as `generate` does
//!   without a cache passed in), then the update: forward + backward of the 20 finished rows in micro-batches
//!   of 2 (the whole-vocabulary loss of this bench keeps `[5, 1042, 49152]` logits alive: pieces of 5
//!   were killed at the machine's 24 GB) (retrieval, rewards and the optimiser step left out: they are < 1% of a step).
//!
//! - `smollm2_update_lora_2x1042` (kiln only, run when named): the GRPO step's update unit alone, forward +
//!   backward of 2 rows of 1,042 tokens with LoRA, twice; `seconds` is the second (a training run's steady
//!   state: memory freed by the first is reused), `first_s` the first.
//!
//! `KILN_BENCH_CKPT=1` trains on burn's gradient-checkpointing autodiff device (memory-bound ops recomputed
//! in the backward pass instead of kept); `KILN_MALLOC=system` runs without [`kiln_lm::malloc`]'s setting.
//!
//! Writes the two models' HF `config.json` into `OUT_DIR` (the Python side builds the same shapes from them)
//! and prints one JSON line per workload: seconds and tokens. Measures; asserts nothing.
//!
//! `cargo run --release -p kiln-lm --example bench_side -- OUT_DIR [WORKLOAD,...]`

use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln_lm::{
    LoraConfig, SamplingConfig, Transformer, TransformerConfig, generate, generate_reusing,
    load_gguf, zoo,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SEED: u64 = 0;

fn random_rows(rng: &mut ChaCha8Rng, b: usize, len: usize, vocab: u32) -> Vec<Vec<u32>> {
    (0..b)
        .map(|_| (0..len).map(|_| rng.random_range(3..vocab)).collect())
        .collect()
}

/// Greedy generation of `new` tokens after each prompt; (seconds, generated tokens).
fn greedy_gen(model: &Transformer, prompts: &[Vec<u32>], new: usize) -> (f64, usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(SEED);
    let _ = generate(
        model,
        &prompts[..1],
        &SamplingConfig::greedy(2),
        &mut rng,
        None,
    );
    let t = Instant::now();
    let out = generate(model, prompts, &SamplingConfig::greedy(new), &mut rng, None);
    (
        t.elapsed().as_secs_f64(),
        out.tokens.iter().map(Vec::len).sum(),
    )
}

/// Forward + backward of the mean next-token NLL of `rows` (equal lengths) in pieces of `micro`.
fn fwd_bwd(model: &Transformer, rows: &[Vec<u32>], micro: usize) {
    let device = model.device();
    for piece in rows.chunks(micro.max(1)) {
        let (b, w) = (piece.len(), piece[0].len());
        let ids: Vec<i64> = piece.iter().flatten().map(|&t| t as i64).collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, w]), &device);
        let logits = model.forward(tokens.clone());
        let v = logits.dims()[2];
        // log_softmax + gather, fused on the CPU (as kiln's trainer scores tokens).
        let logits = logits
            .slice([0..b, 0..w - 1, 0..v])
            .reshape([b * (w - 1), v]);
        let tgt = tokens.slice([0..b, 1..w]).reshape([b * (w - 1)]);
        let loss = kiln_lm::fused::target_logprobs(logits, tgt, false)
            .0
            .mean()
            .neg();
        drop(loss.backward());
    }
}

/// Best of 3 train steps (after one warm-up) over `rows`.
fn train(model: &Transformer, rows: &[Vec<u32>], micro: usize) -> f64 {
    fwd_bwd(model, &rows[..1], 1);
    (0..3)
        .map(|_| {
            let t = Instant::now();
            fwd_bwd(model, rows, micro);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn emit(name: &str, seconds: f64, tokens: usize, extra: &str) {
    println!(
        "{{\"impl\":\"kiln\",\"workload\":\"{name}\",\"seconds\":{seconds:.4},\"tokens\":{tokens}{extra}}}"
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The allocator setting the kiln binary runs with (`KILN_MALLOC=system` measures without it).
    kiln_lm::malloc::keep_freed_memory();
    let mut args = std::env::args().skip(1);
    let out = std::path::PathBuf::from(
        args.next()
            .ok_or("usage: bench_side OUT_DIR [WORKLOAD,...]")?,
    );
    let only: Vec<String> = args
        .next()
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or_default();
    let want = |w: &str| only.is_empty() || only.iter().any(|o| o == w);
    std::fs::create_dir_all(&out)?;
    let device = Device::flex();
    // SmolLM2 is loaded only when a workload needs it (the tiny agent's alone skip the load).
    if only.is_empty()
        || only
            .iter()
            .any(|o| o.starts_with("smollm2") || o == "grpo_step")
    {
        smollm2_workloads(&out, &only, &device)?;
    }
    // Its own stream, so that the prompts do not depend on which other workloads ran.
    let mut rng = ChaCha8Rng::seed_from_u64(SEED + 1);

    let tiny_cfg = TransformerConfig::from_yaml_file(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../configs/model/tiny-agent.yaml"),
    )?;
    std::fs::write(
        out.join("tiny_config.json"),
        tiny_cfg.to_hf_config_json().to_string(),
    )?;
    let tiny = tiny_cfg.init(&device);
    for (name, b) in [("tiny_gen_b20", 20), ("tiny_gen_b64", 64)] {
        if want(name) {
            let prompts = random_rows(&mut rng, b, 64, tiny_cfg.vocab_size as u32);
            let (s, n) = greedy_gen(&tiny, &prompts, 48);
            emit(name, s, n, "");
        }
    }
    Ok(())
}

/// The SmolLM2-135M workloads: generation, train steps, the GRPO step.
fn smollm2_workloads(
    out: &std::path::Path,
    only: &[String],
    device: &Device,
) -> Result<(), Box<dyn std::error::Error>> {
    let rng = &mut ChaCha8Rng::seed_from_u64(SEED);
    let want = |w: &str| only.is_empty() || only.iter().any(|o| o == w);
    let path =
        zoo::lookup_name("smollm2-135m")?.ok_or("SmolLM2 is not installed: run `just setup`")?;
    let ad = if std::env::var_os("KILN_BENCH_CKPT").is_some() {
        Device::flex().autodiff().gradient_checkpointing()
    } else {
        Device::flex().autodiff()
    };

    let smol = load_gguf(&path, device)?;
    let cfg = smol.config().clone();
    std::fs::write(
        out.join("smollm2_config.json"),
        cfg.to_hf_config_json().to_string(),
    )?;
    let vocab = cfg.vocab_size as u32;
    for (name, b, new) in [("smollm2_gen_8x128", 8, 128), ("smollm2_gen_32x64", 32, 64)] {
        if want(name) {
            let prompts = random_rows(rng, b, 8, vocab);
            let (s, n) = greedy_gen(&smol, &prompts, new);
            emit(name, s, n, "");
        }
    }
    drop(smol);

    let train_rows = random_rows(rng, 4, 256, vocab);
    let smol_ad = load_gguf(&path, &ad)?;
    if want("smollm2_train_full_4x256") {
        let s = train(&smol_ad, &train_rows, 4);
        emit("smollm2_train_full_4x256", s, 4 * 256, "");
    }
    let lora = smol_ad.with_lora(&LoraConfig::default());
    if want("smollm2_train_lora_4x256") {
        let s = train(&lora, &train_rows, 4);
        emit(
            "smollm2_train_lora_4x256",
            s,
            4 * 256,
            &format!(",\"lora_params\":{}", lora.lora_parameter_count()),
        );
    }
    if only.iter().any(|o| o == "smollm2_update_lora_2x1042") {
        let rows = random_rows(rng, 2, 1042, vocab);
        let t = Instant::now();
        fwd_bwd(&lora, &rows, 2);
        let first = t.elapsed().as_secs_f64();
        let t = Instant::now();
        fwd_bwd(&lora, &rows, 2);
        emit(
            "smollm2_update_lora_2x1042",
            t.elapsed().as_secs_f64(),
            2 * 1042,
            &format!(",\"first_s\":{first:.3}"),
        );
    }
    if want("grpo_step") {
        // Rollouts: the merged policy (as kiln's actor samples), 4 turns, re-prefilled contexts.
        let policy = lora.merge_lora().valid();
        let mut ctx = random_rows(rng, 20, 400, vocab);
        let sampling = SamplingConfig {
            temperature: 1.0,
            greedy: false,
            ..SamplingConfig::greedy(48)
        };
        let mut srng = ChaCha8Rng::seed_from_u64(SEED);
        let t = Instant::now();
        let mut generated = 0;
        let mut kept: Vec<kiln_lm::SeqCache> = Vec::new();
        for turn in 0..4 {
            // kiln's actor continues each episode from its kept KV cache (LmActor::reuse_kv).
            let reuse: Vec<Option<&kiln_lm::SeqCache>> =
                (0..ctx.len()).map(|i| kept.get(i)).collect();
            let (g, k) = generate_reusing(&policy, &ctx, &sampling, &mut srng, None, &reuse);
            kept = k;
            for (c, mut new) in ctx.iter_mut().zip(g.tokens) {
                generated += new.len();
                // Equal lengths across rows (no early stop), as in the PyTorch loop.
                new.resize(48, 3);
                c.extend(new);
                if turn < 3 {
                    c.extend((0..150).map(|_| rng.random_range(3..vocab)));
                }
            }
        }
        let rollout_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        fwd_bwd(&lora, &ctx, 2);
        let update_s = t.elapsed().as_secs_f64();
        emit(
            "grpo_step",
            rollout_s + update_s,
            generated,
            &format!(
                ",\"rollout_s\":{rollout_s:.3},\"update_s\":{update_s:.3},\"row_len\":{}",
                ctx[0].len()
            ),
        );
    }
    drop(lora);

    Ok(())
}
