//! Pre-trains the Sudoku denoiser without the `kiln` binary (same library call as
//! `kiln train recipes/mdm_sudoku.yaml`, default recipe values unless overridden).
//!
//! `cargo run --release -p kiln-sas --example mdm_pretrain -- OUT_DIR [STEPS] [BATCH] [LR]`

use std::path::PathBuf;

use burn::tensor::Device;
use kiln_sas::denoiser::{DenoiserConfig, PretrainConfig, pretrain};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber_init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let out = PathBuf::from(
        args.first()
            .ok_or("usage: mdm_pretrain OUT_DIR [STEPS] [BATCH] [LR]")?,
    );
    let mut cfg = PretrainConfig::default();
    if let Some(s) = args.get(1) {
        cfg.steps = s.parse()?;
    }
    if let Some(s) = args.get(2) {
        cfg.batch_size = s.parse()?;
    }
    if let Some(s) = args.get(3) {
        cfg.lr = s.parse()?;
    }
    let model = DenoiserConfig::default();
    let puzzles = cfg.data.load()?;
    let device = Device::flex();
    let mut sink = |step: u64, m: &[(&str, f64)]| {
        let line: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v:.4}")).collect();
        println!("step {step}: {}", line.join(", "));
    };
    let (_, s) = pretrain(&model, &cfg, &puzzles, &device, 0, &out, &mut sink)?;
    println!("{}", serde_json::to_string(&s)?);
    Ok(())
}

fn tracing_subscriber_init() {}
