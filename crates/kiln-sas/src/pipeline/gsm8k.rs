//! The `sas_gsm8k` pipeline: train the text order policy over a frozen masked-diffusion LM with
//! GRPO and the self-aware reward ([`crate::text::TextSasTask`], run by the binary's
//! [`kiln_rl::Driver`]), then GSM8K pass@1 of every schedule with LLaDA-style decoding
//! ([`crate::gsm8k::llada_generate`]); `kiln eval` of such a run ([`eval_gsm8k`]). The LM is
//! kiln-lm's transformer behind [`crate::text_lm`].

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::Device;
use kiln_lm::TransformerConfig;
use kiln_rl::{Driver, PipelineError};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::gsm8k::{LladaDecodeConfig, answers_match, extract_answer, llada_generate, load_gsm8k};
use crate::schedule::Schedule;
use crate::text::{
    TextExample, TextOrderPolicy, TextPolicyConfig, TextSasSettings, TextSasTask, left_pad,
};
use crate::text_lm::{TextLm, load_text_lm, stats_forward};

type Result<T> = std::result::Result<T, PipelineError>;

// ---------------------------------------------------------------------------------------------
// sas_gsm8k

/// Training of the text order policy (section `train:` of a `sas_gsm8k` recipe).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct GsmTrainConfig {
    /// Train the order policy with GRPO and the self-aware reward before evaluating
    /// (`trainer.steps` steps); false = evaluate the heuristic schedules only.
    pub enabled: bool,
    /// GSM8K JSONL whose reference answers are the teacher-forcing targets.
    pub data: PathBuf,
    /// Use at most this many training problems (0 = all).
    pub limit: usize,
    /// Distinct problems per GRPO step.
    pub prompts_per_step: usize,
    /// Orders per problem (GRPO group size); one batched denoiser forward per step.
    pub group_size: usize,
    /// Token that pads a reference answer to `decode.gen_length` (LLaDA pads with its EOS).
    /// None = the model's `eos_token_id`, else `pad_token_id`, else 0.
    pub answer_pad_token: Option<u32>,
}

impl Default for GsmTrainConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            data: PathBuf::from("../shared/datasets/gsm8k/train.jsonl"),
            limit: 0,
            prompts_per_step: 2,
            group_size: 4,
            answer_pad_token: None,
        }
    }
}

/// The task-specific part of a `sas_gsm8k` recipe.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct GsmRecipe {
    /// The masked-diffusion LM to load: an HF folder (config.json + safetensors +
    /// tokenizer.json, e.g. a local copy of LLaDA-8B-Instruct), a `.gguf` file or a name in
    /// `.kiln/models.json`. Empty = the tiny randomly initialised byte-level preset `model`
    /// (a CPU smoke test of the pipeline; its pass@1 is ~0 by construction).
    pub model_path: String,
    /// The tiny preset (used when `model_path` is empty): vocab 256 bytes, mask id 255.
    pub model: TransformerConfig,
    /// GSM8K JSONL evaluated (`question`, `answer` ending in `#### N`).
    pub data: PathBuf,
    /// Problems evaluated (0 = all).
    pub limit: usize,
    /// Prompt template; `{question}` is replaced by the question.
    pub prompt: String,
    /// Longest prompt in tokens (longer prompts keep their last tokens).
    pub max_prompt_tokens: usize,
    /// LLaDA-style decoding protocol (logged with the result); its `gen_length` and
    /// `block_length` also shape the training rollouts.
    pub decode: LladaDecodeConfig,
    /// Schedules evaluated, one pass@1 row each (`learned` needs a trained policy); empty =
    /// `decode.schedule` only.
    pub eval_schedules: Vec<Schedule>,
    /// Problems decoded together.
    pub batch_size: usize,
    /// The text order policy (one transformer layer over per-position features).
    pub policy: TextPolicyConfig,
    /// GRPO training of the policy (self-aware reward, denoiser frozen).
    pub train: GsmTrainConfig,
}

