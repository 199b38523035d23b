//! Benchmark: the projections of one decode step of SmolLM2-135M (30 layers x fused q/k/v, o,
//! fused gate/up, down; the 49,152-token head), `M` rows, with the packed kernel of
//! `kiln_lm::skinny` against burn-flex's matmul on the same row-major weights. Random weights
//! (the shapes are what matter); 540 MB in all, more than the last-level cache, so every step
//! streams the weights from memory. Reports ms per step (best of `REPS`) and the weight bytes
//! read per second.
//!
//! `cargo run --release -p kiln-lm --example bench_skinny [-- M,M,...]` (default 1,8,20,32).
//! Prints one JSON line per `M` and kernel. Measures; asserts nothing.

use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use kiln_lm::skinny::{PackedMatrix, Part};
use rand::{Rng, SeedableRng};

const REPS: usize = 5;

fn main() {
    kiln_lm::malloc::keep_freed_memory();
    let ms: Vec<usize> = std::env::args()
        .nth(1)
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 8, 20, 32]);
    let (d, inter, vocab, layers) = (576usize, 1536usize, 49_152usize, 30usize);
    // [K, N] per matrix of one step, in the order a step runs them.
    let mut shapes = Vec::new();
    for _ in 0..layers {
        shapes.extend([(d, d + 2 * 192), (d, d), (d, 2 * inter), (inter, d)]);
    }
    shapes.push((d, vocab));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let weights: Vec<Vec<f32>> = shapes
        .iter()
        .map(|&(k, n)| {
            (0..k * n)
                .map(|_| rng.random_range(-0.05f32..0.05))
                .collect()
        })
        .collect();
    let bytes: usize = shapes.iter().map(|(k, n)| k * n * 4).sum();
    let threads = rayon::current_num_threads();
    let packed: Vec<PackedMatrix> = weights
        .iter()
        .zip(&shapes)
        .map(|(w, &(k, n))| PackedMatrix::pack(k, &[Part { w, n, bias: None }]))
        .collect();
    let device = Device::flex();
    let tensors: Vec<Tensor<2>> = weights
        .iter()
        .zip(&shapes)
        .map(|(w, &(k, n))| Tensor::from_data(TensorData::new(w.clone(), [k, n]), &device))
        .collect();
    drop(weights);
    for &m in &ms {
        let xs: Vec<Vec<f32>> = shapes
            .iter()
            .map(|&(k, _)| (0..m * k).map(|_| rng.random_range(-1.0f32..1.0)).collect())
            .collect();
        let best = |f: &dyn Fn()| {
            f();
            (0..REPS)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        let skinny = best(&|| {
            for (p, x) in packed.iter().zip(&xs) {
                std::hint::black_box(p.matmul(x));
            }
        });
        let xt: Vec<Tensor<2>> = xs
            .iter()
            .zip(&shapes)
            .map(|(x, &(k, _))| Tensor::from_data(TensorData::new(x.clone(), [m, k]), &device))
            .collect();
        let burn = best(&|| {
            for (w, x) in tensors.iter().zip(&xt) {
                let y = x.clone().matmul(w.clone());
                std::hint::black_box(y.into_data());
            }
        });
        for (kernel, s) in [("skinny", skinny), ("burn", burn)] {
            println!(
                "{{\"kernel\":\"{kernel}\",\"m\":{m},\"threads\":{threads},\"ms_per_step\":{:.2},\"weight_gb_per_s\":{:.1}}}",
                s * 1e3,
                bytes as f64 / s / 1e9
            );
        }
    }
}
