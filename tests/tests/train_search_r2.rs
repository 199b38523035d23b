//! End-to-end: `kiln train recipes/search_r2_tiny.yaml` on a small synthetic world (warm start, joint GRPO with
//! the meta-refiner, final direct/RAG/agent table), `kiln eval --task qa` of its checkpoint, bad recipes /
//! retrievers as clear errors, and the default `recipes/search_r2.yaml` (SmolLM2-135M-Instruct, cold start,
//! LoRA GRPO) on the installed model.

use std::path::{Path, PathBuf};

use kiln_e2e::{read_metrics, run_kiln, scratch_project, text};

/// The run directory `runs/<prefix>-<timestamp>` (runs/ also holds the shared warm start).
fn run_dir(project: &Path, prefix: &str) -> PathBuf {
    let mut v: Vec<PathBuf> = std::fs::read_dir(project.join("runs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{prefix}-")))
        })
        .collect();
    assert_eq!(v.len(), 1, "{v:?}");
    v.pop().unwrap()
}

/// `kiln eval RUN --task qa --data synthetic --mode MODES --limit 3 EXTRA...` succeeds and prints the first
/// mode's row for 3 questions.
fn eval_synthetic(project: &Path, run: &Path, modes: &str, extra: &[&str]) {
    let mut a = vec![
        "eval",
        run.to_str().unwrap(),
        "--task",
        "qa",
        "--data",
        "synthetic",
        "--mode",
        modes,
        "--limit",
        "3",
    ];
    a.extend_from_slice(extra);
    let out = run_kiln(project, &a);
    assert!(out.status.success(), "{}", text(&out));
    let first = modes.split(',').next().unwrap();
    let row = format!("| synthetic-test | {first} | 3 |");
    assert!(text(&out).contains(&row), "{}", text(&out));
}

/// `kiln eval recipes/search_r1_tiny.yaml` (small world, agent mode, 3 test questions) succeeds and
/// prints its row: the recipe's policy before training, into a `search_r1_tiny-start-*` run.
fn eval_tiny_r1_recipe(project: &Path) {
    let mut a = vec!["eval", "recipes/search_r1_tiny.yaml"];
    a.extend_from_slice(SMALL);
    a.extend_from_slice(&[
        "--task",
        "qa",
        "--data",
        "synthetic",
        "--mode",
        "agent",
        "--limit",
        "3",
    ]);
    let out = run_kiln(project, &a);
    assert!(out.status.success(), "{}", text(&out));
    let row = "| synthetic-test | agent | 3 |";
    assert!(text(&out).contains(row), "{}", text(&out));
}

/// The first file called `name` below `dir`.
fn find_file(dir: &Path, name: &str) -> Option<PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if p.is_dir() {
            if let Some(f) = find_file(&p, name) {
                return Some(f);
            }
        } else if p.file_name().is_some_and(|n| n == name) {
            return Some(p);
        }
    }
    None
}

/// A small world and model so that the whole chain runs in well under a minute.
const SMALL: &[&str] = &[
    "--set",
    "world.train={countries: 3, cities: 8, persons: 30, companies: 15, questions: 80}",
    "--set",
    "world.dev={countries: 2, cities: 4, persons: 10, companies: 5, questions: 10}",
    "--set",
    "world.test={countries: 2, cities: 4, persons: 10, companies: 5, questions: 10}",
    "--set",
    "warm_start={vocab_size: 500, steps: 6, batch_size: 4, lr: 0.003}",
    "--set",
    "model.hidden_size=32",
    "--set",
    "model.intermediate_size=64",
    "--set",
    "model.num_hidden_layers=2",
    "--set",
    "search.questions_per_step=2",
    "--set",
    "search.eval_questions=4",
    "--set",
    "search.sampling.max_new_tokens=12",
    "--set",
    "search.batch.group_size=3",
    "--set",
    "trainer.steps=2",
    "--set",
    "trainer.mini_batch_size=6",
    "--set",
    "trainer.eval_every=2",
    "--set",
    "final_eval.questions=4",
    "--set",
    "final_eval.resamples=200",
    "--set",
    "logging.plots=false",
];

fn args<'a>(recipe: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["train", recipe];
    v.extend_from_slice(SMALL);
    v.extend_from_slice(extra);
    v
}