impl Default for GsmRecipe {
    fn default() -> Self {
        Self {
            model_path: String::new(),
            model: TransformerConfig {
                model_type: "llada".into(),
                vocab_size: 256,
                hidden_size: 64,
                intermediate_size: 128,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                num_key_value_heads: Some(4),
                max_position_embeddings: 1024,
                causal: false,
                mask_token_id: Some(255),
                ..TransformerConfig::default()
            },
            data: PathBuf::from("../shared/datasets/gsm8k/test.jsonl"),
            limit: 8,
            prompt: "Question: {question}\nAnswer:".into(),
            max_prompt_tokens: 192,
            decode: LladaDecodeConfig {
                gen_length: 32,
                steps: 32,
                block_length: 16,
                schedule: Schedule::Confidence,
            },
            eval_schedules: Vec::new(),
            batch_size: 8,
            policy: TextPolicyConfig::default(),
            train: GsmTrainConfig::default(),
        }
    }
}

impl GsmRecipe {
    /// The schedules evaluated: `eval_schedules`, or `decode.schedule` alone when empty.
    pub fn schedules(&self) -> Vec<Schedule> {
        if self.eval_schedules.is_empty() {
            vec![self.decode.schedule]
        } else {
            self.eval_schedules.clone()
        }
    }
}

fn prompt_tokens(r: &GsmRecipe, lm: &TextLm, question: &str) -> Result<Vec<u32>> {
    let mut toks = lm.encode(&r.prompt.replace("{question}", question))?;
    if toks.len() > r.max_prompt_tokens {
        toks.drain(..toks.len() - r.max_prompt_tokens);
    }
    Ok(toks)
}

/// The LM of `r` (see [`load_text_lm`]).
fn text_lm(r: &GsmRecipe, device: &Device, run_dir: &Path, seed: u64) -> Result<TextLm> {
    load_text_lm(
        &r.model_path,
        &r.model,
        r.train.answer_pad_token,
        device,
        run_dir,
        seed,
    )
}

/// `sas_gsm8k`: train the text order policy through `driver` (when `train.enabled`), then GSM8K
/// pass@1 of every schedule of `eval_schedules`; writes `run_dir/eval/gsm8k.json` (protocol
/// included).
pub fn run_gsm8k(
    r: &GsmRecipe,
    device: &Device,
    seed: u64,
    run_dir: &Path,
    driver: &mut impl Driver,
) -> Result<()> {
    let lm = text_lm(r, device, run_dir, seed)?;
    let policy = if r.train.enabled {
        let mut problems = load_gsm8k(&r.train.data).map_err(PipelineError::msg)?;
        if r.train.limit > 0 {
            problems.truncate(r.train.limit);
        }
        let mut examples = Vec::with_capacity(problems.len());
        for p in &problems {
            let mut target = lm.encode(&p.answer)?;
            target.truncate(r.decode.gen_length);
            target.resize(r.decode.gen_length, lm.pad);
            examples.push(TextExample {
                prompt: prompt_tokens(r, &lm, &p.question)?,
                target,
            });
        }
        tracing::info!(
            "sas_gsm8k: training the text order policy on {} problems ({} x {} orders per step, gen_length {}, block_length {})",
            examples.len(),
            r.train.prompts_per_step,
            r.train.group_size,
            r.decode.gen_length,
            r.decode.block_length
        );
        let settings = TextSasSettings {
            prompts_per_step: r.train.prompts_per_step,
            group_size: r.train.group_size,
            block_length: r.decode.block_length,
            mask_id: lm.mask,
            pad_id: lm.pad,
            vocab: lm.vocab(),
            temperature: r.policy.temperature,
            seed,
        };
        let task = TextSasTask::new(
            Box::new(stats_forward(&lm.model, lm.mask, lm.pad)),
            examples,
            settings,
        );
        let ad = device.clone().autodiff();
        ad.seed(seed);
        let policy = r.policy.init(&ad);
        Some(driver.train(task, policy, ad)?.policy.valid())
    } else {
        None
    };
    gsm8k_eval(r, seed, &lm, policy.as_ref(), &r.data, run_dir)
}

fn load_text_policy(r: &GsmRecipe, ckpt: &Path, device: &Device) -> Result<TextOrderPolicy> {
    let ckpt = kiln_rl::checkpoint::CheckpointManager::resolve(ckpt)?;
    let mp = ckpt.join(kiln_rl::checkpoint::MODEL_FILE);
    r.policy.init(device).try_load_file(&mp).map_err(|e| {
        PipelineError(format!(
            "{}: cannot load the text order policy: {e}",
            mp.display()
        ))
    })
}

