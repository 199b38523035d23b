//! LoRA against peft (PyTorch): the tiny random Llama of the parity fixtures with adapters on all
//! seven projections (r = 4, alpha = 8), factors set from `lora_init.safetensors`; the loss,
//! logits, the gradient of every factor and the factors and logits after two AdamW steps match
//! `lora_expected.json` (made once by `scripts/lm/make_lora_fixture.py` with peft). Also: freshly
//! attached adapters (B = 0) give exactly the base logits, only the factors train (the base
//! weights are bit-identical after the steps), `without_lora` is the base model and `merge_lora`
//! folds the adapters into the weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln_lm::lora::{LoraAdapter, LoraConfig};
use kiln_lm::{Transformer, load_hf_dir};
use serde::Deserialize;

#[derive(Deserialize)]
struct Expected {
    rank: usize,
    alpha: f64,
    lr: f64,
    input_ids: Vec<Vec<i64>>,
    loss0: f64,
    logits0: Vec<f32>,
    grads0: BTreeMap<String, Vec<f32>>,
    after1: BTreeMap<String, Vec<f32>>,
    loss1: f64,
    after2: BTreeMap<String, Vec<f32>>,
    logits2: Vec<f32>,
}

/// Every projection LoRA can adapt (the fixture adapts all of them).
const MODULES: [&str; 7] = kiln_lm::lora::TARGETS;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama")
}

fn expected() -> Expected {
    let text = std::fs::read_to_string(dir().join("lora_expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The adapter of `module` in layer `i`.
fn slot<'a>(m: &'a mut Transformer, i: usize, module: &str) -> &'a mut Option<LoraAdapter> {
    let l = &mut m.layers[i];
    match module {
        "q_proj" => &mut l.self_attn.q_lora,
        "k_proj" => &mut l.self_attn.k_lora,
        "v_proj" => &mut l.self_attn.v_lora,
        "o_proj" => &mut l.self_attn.o_lora,
        "gate_proj" => &mut l.mlp.gate_lora,
        "up_proj" => &mut l.mlp.up_lora,
        "down_proj" => &mut l.mlp.down_lora,
        _ => unreachable!(),
    }
}

fn get<'a>(m: &'a Transformer, i: usize, module: &str) -> &'a LoraAdapter {
    let l = &m.layers[i];
    let a = match module {
        "q_proj" => &l.self_attn.q_lora,
        "k_proj" => &l.self_attn.k_lora,
        "v_proj" => &l.self_attn.v_lora,
        "o_proj" => &l.self_attn.o_lora,
        "gate_proj" => &l.mlp.gate_lora,
        "up_proj" => &l.mlp.up_lora,
        "down_proj" => &l.mlp.down_lora,
        _ => unreachable!(),
    };
    a.as_ref().expect("adapter attached")
}

/// Sets every factor from `lora_init.safetensors` (kiln layout: `a` [d_in, r], `b` [r, d_out]).
fn load_factors(m: &mut Transformer, cfg: &LoraConfig, device: &Device) {
    let bytes = std::fs::read(dir().join("lora_init.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let read = |name: &str| {
        let v = st.tensor(name).unwrap();
        let shape = [v.shape()[0], v.shape()[1]];
        let data: Vec<f32> = v
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Tensor::<2>::from_data(TensorData::new(data, shape), device)
    };
    for i in 0..m.layers.len() {
        for module in MODULES {
            let a = read(&format!("layers.{i}.{module}.a"));
            let b = read(&format!("layers.{i}.{module}.b"));
            *slot(m, i, module) = Some(LoraAdapter::from_factors(a, b, cfg));
        }
    }
}

/// Mean next-token cross-entropy of `ids` and the logits `[B, T, V]`.
fn loss_of(m: &Transformer, ids: &[Vec<i64>], device: &Device) -> (Tensor<1>, Tensor<3>) {
    let (b, t) = (ids.len(), ids[0].len());
    let flat: Vec<i64> = ids.iter().flatten().copied().collect();
    let toks = Tensor::<2, Int>::from_data(TensorData::new(flat, [b, t]), device);
    let logits = m.forward(toks.clone());
    let v = logits.dims()[2];
    let lp = log_softmax(logits.clone().slice([0..b, 0..t - 1, 0..v]), 2);
    let tgt = toks.slice([0..b, 1..t]).reshape([b, t - 1, 1]);
    let nll = lp.gather(2, tgt).neg();
    (nll.mean(), logits)
}

fn config(e: &Expected) -> LoraConfig {
    LoraConfig {
        rank: e.rank,
        alpha: e.alpha,
        ..LoraConfig::default()
    }
}

#[test]
fn fresh_adapters_give_exactly_the_base_logits_and_merge_and_unload() {
    let device = Device::flex();
    device.seed(3);
    let base = load_hf_dir(dir(), &device).unwrap();
    let e = expected();
    let ids = &e.input_ids;
    let (_, base_logits) = loss_of(&base, ids, &device);
    let base_logits = host(base_logits);
    let cfg = config(&e);
    let adapted = base.clone().with_lora(&cfg);
    assert!(adapted.has_lora());
    // 7 projections x 2 layers: A [d_in, 4] + B [4, d_out].
    let per_layer = 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64));
    assert_eq!(adapted.lora_parameter_count(), 2 * per_layer);
    let (_, l) = loss_of(&adapted, ids, &device);
    assert_eq!(host(l), base_logits, "B = 0 must add exact zeros");

    // With the fixture's factors: merged == adapted, and without_lora == base.
    let mut m = adapted;
    load_factors(&mut m, &cfg, &device);
    let (_, adapted_logits) = loss_of(&m, ids, &device);
    let adapted_logits = host(adapted_logits);
    assert!(max_diff(&adapted_logits, &e.logits0) < 1e-4);
    let merged = m.merge_lora();
    assert!(!merged.has_lora());
    let (_, ml) = loss_of(&merged, ids, &device);
    let d = max_diff(&host(ml), &adapted_logits);
    assert!(d < 1e-5, "merged vs adapted logits: {d}");
    let (_, ul) = loss_of(&m.without_lora(), ids, &device);
    assert_eq!(host(ul), base_logits);
    // An HF folder written from the adapted model holds the merged weights.
    let out = tempfile::tempdir().unwrap();
    kiln_lm::save_hf_dir(&m, out.path()).unwrap();
    let (_, sl) = loss_of(&load_hf_dir(out.path(), &device).unwrap(), ids, &device);
    let d = max_diff(&host(sl), &adapted_logits);
    assert!(d < 1e-5, "saved (merged) vs adapted logits: {d}");
    // Only the listed projections are adapted.
    let only_q = base.with_lora(&LoraConfig {
        target_modules: vec!["q_proj".into()],
        ..cfg
    });
    assert!(only_q.layers.iter().all(|l| l.self_attn.q_lora.is_some()
        && l.self_attn.k_lora.is_none()
        && l.mlp.down_lora.is_none()));
}