#[test]
fn search_r2_trains_evaluates_and_reports() {
    let p = scratch_project();
    let out = run_kiln(p.path(), &args("recipes/search_r2_tiny.yaml", &[]));
    assert!(out.status.success(), "{}", text(&out));
    let run = run_dir(p.path(), "search_r2_tiny");
    let rows = read_metrics(&run.join("metrics.jsonl"));
    assert_eq!(rows.len(), 2);
    for key in [
        "reward/em",
        "reward/f1",
        "reward/process",
        "reward/total",
        "refiner/acceptance_rate",
        "refiner/intervention_volume",
        "rollout/generated_tokens_per_s",
        "time/refiner_seconds",
    ] {
        assert!(
            rows[0].contains_key(key),
            "missing {key}: {:?}",
            rows[0].keys()
        );
    }
    assert!(rows[1].contains_key("eval/em"));
    // The warm start was created once, in init_dir, with its report.
    assert!(
        p.path()
            .join("runs/search/warm-start/warm_start.json")
            .is_file()
    );
    assert!(
        p.path()
            .join("runs/search/warm-start/tokenizer.json")
            .is_file()
    );
    // Final table: three modes on the held-out split.
    let report = std::fs::read_to_string(run.join("eval/qa-step-2/report.md")).unwrap();
    for m in ["| direct |", "| rag |", "| agent |"] {
        assert!(report.contains(m), "{report}");
    }
    let transcripts =
        std::fs::read_to_string(run.join("eval/qa-step-2/transcripts.jsonl")).unwrap();
    assert_eq!(transcripts.lines().count(), 12);
    // kiln eval --task qa of the same checkpoint, other modes and a limit.
    eval_synthetic(p.path(), &run, "agent,rag", &[]);
    // The same evaluation over a hybrid (BM25 + dense) index of the world's corpus (`kiln index --dense`).
    let corpus = find_file(&p.path().join("datasets/cache/synthetic"), "corpus.jsonl")
        .expect("the world's corpus.jsonl");
    let idx = p.path().join("world-hybrid");
    let out = run_kiln(
        p.path(),
        &[
            "index",
            "--corpus",
            corpus.to_str().unwrap(),
            "--out",
            idx.to_str().unwrap(),
            "--dense",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(idx.join("dense/dense.json").is_file());
    let hybrid = format!("hybrid:{}", idx.display());
    eval_synthetic(p.path(), &run, "rag", &["--retriever", &hybrid]);
    // Search-R1 reuses the same warm start (it is not rewritten).
    let ws = p.path().join("runs/search/warm-start/model.safetensors");
    let before = std::fs::metadata(&ws).unwrap().modified().unwrap();
    let out = run_kiln(
        p.path(),
        &args(
            "recipes/search_r1_tiny.yaml",
            &["--set", "final_eval.questions=0"],
        ),
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::metadata(&ws).unwrap().modified().unwrap(), before);
    let r1 = read_metrics(&run_dir(p.path(), "search_r1_tiny").join("metrics.jsonl"));
    assert!(
        r1[0].get("refiner/intervention_volume").is_none(),
        "refiner must be off"
    );
    // `kiln eval RECIPE`: the policy before training (the warm start), into a run of its own.
    eval_tiny_r1_recipe(p.path());
    let start = run_dir(p.path(), "search_r1_tiny-start");
    assert!(start.join("recipe.yaml").is_file());
    assert!(find_file(&start.join("eval"), "report.md").is_some());
    assert!(!start.join("checkpoints").exists());
}

#[test]
fn bad_search_recipes_and_retrievers_are_clear_errors() {
    let p = scratch_project();
    for (set, want) in [
        ("search.batch.group_size=1", "group_size must be at least 2"),
        ("search.batch.refinr.enabled=false", "refinr"),
        ("final_eval.modes=[agent, oracle]", "unknown mode `oracle`"),
        ("train_reachable_k=100000000", "use 1..=1000"),
        (
            "refiner_start={questions: 8, holdout: 1.5}",
            "holdout must be in [0, 1)",
        ),
        (
            "search.sampling.max_new_tokens=0",
            "max_new_tokens must be at least 1",
        ),
    ] {
        let out = run_kiln(
            p.path(),
            &[
                "train",
                "recipes/search_r2_tiny.yaml",
                "--dry-run",
                "--set",
                set,
            ],
        );
        assert_eq!(out.status.code(), Some(2), "{set}: {}", text(&out));
        assert!(text(&out).contains(want), "{set}: {}", text(&out));
        assert!(!text(&out).contains("panicked"), "{}", text(&out));
    }
    let out = run_kiln(
        p.path(),
        &args(
            "recipes/search_r2_tiny.yaml",
            &["--set", "retriever=/nonexistent/index"],
        ),
    );
    assert!(!out.status.success());
    assert!(text(&out).contains("/nonexistent/index"), "{}", text(&out));
    assert!(!text(&out).contains("panicked"), "{}", text(&out));
}

/// `kiln index --corpus CORPUS --out OUT` in `project` succeeds.
fn kiln_index(project: &Path, corpus: &Path, out: &Path) {
    let o = run_kiln(
        project,
        &[
            "index",
            "--corpus",
            corpus.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
}

/// GRPO on real questions over a real index (`train_data:` a JSONL file, `retriever:` a `kiln index`): the
/// warm start is still made from the synthetic world's demonstrations (searched on the world's own index),
/// `train_reachable_k` keeps the questions whose answer the index returns for the question (not the one
/// without evidence, not the yes/no one), and a corpus that answers none of them is a clear error.
#[test]
fn grpo_on_real_questions_keeps_the_reachable_ones() {
    let p = scratch_project();
    let dir = p.path().join("real");
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = [
        (
            "p1",
            "Harlow Vance",
            "Harlow Vance is a painter. She was born in Quillfield in 1931.",
        ),
        (
            "p2",
            "Quillfield",
            "Quillfield is a market town on the river Orme. Asked whether it floods, locals say yes.",
        ),
        (
            "p3",
            "Orme Bridge",
            "The Orme Bridge was opened by the engineer Tobias Wren.",
        ),
    ];
    let lines: Vec<String> = corpus
        .iter()
        .map(|(id, t, x)| serde_json::json!({"id": id, "title": t, "text": x}).to_string())
        .collect();
    std::fs::write(dir.join("corpus.jsonl"), lines.join("\n") + "\n").unwrap();
    let qa = [
        (
            "q1",
            "Where was the painter Harlow Vance born?",
            "Quillfield",
        ),
        ("q2", "Who opened the Orme Bridge?", "Tobias Wren"),
        ("q3", "Which composer wrote the Zenith Suite?", "Mara Ilves"),
        ("q4", "Is Quillfield on the river Orme?", "yes"),
    ];
    let lines: Vec<String> = qa
        .iter()
        .map(|(id, q, a)| {
            serde_json::json!({"id": id, "question": q, "golden_answers": [a], "data_source": "toy"})
                .to_string()
        })
        .collect();
    std::fs::write(dir.join("qa.jsonl"), lines.join("\n") + "\n").unwrap();
    let (c, q, idx) = (
        dir.join("corpus.jsonl"),
        dir.join("qa.jsonl"),
        dir.join("index"),
    );
    kiln_index(p.path(), &c, &idx);
    let real = [
        format!("train_data={}", q.display()),
        format!("eval_data={}", q.display()),
        format!("retriever={}", idx.display()),
    ];
    let mut extra: Vec<&str> = Vec::new();
    for s in &real {
        extra.extend_from_slice(&["--set", s]);
    }
    extra.extend_from_slice(&[
        "--set",
        "train_reachable_k=2",
        "--set",
        "final_eval.questions=0",
        "--set",
        "trainer.eval_every=0",
    ]);
    // (at info level: the kept count is a log line)
    let out = kiln_e2e::kiln(p.path())
        .env("KILN_LOG", "info")
        .args(args("recipes/search_r1_tiny.yaml", &extra))
        .output()
        .expect("spawn kiln");
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("2 of 4 training questions have a gold answer in the top 2"),
        "{}",
        text(&out)
    );
    // The warm start was made (on the world's demonstrations) and GRPO ran its steps on the real ones.
    assert!(
        p.path()
            .join("runs/search/warm-start/warm_start.json")
            .is_file()
    );
    let run = run_dir(p.path(), "search_r1_tiny");
    let rows = read_metrics(&run.join("metrics.jsonl"));
    assert_eq!(rows.len(), 2, "{}", text(&out));
    // An index that holds no answer: every question is dropped, and the run says why and what to do.
    let lines = [
        serde_json::json!({"id": "x", "title": "Nothing", "text": "An unrelated passage."})
            .to_string(),
    ];
    std::fs::write(dir.join("empty.jsonl"), lines.join("\n") + "\n").unwrap();
    let (c2, idx2) = (dir.join("empty.jsonl"), dir.join("index-empty"));
    kiln_index(p.path(), &c2, &idx2);
    let retr = format!("retriever={}", idx2.display());
    let mut extra2: Vec<&str> = extra.clone();
    let i = extra2
        .iter()
        .position(|s| s.starts_with("retriever="))
        .unwrap();
    extra2[i] = &retr;
    let out = run_kiln(p.path(), &args("recipes/search_r1_tiny.yaml", &extra2));
    assert!(!out.status.success());
    assert!(
        text(&out).contains("none of the 4 training questions"),
        "{}",
        text(&out)
    );
    assert!(!text(&out).contains("panicked"), "{}", text(&out));
}

/// `kiln eval RECIPE` on a fresh project: the recipe's starting policy (here the tiny warm start) does
/// not exist yet, so it is made first, as `kiln train` would, then evaluated; a second call reuses it.
#[test]
fn kiln_eval_of_a_recipe_makes_its_missing_start_first() {
    let p = scratch_project();
    eval_tiny_r1_recipe(p.path());
    let ws = p.path().join("runs/search/warm-start/model.safetensors");
    assert!(
        p.path()
            .join("runs/search/warm-start/warm_start.json")
            .is_file()
    );
    let made = std::fs::metadata(&ws).unwrap().modified().unwrap();
    eval_tiny_r1_recipe(p.path());
    assert_eq!(std::fs::metadata(&ws).unwrap().modified().unwrap(), made);
}

/// The refiner start on a policy that answers nothing right (the tiny agent after 6 warm-start steps):
/// there is no "accept" example to learn from, so the run stops with an error that says so and how to
/// fix it, and leaves no refiner-start folder behind; the warm start it sampled from is kept.
#[test]
fn refiner_start_without_a_right_trajectory_is_a_clear_error() {
    let p = scratch_project();
    let out = run_kiln(
        p.path(),
        &args(
            "recipes/search_r2_tiny.yaml",
            &[
                "--set",
                "refiner_start={questions: 4, group_size: 2, epochs: 1}",
            ],
        ),
    );
    assert!(!out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(t.contains("were all wrong"), "{t}");
    assert!(t.contains("refiner_start.questions"), "{t}");
    assert!(!t.contains("panicked"), "{t}");
    assert!(
        p.path()
            .join("runs/search/warm-start/model.safetensors")
            .is_file()
    );
    assert!(!p.path().join("runs/search/warm-start-refiner").exists());
    assert!(!p.path().join("runs/search/warm-start-refiner.tmp").exists());
}

/// The default `recipes/search_r2.yaml` as shipped (its `pretrained:` name is the one `just setup` records),
/// shrunk: the cold start of SmolLM2-135M-Instruct (LoRA SFT on scripted demonstrations, merged into
/// init_dir, the tokenizer left to the base), a LoRA GRPO step with the real model as actor and refiner, and
/// a final table whose prompts (direct, RAG and agent) are all inside the chat template the policy was
/// trained in; then `recipes/search_r1.yaml` reuses the cold start.
#[test]
fn default_smollm2_recipe_cold_starts_and_trains_on_the_installed_model() {
    let p = scratch_project();
    let small = |recipe: &'static str| {
        let mut a = vec!["train", recipe];
        a.extend_from_slice(&SMALL[..6]); // the small world
        a.extend_from_slice(&[
            "--set",
            "warm_start={steps: 2, batch_size: 2, lr: 0.0005, max_questions: 4}",
            "--set",
            "refiner_start.questions=0",
            "--set",
            "trainer.steps=1",
            "--set",
            "trainer.mini_batch_size=2",
            "--set",
            "search.questions_per_step=1",
            "--set",
            "search.batch.group_size=2",
            "--set",
            "search.batch.protocol.max_turns=2",
            "--set",
            "search.sampling.max_new_tokens=8",
            "--set",
            "final_eval.questions=2",
            "--set",
            "final_eval.resamples=100",
            "--set",
            "logging.plots=false",
        ]);
        a
    };
    let out = run_kiln(p.path(), &small("recipes/search_r2.yaml"));
    assert!(out.status.success(), "{}", text(&out));
    let run = run_dir(p.path(), "search_r2");
    let rows = read_metrics(&run.join("metrics.jsonl"));
    assert_eq!(rows.len(), 1);
    assert!(
        rows[0].contains_key("refiner/acceptance_rate"),
        "{:?}",
        rows[0].keys()
    );
    // The cold start: merged weights and its report naming the base; no tokenizer of its own.
    let cold = p.path().join("runs/search/cold-start-smollm2");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cold.join("warm_start.json")).unwrap())
            .unwrap();
    assert_eq!(report["base"], "smollm2-135m", "{report}");
    assert!(cold.join("model.safetensors").is_file());
    assert!(!cold.join("tokenizer.json").exists());
    // Every mode's prompt is chat-wrapped, as in training.
    let transcripts =
        std::fs::read_to_string(run.join("eval/qa-step-1/transcripts.jsonl")).unwrap();
    assert_eq!(transcripts.lines().count(), 6);
    for line in transcripts.lines() {
        assert!(line.contains("<|im_start|>user"), "{line}");
    }
    // Search-R1 reuses the cold start (not rewritten).
    let w = cold.join("model.safetensors");
    let before = std::fs::metadata(&w).unwrap().modified().unwrap();
    let mut a = small("recipes/search_r1.yaml");
    a.extend_from_slice(&["--set", "final_eval.questions=0"]);
    let out = run_kiln(p.path(), &a);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::metadata(&w).unwrap().modified().unwrap(), before);
}

