//! Parity with HF transformers (PyTorch, float32) on tiny random Llama / Qwen2 / LLaDA-style
//! models. The fixtures were produced once by `scripts/lm/make_fixtures.py`; CI only reads them.

use std::path::{Path, PathBuf};

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use kiln_lm::weights::{SafetensorsSource, WeightsError, load_transformer};
use kiln_lm::{SamplingConfig, TransformerConfig, generate, load_hf_dir, save_hf_dir};
use rand::SeedableRng;
use serde::Deserialize;

#[derive(Deserialize)]
struct Padded {
    input_ids: Vec<Vec<i64>>,
    attention_mask: Vec<Vec<i64>>,
    logits: Vec<f32>,
}

#[derive(Deserialize)]
struct Greedy {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
}

#[derive(Deserialize)]
struct Llada {
    prompt: Vec<u32>,
    steps: usize,
    gen_length: usize,
    block_length: usize,
    tokens: Vec<u32>,
}

#[derive(Deserialize)]
struct Expected {
    input_ids: Vec<Vec<i64>>,
    logits_shape: [usize; 3],
    logits: Vec<f32>,
    padded: Padded,
    greedy: Option<Vec<Greedy>>,
    llada: Option<Vec<Llada>>,
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn expected(name: &str) -> Expected {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(device: &Device, rows: &[Vec<i64>]) -> Tensor<2, Int> {
    let t = rows[0].len();
    let flat: Vec<i64> = rows.iter().flatten().copied().collect();
    Tensor::from_data(TensorData::new(flat, [rows.len(), t]), device)
}

fn to_vec(x: Tensor<3>) -> Vec<f32> {
    x.into_data().try_into_vec_as::<f32>().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_logits(name: &str) {
    let device = Device::flex();
    let model = load_hf_dir(fixture(name), &device).unwrap();
    let exp = expected(name);
    let logits = model.forward(ids(&device, &exp.input_ids));
    assert_eq!(logits.dims(), exp.logits_shape);
    let d = max_diff(&to_vec(logits), &exp.logits);
    assert!(d < 1e-4, "{name}: max |logit diff| {d}");

    // Left-padded batch: compare real positions only.
    let p = &exp.padded;
    let mask: Vec<bool> = p.attention_mask.iter().flatten().map(|&m| m != 0).collect();
    let [b, t] = [p.input_ids.len(), p.input_ids[0].len()];
    let m = Tensor::<2, Bool>::from_data(TensorData::new(mask.clone(), [b, t]), &device);
    let got = to_vec(model.forward_masked(ids(&device, &p.input_ids), m));
    let v = exp.logits_shape[2];
    let mut worst = 0.0f32;
    for (pos, real) in mask.iter().enumerate() {
        if *real {
            let r = pos * v..(pos + 1) * v;
            worst = worst.max(max_diff(&got[r.clone()], &p.logits[r]));
        }
    }
    assert!(worst < 1e-4, "{name} (padded): max |logit diff| {worst}");
}

fn check_greedy(name: &str) {
    let device = Device::flex();
    let model = load_hf_dir(fixture(name), &device).unwrap();
    let exp = expected(name);
    let greedy = exp.greedy.expect("causal fixture has greedy continuations");
    let cfg = SamplingConfig::greedy(20);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    for g in &greedy {
        let out = generate(
            &model,
            std::slice::from_ref(&g.prompt),
            &cfg,
            &mut rng,
            None,
        );
        assert_eq!(out.tokens[0], g.tokens, "{name}: prompt {:?}", g.prompt);
    }
    // The same prompts in one left-padded batch.
    let prompts: Vec<Vec<u32>> = greedy.iter().map(|g| g.prompt.clone()).collect();
    let out = generate(&model, &prompts, &cfg, &mut rng, None);
    for (g, toks) in greedy.iter().zip(&out.tokens) {
        assert_eq!(toks, &g.tokens, "{name} batched: prompt {:?}", g.prompt);
    }
}

#[test]
fn llama_logits_match_transformers() {
    check_logits("tiny-llama");
}

#[test]
fn qwen2_bf16_sharded_logits_match_transformers() {
    check_logits("tiny-qwen2");
}

#[test]
fn llada_bidirectional_f16_logits_match_transformers() {
    check_logits("tiny-llada");
}

#[test]
fn llama_greedy_matches_transformers() {
    check_greedy("tiny-llama");
}

#[test]
fn qwen2_greedy_matches_transformers() {
    check_greedy("tiny-qwen2");
}

#[test]
fn export_roundtrip_keeps_logits() {
    let device = Device::flex();
    for name in ["tiny-llama", "tiny-qwen2", "tiny-llada"] {
        let model = load_hf_dir(fixture(name), &device).unwrap();
        let dir = tempfile::tempdir().unwrap();
        save_hf_dir(&model, dir.path()).unwrap();
        let back = load_hf_dir(dir.path(), &device).unwrap();
        assert_eq!(
            back.config().to_hf_config_json(),
            model.config().to_hf_config_json(),
            "{name}"
        );
        let exp = expected(name);
        let a = to_vec(model.forward(ids(&device, &exp.input_ids)));
        let b = to_vec(back.forward(ids(&device, &exp.input_ids)));
        assert_eq!(a, b, "{name}");
    }
}

fn copy_fixture(name: &str, dst: &Path) {
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
}

#[test]
fn truncated_safetensors_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    copy_fixture("tiny-llama", dir.path());
    let f = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    for cut in [4usize, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&f, &bytes[..cut]).unwrap();
        let err = load_hf_dir(dir.path(), &Device::flex()).unwrap_err();
        assert!(
            matches!(err, WeightsError::Safetensors { .. }),
            "cut {cut}: {err}"
        );
        assert!(err.to_string().contains("truncated"), "{err}");
    }
}

#[test]
fn mismatched_config_is_a_clear_error() {
    let device = Device::flex();
    let src = SafetensorsSource::open_dir(&fixture("tiny-llama")).unwrap();
    let text = std::fs::read_to_string(fixture("tiny-llama").join("config.json")).unwrap();
    let mut cfg = TransformerConfig::from_hf_config_json(&text).unwrap();
    cfg.intermediate_size = 96;
    let err = load_transformer(&cfg, &src, &device).unwrap_err();
    assert!(matches!(err, WeightsError::Shape { .. }), "{err}");
    assert!(err.to_string().contains("[96, 64]"), "{err}");

    let mut cfg = TransformerConfig::from_hf_config_json(&text).unwrap();
    cfg.num_hidden_layers = 3;
    let err = load_transformer(&cfg, &src, &device).unwrap_err();
    assert!(err.to_string().contains("model.layers.2."), "{err}");

    let mut cfg = TransformerConfig::from_hf_config_json(&text).unwrap();
    cfg.tie_word_embeddings = false;
    let err = load_transformer(&cfg, &src, &device).unwrap_err();
    assert!(err.to_string().contains("lm_head.weight"), "{err}");
}

#[test]
fn missing_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let err = load_hf_dir(dir.path(), &Device::flex()).unwrap_err();
    assert!(err.to_string().contains("config.json"), "{err}");
    std::fs::copy(
        fixture("tiny-llama").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let err = load_hf_dir(dir.path(), &Device::flex()).unwrap_err();
    assert!(matches!(err, WeightsError::NoWeights(_)), "{err}");
    // A shard listed in the index but absent.
    let dir = tempfile::tempdir().unwrap();
    copy_fixture("tiny-qwen2", dir.path());
    std::fs::remove_file(dir.path().join("model-00002-of-00004.safetensors")).unwrap();
    let err = load_hf_dir(dir.path(), &Device::flex()).unwrap_err();
    assert!(err.to_string().contains("model-00002-of-00004"), "{err}");
}

/// Writes the tiny fixtures re-exported by kiln to `$KILN_EXPORT_DIR/<name>` so that
/// `scripts/lm/check_export.py` can open them with transformers (manual check; needs torch).
#[test]
#[ignore]
fn export_for_transformers_check() {
    let out = std::env::var("KILN_EXPORT_DIR").expect("set KILN_EXPORT_DIR");
    let device = Device::flex();
    for name in ["tiny-llama", "tiny-qwen2"] {
        let model = load_hf_dir(fixture(name), &device).unwrap();
        save_hf_dir(&model, Path::new(&out).join(name)).unwrap();
    }
}

#[test]
fn llada_low_confidence_decoding_matches_reference() {
    use kiln_lm::diffusion::{DiffusionConfig, Remasking, llada_generate};
    let device = Device::flex();
    let model = load_hf_dir(fixture("tiny-llada"), &device).unwrap();
    assert!(!model.config().causal);
    let exp = expected("tiny-llada");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    for case in exp.llada.expect("llada cases") {
        let cfg = DiffusionConfig {
            gen_length: case.gen_length,
            steps: case.steps,
            block_length: case.block_length,
            temperature: 0.0,
            remasking: Remasking::LowConfidence,
        };
        let out =
            llada_generate(&model, std::slice::from_ref(&case.prompt), &cfg, &mut rng).unwrap();
        assert_eq!(
            out[0], case.tokens,
            "steps {} block {}",
            case.steps, case.block_length
        );
    }
}

#[test]
fn cli_export_writes_a_loadable_hf_folder() {
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("hf");
    kiln_lm::cli::run_export(kiln_lm::cli::ExportArgs {
        checkpoint: fixture("tiny-qwen2"),
        hf: dst.clone(),
    })
    .unwrap();
    let back = load_hf_dir(&dst, &Device::flex()).unwrap();
    assert!(back.config().attention_bias);
    let err = kiln_lm::cli::run_export(kiln_lm::cli::ExportArgs {
        checkpoint: out.path().join("missing.bin"),
        hf: dst,
    })
    .unwrap_err();
    assert!(err.to_string().contains("expected a checkpoint"), "{err}");
}
