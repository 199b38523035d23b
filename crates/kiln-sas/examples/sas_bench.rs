//! Measures the Sudoku denoiser: forward passes per second (inference, batch sizes 1/64) and
//! masked-diffusion training steps per second, and (with a trained policy task) the SAS training
//! step time with the share spent in denoiser forwards.
//!
//! `cargo run --release -p kiln-sas --example sas_bench -- [WIDTH] [LAYERS] [BATCH]`
//! (defaults 128 3 64). It measures; it asserts nothing.

use std::time::Instant;

use burn::tensor::Device;
use kiln_sas::denoiser::{DenoiserConfig, PretrainConfig, digit_log_probs, pretrain};
use kiln_sas::sudoku::PuzzleSetConfig;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let width: usize = args.first().map_or(Ok(128), |s| s.parse())?;
    let layers: usize = args.get(1).map_or(Ok(3), |s| s.parse())?;
    let batch: usize = args.get(2).map_or(Ok(64), |s| s.parse())?;
    let cfg = DenoiserConfig {
        d_model: width,
        d_ff: 4 * width,
        n_layers: layers,
        n_heads: (width / 32).max(1),
        ..Default::default()
    };
    let device = Device::flex();
    let model = cfg.init(&device);
    use burn::module::Module;
    println!(
        "denoiser width {width} layers {layers}: {} parameters",
        model.num_params()
    );
    for b in [1usize, 8, 16, 32, 64, 128] {
        let toks = vec![0u32; b * 81];
        let _ = digit_log_probs(&model, &toks, b, 81);
        let t = Instant::now();
        let mut n = 0;
        while t.elapsed().as_secs_f64() < 2.0 {
            let _ = digit_log_probs(&model, &toks, b, 81);
            n += 1;
        }
        let dt = t.elapsed().as_secs_f64();
        println!(
            "forward batch {b:>3}: {:.1} calls/s = {:.0} board-forwards/s",
            n as f64 / dt,
            (n * b) as f64 / dt
        );
    }
    let dir = tempfile_dir();
    let pcfg = PretrainConfig {
        steps: 10,
        batch_size: batch,
        log_every: 0,
        save_every: 0,
        data: PuzzleSetConfig {
            count: 200,
            givens: vec![30],
            ..Default::default()
        },
        ..Default::default()
    };
    let puzzles = pcfg.data.load()?;
    let mut sink = |_s: u64, _m: &[(&str, f64)]| {};
    let (_, s) = pretrain(&cfg, &pcfg, &puzzles, &device, 0, &dir, &mut sink)?;
    println!(
        "pre-training batch {batch}: {:.3} steps/s ({:.2} s/step)",
        s.steps_per_s,
        1.0 / s.steps_per_s
    );
    // SAS training steps (GRPO over the frozen denoiser): step time and the denoiser's share.
    use kiln_sas::policy::{OrderPolicy, PolicyConfig};
    use kiln_sas::task::{SasConfig, SasTask};
    let sas = SasConfig::default();
    let train = PuzzleSetConfig {
        count: 64,
        givens: vec![36],
        ..Default::default()
    }
    .load()?;
    let denoiser = cfg.init(&device);
    let task = SasTask::new(
        denoiser,
        sas.clone(),
        PolicyConfig::default(),
        train.clone(),
        Vec::new(),
        0,
    );
    let ad = device.clone().autodiff();
    let policy = OrderPolicy::init(&PolicyConfig::default(), kiln_sas::sudoku::Shape::NINE, &ad);
    let opts = kiln_rl::TrainerOptions {
        trainer: kiln_rl::TrainerConfig {
            steps: 3,
            checkpoint_every: 0,
            mini_batch_size: 32,
            ..Default::default()
        },
        algorithm: kiln_rl::LossConfig {
            kl_beta: 0.0,
            ..Default::default()
        },
        optim: kiln_rl::OptimConfig {
            lr: 1e-3,
            ..Default::default()
        },
        run_dir: dir.clone(),
        seed: 0,
        progress: None,
    };
    let mut trainer = kiln_rl::Trainer::new(task, policy, ad, opts, Box::new(kiln_rl::NullSink));
    for _ in 0..3 {
        let m = trainer.train_step()?;
        let step = m["time/step_s"];
        let den = m["time/denoiser_s"];
        println!(
            "SAS step ({} puzzles x G={}, 45 blanks): {step:.2} s, denoiser forwards {den:.2} s ({:.0}%)",
            sas.puzzles_per_step,
            sas.group_size,
            100.0 * den / step
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn tempfile_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("kiln-sas-bench-{}", std::process::id()))
}