/// LoRA from a recipe (`lora: {rank, alpha}`): the run trains the adapters only (the log names the
/// trainable count), the final table loads the checkpoint's adapters, and `kiln eval` of the run
/// does too; a bad setting is a recipe error.
#[test]
fn search_r2_with_lora_adapters_trains_and_evaluates() {
    let p = scratch_project();
    let out = kiln_e2e::kiln(p.path())
        .env("KILN_LOG", "info")
        .args(args(
            "recipes/search_r2_tiny.yaml",
            &["--set", "lora={rank: 4, alpha: 8}", "--set", "name=lora"],
        ))
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("LoRA r=4 alpha=8"), "{log}");
    let run = run_dir(p.path(), "lora");
    let rows = read_metrics(&run.join("metrics.jsonl"));
    assert_eq!(rows.len(), 2);
    assert!(rows[0].contains_key("reward/total"), "{:?}", rows[0].keys());
    assert!(run.join("eval/qa-step-2/report.md").is_file());
    // Checkpoints hold the adapters only, and name their base (the warm start, by digest).
    let ckpt = run.join("checkpoints/step-2");
    let adapters = std::fs::metadata(ckpt.join("model.bpk")).unwrap().len();
    let base = std::fs::metadata(p.path().join("runs/search/warm-start/model.safetensors"))
        .unwrap()
        .len();
    assert!(
        adapters * 4 < base,
        "adapters {adapters} vs base {base} bytes"
    );
    let state = std::fs::read_to_string(ckpt.join("state.json")).unwrap();
    assert!(
        state.contains("the warm start (model.safetensors:"),
        "{state}"
    );
    // A resumed run rebuilds the base, loads the adapters over it and goes on.
    let out = run_kiln(
        p.path(),
        &[
            "train",
            "--resume",
            run.to_str().unwrap(),
            "--set",
            "trainer.steps=3",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(read_metrics(&run.join("metrics.jsonl")).len(), 3);
    eval_synthetic(p.path(), &run, "agent", &[]);
    // Adapters are never loaded over another base (here: other LoRA settings), and the refused
    // resume leaves the run's recipe.yaml as it was.
    let recipe_before = std::fs::read_to_string(run.join("recipe.yaml")).unwrap();
    let out = run_kiln(
        p.path(),
        &[
            "train",
            "--resume",
            run.to_str().unwrap(),
            "--set",
            "trainer.steps=4",
            "--set",
            "lora.alpha=16",
        ],
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("holds part of the policy"),
        "{}",
        text(&out)
    );
    assert_eq!(
        std::fs::read_to_string(run.join("recipe.yaml")).unwrap(),
        recipe_before
    );
    // A bad LoRA setting is a located recipe error.
    let out = run_kiln(
        p.path(),
        &args("recipes/search_r2_tiny.yaml", &["--set", "lora={rank: 0}"]),
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("lora.rank must be at least 1"),
        "{}",
        text(&out)
    );
}
