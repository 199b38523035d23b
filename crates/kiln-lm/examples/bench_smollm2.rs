//! Benchmark: SmolLM2-135M-Instruct (GGUF dequantised to f32) on burn-flex.
//! - batched generation: batch 8, 128 new tokens each (greedy, no early stop), KV cache;
//! - train step: forward + backward of the mean token NLL, batch 4 x 256 tokens, full (every
//!   weight) and LoRA (r = 16 on the seven projections of every layer, base frozen).
//!
//! `cargo run --release -p kiln-lm --example bench_smollm2` (the PyTorch side:
//! `scripts/lm/bench_torch.py`). Prints one JSON line. Measures; asserts nothing.

use std::time::Instant;

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln_lm::{LoraConfig, SamplingConfig, Transformer, generate, load_gguf, zoo};
use rand::{Rng, SeedableRng};

fn main() {
    // The allocator setting the kiln binary runs with (`KILN_MALLOC=system` measures without it).
    kiln_lm::malloc::keep_freed_memory();
    let path = zoo::smollm2_gguf()
        .ok()
        .flatten()
        .expect("SmolLM2 GGUF not found: run `just setup`");
    let threads = rayon::current_num_threads();
    let device = Device::flex();
    let model = load_gguf(&path, &device).expect("load");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);

    // Generation: 8 prompts of 8 tokens, 128 new tokens each.
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|_| (0..8).map(|_| rng.random_range(100..40000)).collect())
        .collect();
    let cfg = SamplingConfig::greedy(128);
    let _ = generate(
        &model,
        &prompts[..1],
        &SamplingConfig::greedy(4),
        &mut rng,
        None,
    );
    let t = Instant::now();
    let out = generate(&model, &prompts, &cfg, &mut rng, None);
    let gen_s = t.elapsed().as_secs_f64();
    let n: usize = out.tokens.iter().map(Vec::len).sum();

    // Train step: forward + backward, batch 4 x 256.
    let ad = Device::flex().autodiff();
    let train_model = load_gguf(&path, &ad).expect("load");
    let toks: Vec<i64> = (0..4 * 256).map(|_| rng.random_range(100..40000)).collect();
    let step = |m: &Transformer| {
        let mut step_s = Vec::new();
        for _ in 0..3 {
            let tokens = Tensor::<2, Int>::from_data(TensorData::new(toks.clone(), [4, 256]), &ad);
            let t = Instant::now();
            let logits = m.forward(tokens.clone());
            let v = logits.dims()[2];
            let logp = log_softmax(logits.slice([0..4, 0..255, 0..v]), 2);
            let tgt = tokens.slice([0..4, 1..256]).reshape([4, 255, 1]);
            let loss = logp.gather(2, tgt).mean().neg();
            let grads = loss.backward();
            drop(grads);
            step_s.push(t.elapsed().as_secs_f64());
        }
        step_s.iter().cloned().fold(f64::INFINITY, f64::min)
    };
    let best = step(&train_model);
    // LoRA r = 16 on all seven projections: the base is frozen (no weight gradients).
    let lora = train_model.with_lora(&LoraConfig::default());
    let lora_params = lora.lora_parameter_count();
    let lora_best = step(&lora);
    // FLOPs: 2*params per token forward (non-embedding matmuls + lm head), x3 for fwd+bwd.
    let p_matmul =
        30.0 * (576.0 * 576.0 * 2.0 + 576.0 * 192.0 * 2.0 + 3.0 * 576.0 * 1536.0) + 576.0 * 49152.0;
    let train_flops = 6.0 * p_matmul * 1024.0;
    println!(
        "{{\"impl\":\"kiln\",\"backend\":\"burn-flex\",\"threads\":{threads},\"gen_batch\":8,\"gen_new_tokens\":128,\"gen_tokens\":{n},\"gen_s\":{gen_s:.3},\"gen_tok_per_s\":{:.1},\"train_batch\":\"4x256\",\"train_step_s\":{best:.3},\"train_gflops_per_s\":{:.1},\"lora_r16_train_step_s\":{lora_best:.3},\"lora_params\":{lora_params}}}",
        n as f64 / gen_s,
        train_flops / best / 1e9
    );
}