/// GSM8K pass@1 per schedule on `data`; prints the table and writes `run_dir/eval/gsm8k.json`.
fn gsm8k_eval(
    r: &GsmRecipe,
    seed: u64,
    lm: &TextLm,
    policy: Option<&TextOrderPolicy>,
    data: &Path,
    run_dir: &Path,
) -> Result<()> {
    let mut problems = load_gsm8k(data).map_err(PipelineError::msg)?;
    if r.limit > 0 {
        problems.truncate(r.limit);
    }
    let vocab = lm.vocab();
    let mut forward = stats_forward(&lm.model, lm.mask, lm.pad);
    let mut results = Vec::new();
    println!(
        "GSM8K {} ({} problems), LLaDA-style decoding: gen_length {}, steps {}, block_length {}, greedy tokens, model {}",
        data.display(),
        problems.len(),
        r.decode.gen_length,
        r.decode.steps,
        r.decode.block_length,
        if r.model_path.is_empty() {
            "tiny random-init preset (smoke test)"
        } else {
            &r.model_path
        }
    );
    println!("| schedule | pass@1 | correct | seconds |\n|---|---|---|---|");
    for schedule in r.schedules() {
        if schedule == Schedule::Learned && policy.is_none() {
            tracing::warn!("schedule `learned` skipped: no trained text order policy");
            continue;
        }
        let dc = LladaDecodeConfig {
            schedule,
            ..r.decode.clone()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let t = std::time::Instant::now();
        let mut rows = Vec::new();
        let mut correct = 0usize;
        for chunk in problems.chunks(r.batch_size) {
            let prompts: Vec<Vec<u32>> = chunk
                .iter()
                .map(|p| prompt_tokens(r, lm, &p.question))
                .collect::<Result<_>>()?;
            let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
            let prompts = left_pad(&refs, lm.pad);
            let outs = llada_generate(
                &mut forward,
                vocab,
                &prompts,
                &dc,
                lm.mask,
                policy,
                &mut rng,
            );
            for (p, o) in chunk.iter().zip(outs) {
                let text = lm.decode(&o);
                let pred = extract_answer(&text);
                let ok = answers_match(pred, p.gold);
                correct += ok as usize;
                rows.push(serde_json::json!({"gold": p.gold, "pred": pred, "correct": ok, "output": text}));
            }
        }
        let n = problems.len().max(1);
        let secs = t.elapsed().as_secs_f64();
        println!(
            "| {schedule} | {:.1}% | {correct}/{} | {secs:.1} |",
            100.0 * correct as f64 / n as f64,
            problems.len()
        );
        results.push(serde_json::json!({
            "schedule": schedule,
            "pass@1": correct as f64 / n as f64,
            "correct": correct,
            "seconds": secs,
            "rows": rows,
        }));
    }
    let out_dir = run_dir.join("eval");
    std::fs::create_dir_all(&out_dir)?;
    let path = out_dir.join("gsm8k.json");
    let json = serde_json::json!({
        "data": data,
        "problems": problems.len(),
        "protocol": {
            "decode": r.decode,
            "prompt": r.prompt,
            "max_prompt_tokens": r.max_prompt_tokens,
            "greedy_tokens": true,
            "model_path": r.model_path,
            "model": if r.model_path.is_empty() { serde_json::to_value(&r.model)? } else { serde_json::Value::Null },
            "policy": if policy.is_some() { serde_json::to_value(&r.policy)? } else { serde_json::Value::Null },
        },
        "results": results,
    });
    std::fs::write(&path, serde_json::to_vec_pretty(&json)?)?;
    println!("report: {}", path.display());
    Ok(())
}

/// `kiln eval CHECKPOINT --task gsm8k [--data PATH]` of a `sas_gsm8k` run: pass@1 of the run's
/// schedules (with the checkpoint's learned order policy) on `data` (default: the recipe's).
pub fn eval_gsm8k(
    r: &GsmRecipe,
    device: &Device,
    seed: u64,
    ckpt: &Path,
    run_dir: &Path,
    data: Option<&Path>,
) -> Result<()> {
    let lm = text_lm(r, device, run_dir, seed)?;
    let policy = load_text_policy(r, ckpt, device)?;
    let mut r = r.clone();
    if !r.schedules().contains(&Schedule::Learned) {
        let mut s = r.schedules();
        s.push(Schedule::Learned);
        r.eval_schedules = s;
    }
    gsm8k_eval(
        &r,
        seed,
        &lm,
        Some(&policy),
        data.unwrap_or(&r.data),
        run_dir,
    )
}
