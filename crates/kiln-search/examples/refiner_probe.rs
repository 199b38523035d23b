//! Probes the meta-refiner of a Search-R2 policy before GRPO (README: "Why the SmolLM2 refiner cuts
//! everything"). Two sets, both from held-out test questions (never trained on):
//!
//! - (a) labelled refiner prompts built exactly like the cold start's refiner demonstrations
//!   ([`build_examples`] over the test split): a gold trajectory (label 0), a wrong final answer (label T), a
//!   wrong search at step j < T (label j);
//! - (b) the policy's own trajectories, sampled as in a training rollout (the recipe's sampling and group
//!   size), split by whether their answer is right (EM).
//!
//! For each it prints P(accept) = p(0) / sum_j p(j), the share the decision rule revises at margin 0
//! (`logsumexp_{j>=1} log p(j) >= log p(0)`), for (a) whether the most likely cut is the labelled step, and
//! for (b) the AUC of P(accept) for telling right from wrong trajectories (0.5 = blind).
//!
//! With `TRAIN_STEPS > 0` the policy is first fine-tuned on refiner demonstrations only (built from
//! `TRAIN_QUESTIONS` training questions like the cold start's; the recipe's LoRA, batch size and lr;
//! adapters merged): can the refiner learn its judgement at all from this kind of data?
//!
//! `cargo run --release -p kiln-search --example refiner_probe -- RUN_DIR/recipe.yaml [N_LABELLED] [N_SAMPLED]
//! [TRAIN_STEPS] [TRAIN_QUESTIONS]` (a run's resolved `recipe.yaml`; the policy is its warm / cold start,
//! `init_dir`).

use burn::module::Module;
use burn::tensor::Device;
use kiln_search::agent::{LmActor, LmRefiner};
use kiln_search::pipeline::{self, SearchRecipe};
use kiln_search::protocol::Episode;
use kiln_search::refiner::{build_refiner_prompt, candidate_texts};
use kiln_search::refiner_start::auc;
use kiln_search::reward::{DeterministicJudge, score};
use kiln_search::rollout::run_episodes;
use kiln_search::task::{RefinerRequest, RefinerScorer};
use kiln_search::warmstart::{WarmStartConfig, build_examples, supervised};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// P(accept), revise at margin 0, and the most likely cut (1-based) of one score vector `lp[0..=T]`.
fn summarise(lp: &[f64]) -> (f64, bool, usize) {
    let m = lp.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = lp.iter().map(|x| (x - m).exp()).sum();
    let p0 = (lp[0] - m).exp() / z;
    let cut_mass: f64 = lp[1..].iter().map(|x| (x - m).exp()).sum();
    let revise = cut_mass.ln() + m >= lp[0];
    let best = (1..lp.len())
        .max_by(|&a, &b| lp[a].total_cmp(&lp[b]))
        .unwrap_or(0);
    (p0, revise, best)
}

#[derive(Default)]
struct Class {
    n: usize,
    p_accept: f64,
    revised: usize,
    cut_right: usize,
}

impl Class {
    fn add(&mut self, lp: &[f64], label: Option<usize>) {
        let (p0, revise, best) = summarise(lp);
        self.n += 1;
        self.p_accept += p0;
        self.revised += usize::from(revise);
        if label == Some(best) {
            self.cut_right += 1;
        }
    }
    fn row(&self, name: &str, with_cut: bool) -> String {
        let n = self.n.max(1) as f64;
        let cut = if with_cut {
            format!("{:.2}", self.cut_right as f64 / n)
        } else {
            "-".into()
        };
        format!(
            "| {name} | {} | {:.3} | {:.2} | {cut} |",
            self.n,
            self.p_accept / n,
            self.revised as f64 / n
        )
    }
}