#[test]
fn loss_gradients_and_two_adamw_steps_match_peft() {
    let device = Device::flex().autodiff();
    let e = expected();
    let cfg = config(&e);
    let mut m = load_hf_dir(dir(), &device).unwrap().with_lora(&cfg);
    load_factors(&mut m, &cfg, &device);
    let base_before = host(m.layers[0].self_attn.q_proj.weight.val());
    let embed_before = host(m.embed_tokens.weight.val());

    let (loss, logits) = loss_of(&m, &e.input_ids, &device);
    let l0 = host(loss.clone())[0] as f64;
    assert!((l0 - e.loss0).abs() < 1e-5, "loss {l0} vs peft {}", e.loss0);
    let d = max_diff(&host(logits), &e.logits0);
    assert!(d < 1e-4, "logits vs peft: {d}");

    let grads = loss.backward();
    let mut worst = 0f32;
    for i in 0..m.layers.len() {
        for module in MODULES {
            let ad = get(&m, i, module);
            for (p, key) in [(&ad.a, "a"), (&ad.b, "b")] {
                let g = p.val().grad(&grads).expect("factor has a gradient");
                let want = &e.grads0[&format!("layers.{i}.{module}.{key}")];
                worst = worst.max(max_diff(&host(g), want));
            }
        }
    }
    assert!(
        worst < 1e-4,
        "factor gradients vs peft: max |diff| = {worst}"
    );
    assert!(
        m.layers[0]
            .self_attn
            .q_proj
            .weight
            .val()
            .grad(&grads)
            .is_none(),
        "the frozen base weight has no gradient"
    );

    let mut optim = AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.999)
        .with_epsilon(1e-8)
        .with_weight_decay(0.0)
        .init();
    let gp = GradientsParams::from_grads(grads, &m);
    m = optim.step(e.lr, m, gp);
    let check = |m: &Transformer, want: &BTreeMap<String, Vec<f32>>, what: &str| {
        let mut worst = 0f32;
        for i in 0..m.layers.len() {
            for module in MODULES {
                let ad = get(m, i, module);
                for (p, key) in [(&ad.a, "a"), (&ad.b, "b")] {
                    let w = &want[&format!("layers.{i}.{module}.{key}")];
                    worst = worst.max(max_diff(&host(p.val()), w));
                }
            }
        }
        assert!(worst < 1e-4, "factors {what} vs peft: max |diff| = {worst}");
    };
    check(&m, &e.after1, "after step 1");
    let (loss, _) = loss_of(&m, &e.input_ids, &device);
    let l1 = host(loss.clone())[0] as f64;
    assert!(
        (l1 - e.loss1).abs() < 1e-4,
        "loss after step 1 {l1} vs peft {}",
        e.loss1
    );
    let gp = GradientsParams::from_grads(loss.backward(), &m);
    m = optim.step(e.lr, m, gp);
    check(&m, &e.after2, "after step 2");
    let (_, logits) = loss_of(&m, &e.input_ids, &device);
    let d = max_diff(&host(logits), &e.logits2);
    assert!(d < 1e-4, "logits after two steps vs peft: {d}");
    // Only the factors trained.
    assert_eq!(host(m.layers[0].self_attn.q_proj.weight.val()), base_before);
    assert_eq!(host(m.embed_tokens.weight.val()), embed_before);
}