/// Fine-tunes `model` on refiner demonstrations only (see the module docs); returns the merged model.
#[allow(clippy::too_many_arguments)]
fn refiner_sft(
    r: &SearchRecipe,
    world: &kiln_search::synthetic::World,
    env: &pipeline::Env,
    model: kiln_lm::Transformer,
    tok: &kiln_lm::Tokenizer,
    templates: &kiln_search::protocol::PromptTemplates,
    steps: usize,
    questions: usize,
) -> Result<kiln_lm::Transformer, Box<dyn std::error::Error>> {
    let cfg = WarmStartConfig {
        max_questions: questions,
        refiner_ratio: 1.0,
        baseline_ratio: 0.0,
        rename_copies: 0,
        steps,
        ..r.warm_start.clone()
    };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (examples, _) = build_examples(
        world,
        &cfg,
        tok,
        templates,
        &r.search.batch.protocol,
        &env.search,
        &mut rng,
    )?;
    let examples: Vec<_> = examples
        .into_iter()
        .filter(|e| e.role == "refiner")
        .collect();
    let mut m = model;
    if let Some(l) = &r.lora {
        m = m.with_lora(l);
    }
    let t0 = std::time::Instant::now();
    let (m, losses) = supervised(m, &examples, &cfg, &mut rng, |step, loss| {
        if step % 10 == 0 {
            eprintln!(
                "refiner SFT step {step}/{steps}: loss {loss:.4} ({:.0} s)",
                t0.elapsed().as_secs_f64()
            );
        }
    })?;
    let k = (losses.len() / 10).max(1);
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len().max(1) as f64;
    println!(
        "refiner-only SFT: {} demonstrations, {steps} steps x {}, loss {:.3} -> {:.3}, {:.0} s",
        examples.len(),
        cfg.batch_size,
        mean(&losses[..k]),
        mean(&losses[losses.len() - k..]),
        t0.elapsed().as_secs_f64()
    );
    let m = if m.has_lora() { m.merge_lora() } else { m };
    Ok(m.valid())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    kiln_lm::malloc::keep_freed_memory();
    let mut args = std::env::args().skip(1);
    let recipe = args
        .next()
        .ok_or("usage: refiner_probe RUN_DIR/recipe.yaml [N_LABELLED] [N_SAMPLED]")?;
    let n_labelled: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(120);
    let n_sampled: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(8);
    let train_steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(0);
    let train_questions: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(300);
    let r: SearchRecipe = serde_norway::from_str(&std::fs::read_to_string(&recipe)?)?;
    let device = Device::default();
    let env = pipeline::env(&r)?;
    let world = env
        .world
        .clone()
        .ok_or("the probe needs the synthetic world (train_data: synthetic)")?;
    // On an autodiff device when the refiner is fine-tuned first.
    let load_on = if train_steps > 0 {
        device.clone().autodiff()
    } else {
        device.clone()
    };
    let (model, tok) = pipeline::start_policy(&r, &load_on)?;
    let templates = pipeline::templates(&r, &tok);
    let protocol = r.search.batch.protocol.clone();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let model = if train_steps > 0 {
        refiner_sft(
            &r,
            &world,
            &env,
            model,
            &tok,
            &templates,
            train_steps,
            train_questions,
        )?
    } else {
        model
    };

    // (a) Labelled refiner prompts over the test split.
    let mut test_world = world.clone();
    test_world.train = world.test.clone();
    let cfg = WarmStartConfig {
        max_questions: n_labelled,
        refiner_ratio: 1.0,
        baseline_ratio: 0.0,
        rename_copies: 0,
        ..r.warm_start.clone()
    };
    let (examples, _) = build_examples(
        &test_world,
        &cfg,
        &tok,
        &templates,
        &protocol,
        &env.search,
        &mut rng,
    )?;
    let mut classes = [Class::default(), Class::default(), Class::default()];
    let t0 = std::time::Instant::now();
    let refiner_rows: Vec<_> = examples.iter().filter(|e| e.role == "refiner").collect();
    let mut labelled = Vec::new();
    for e in &refiner_rows {
        let at = e.mask.iter().position(|&m| m > 0.0).unwrap_or(e.ids.len());
        let prompt = tok.decode(&e.ids[..at], true)?;
        let label: usize = tok.decode(&e.ids[at..], true)?.trim().parse()?;
        let t = prompt.matches("ASSISTANT_STEP_").count();
        labelled.push((prompt, candidate_texts(t), label, t));
    }
    let reqs: Vec<RefinerRequest<'_>> = labelled
        .iter()
        .enumerate()
        .map(|(index, (p, c, _, _))| RefinerRequest {
            index,
            prompt: p,
            candidates: c,
        })
        .collect();
    let mut scorer = LmRefiner {
        model: &model,
        tokenizer: &tok,
        max_batch: 8,
    };
    let scores = scorer.score(&reqs)?;
    for (v, (_, _, label, t)) in scores.iter().zip(&labelled) {
        let k = if *label == 0 {
            0
        } else if label == t {
            1
        } else {
            2
        };
        classes[k].add(v, (*label > 0).then_some(*label));
    }
    println!(
        "\n(a) labelled refiner prompts from {} held-out questions ({:.0} s)\n",
        n_labelled,
        t0.elapsed().as_secs_f64()
    );
    println!("| label | n | mean P(accept) | revised at margin 0 | most likely cut = label |");
    println!("|---|---:|---:|---:|---:|");
    println!("{}", classes[0].row("gold trajectory (0)", false));
    println!("{}", classes[1].row("wrong final answer (T)", true));
    println!("{}", classes[2].row("wrong search at j < T (j)", true));

    // (b) The policy's own sampled trajectories.
    let g = r.search.batch.group_size;
    let mut eps = Vec::new();
    let qs = &env.test[..n_sampled.min(env.test.len())];
    for q in qs {
        for _ in 0..g {
            eps.push(Episode::for_question(
                &templates.agent,
                &q.question,
                protocol.clone(),
            )?);
        }
    }
    let t0 = std::time::Instant::now();
    let mut actor_rng = ChaCha8Rng::seed_from_u64(11);
    let mut actor = LmActor::new(&model, &tok, r.search.sampling.clone(), &mut actor_rng);
    actor.max_batch = r.search.max_batch;
    run_episodes(
        &mut eps,
        &mut actor,
        &env.search,
        r.search.batch.on_search_error,
    )?;
    let mut judge = DeterministicJudge::default();
    let mut em = Vec::new();
    let mut prompts = Vec::new();
    for (i, ep) in eps.iter().enumerate() {
        let q = &qs[i / g];
        let rw = score(
            &ep.trajectory,
            &q.question,
            &q.gold(),
            &r.search.batch.reward,
            &mut judge,
        )?;
        em.push(rw.em > 0.0);
        prompts.push((
            build_refiner_prompt(&q.question, &ep.trajectory),
            candidate_texts(ep.trajectory.steps.len()),
        ));
    }
    let reqs: Vec<RefinerRequest<'_>> = prompts
        .iter()
        .enumerate()
        .map(|(index, (p, c))| RefinerRequest {
            index,
            prompt: p,
            candidates: c,
        })
        .collect();
    let scores = scorer.score(&reqs)?;
    let (mut right, mut wrong) = (Class::default(), Class::default());
    let (mut pr, mut pw) = (Vec::new(), Vec::new());
    for (lp, ok) in scores.iter().zip(&em) {
        if lp.len() < 2 {
            continue;
        }
        let (p0, _, _) = summarise(lp);
        if *ok {
            right.add(lp, None);
            pr.push(p0);
        } else {
            wrong.add(lp, None);
            pw.push(p0);
        }
    }
    println!(
        "\n(b) the policy's own trajectories: {} questions x G = {g}, sampled with {:?} ({:.0} s)\n",
        qs.len(),
        r.search.sampling,
        t0.elapsed().as_secs_f64()
    );
    println!("| trajectory | n | mean P(accept) | revised at margin 0 | - |");
    println!("|---|---:|---:|---:|---:|");
    println!("{}", right.row("answer right (EM 1)", false));
    println!("{}", wrong.row("answer wrong (EM 0)", false));
    println!(
        "\nAUC of P(accept), right vs wrong: {:.3} (0.5 = blind)",
        auc(&pr, &pw)
    );
    if let Some(ep) = eps.first() {
        println!(
            "\nfirst sampled refiner prompt:\n{}\n",
            build_refiner_prompt(&qs[0].question, &ep.trajectory)
        );
    }
    Ok(())
}
