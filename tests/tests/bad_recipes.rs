//! A table of malformed recipes: each must be rejected with a clear error and exit code 2, and
//! none may panic.

use kiln_e2e::{run_kiln, scratch_project, text};

const GOOD: &str = "task: grpo_sequence
model:
  extends: configs/model/tiny-policy.yaml
trainer:
  steps: 5
optim:
  lr: 0.001
";

struct Case {
    name: &'static str,
    yaml: &'static str,
    sets: &'static [&'static str],
    expect: &'static [&'static str],
}

const CASES: &[Case] = &[
    Case {
        name: "top-k sampling in a training recipe",
        yaml: "task: search_r2\nsearch:\n  sampling:\n    temperature: 0.7\n    top_k: 20\n",
        sets: &[],
        expect: &["search.sampling", "top_k", "bad.yaml:5:"],
    },
    Case {
        name: "greedy training rollouts",
        yaml: "task: search_r2\nsearch:\n  sampling:\n    temperature: 0.0\n",
        sets: &[],
        expect: &["search.sampling", "temperature > 0", "bad.yaml:4:"],
    },
    Case {
        name: "unknown top-level key",
        yaml: "task: grpo_sequence\ntrainr:\n  steps: 3\n",
        sets: &[],
        expect: &[
            "unknown key `trainr`",
            "did you mean `trainer`",
            "bad.yaml:2:",
        ],
    },
    Case {
        name: "unknown nested key",
        yaml: "task: grpo_sequence\noptim:\n  lrr: 0.1\n",
        sets: &[],
        expect: &[
            "unknown key `optim.lrr`",
            "did you mean `optim.lr`",
            "bad.yaml:3:",
        ],
    },
    Case {
        name: "wrong type",
        yaml: "task: grpo_sequence\ntrainer:\n  steps: many\n",
        sets: &[],
        expect: &["`trainer.steps`", "bad.yaml:3:10"],
    },
    Case {
        name: "bad enum value",
        yaml: "task: grpo_sequence\nalgorithm:\n  advantage: ppo2\n",
        sets: &[],
        expect: &[
            "`algorithm.advantage`",
            "unknown variant `ppo2`",
            "bad.yaml:3:",
        ],
    },
    Case {
        name: "bad backend",
        yaml: "task: grpo_sequence\nbackend: tpu\n",
        sets: &[],
        expect: &["`backend`", "unknown variant `tpu`"],
    },
    Case {
        name: "missing extends file",
        yaml: "task: grpo_sequence\nextends: configs/nope.yaml\n",
        sets: &[],
        expect: &["recipe file not found: configs/nope.yaml", "tried:"],
    },
    Case {
        name: "YAML syntax error",
        yaml: "task: grpo_sequence\ntrainer:\n  steps: [1, 2\n",
        sets: &[],
        expect: &["YAML syntax error", "bad.yaml:"],
    },
    Case {
        name: "negative lr",
        yaml: "task: grpo_sequence\noptim:\n  lr: -0.1\n",
        sets: &[],
        expect: &["`optim.lr`", "positive", "bad.yaml:3:"],
    },
    Case {
        name: "group size 0",
        yaml: "task: grpo_sequence\nsequence:\n  group_size: 0\n",
        sets: &[],
        expect: &["`sequence.group_size`", "must be >= 2"],
    },
    Case {
        name: "missing task",
        yaml: "trainer:\n  steps: 3\n",
        sets: &[],
        expect: &["no `task:`"],
    },
    Case {
        name: "unknown task",
        yaml: "task: grpo_sequense\n",
        sets: &[],
        expect: &[
            "unknown task `grpo_sequense`",
            "did you mean `grpo_sequence`",
        ],
    },
    Case {
        name: "zero steps",
        yaml: "task: grpo_sequence\ntrainer:\n  steps: 0\n",
        sets: &[],
        expect: &["`trainer.steps`", "must be >= 1"],
    },
    Case {
        name: "clip eps out of range",
        yaml: "task: grpo_sequence\nalgorithm:\n  clip_eps: 1.5\n",
        sets: &[],
        expect: &["`algorithm.clip_eps`", "(0, 1)"],
    },
    Case {
        name: "warmup ratio > 1",
        yaml: "task: grpo_sequence\noptim:\n  warmup_ratio: 2\n",
        sets: &[],
        expect: &["`optim.warmup_ratio`", "[0, 1]"],
    },
    Case {
        name: "beta2 = 1",
        yaml: "task: grpo_sequence\noptim:\n  beta2: 1.0\n",
        sets: &[],
        expect: &["`optim.beta2`"],
    },
    Case {
        name: "not a mapping",
        yaml: "- task\n- grpo_sequence\n",
        sets: &[],
        expect: &["must be a YAML mapping"],
    },
    Case {
        name: "vocabulary too small",
        yaml: "task: grpo_sequence\nmodel:\n  vocab_size: 5\n",
        sets: &[],
        expect: &["`model.vocab_size`", ">= 12"],
    },
    Case {
        name: "heads do not divide width",
        yaml: "task: grpo_sequence\nmodel:\n  hidden_size: 30\n  num_attention_heads: 4\n  num_key_value_heads: 4\n",
        sets: &[],
        expect: &["`model`"],
    },
    Case {
        name: "negative kl beta",
        yaml: "task: grpo_sequence\nalgorithm:\n  kl_beta: -1\n",
        sets: &[],
        expect: &["`algorithm.kl_beta`"],
    },
    Case {
        name: "set without =",
        yaml: GOOD,
        sets: &["trainer.steps"],
        expect: &["--set trainer.steps", "KEY.PATH=VALUE"],
    },
    Case {
        name: "set with wrong type",
        yaml: GOOD,
        sets: &["trainer.steps=lots"],
        expect: &["--set trainer.steps=lots", "`trainer.steps`"],
    },
    Case {
        name: "set unknown key",
        yaml: GOOD,
        sets: &["optim.lrate=1"],
        expect: &["unknown key `optim.lrate`", "--set optim.lrate=1"],
    },
    Case {
        name: "list instead of number",
        yaml: "task: grpo_sequence\nsequence:\n  length: [1]\n",
        sets: &[],
        expect: &["`sequence.length`", "bad.yaml:3:"],
    },
];

#[test]
fn malformed_recipes_are_rejected_with_exit_code_2() {
    let project = scratch_project();
    let mut failures = Vec::new();
    for case in CASES {
        let path = project.path().join("bad.yaml");
        std::fs::write(&path, case.yaml).unwrap();
        // a cycle needs a second file
        let mut args = vec!["train", "bad.yaml", "--dry-run"];
        for s in case.sets {
            args.push("--set");
            args.push(s);
        }
        let out = run_kiln(project.path(), &args);
        let t = text(&out);
        let code = out.status.code();
        let missing: Vec<&&str> = case.expect.iter().filter(|e| !t.contains(**e)).collect();
        if code != Some(2) || !missing.is_empty() || t.contains("panicked") {
            failures.push(format!(
                "case `{}`: exit {code:?}, missing {missing:?}, output:\n{t}",
                case.name
            ));
        }
    }
    assert!(CASES.len() >= 15);
    assert!(failures.is_empty(), "{}", failures.join("\n---\n"));
}

#[test]
fn missing_recipe_file_and_extends_cycle() {
    let project = scratch_project();
    let out = run_kiln(project.path(), &["train", "recipes/none.yaml", "--dry-run"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("recipe file not found: recipes/none.yaml"));

    std::fs::write(
        project.path().join("a.yaml"),
        "task: grpo_sequence\nextends: b.yaml\n",
    )
    .unwrap();
    std::fs::write(project.path().join("b.yaml"), "extends: a.yaml\n").unwrap();
    let out = run_kiln(project.path(), &["train", "a.yaml", "--dry-run"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("`extends` cycle"), "{}", text(&out));
}

#[test]
fn good_recipe_resolves_with_defaults_and_overrides() {
    let project = scratch_project();
    std::fs::write(project.path().join("good.yaml"), GOOD).unwrap();
    let out = run_kiln(
        project.path(),
        &[
            "train",
            "good.yaml",
            "--dry-run",
            "--set",
            "optim.lr=0.01",
            "--set",
            "sequence.length=4",
        ],
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let v: serde_json::Value = serde_json::to_value(t.clone()).unwrap();
    let _ = v;
    assert!(t.contains("lr: 0.01"), "{t}");
    assert!(t.contains("length: 4"), "{t}");
    // defaults are materialised
    assert!(t.contains("ppo_epochs: 1"), "{t}");
    assert!(t.contains("hidden_size: 64"), "{t}");
}

#[test]
fn recipes_lists_and_explains() {
    let root = kiln_e2e::repo_root();
    let out = run_kiln(&root, &["recipes"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("recipes/grpo_sequence.yaml"), "{t}");
    assert!(t.contains("grpo_sequence"), "{t}");
    let out = run_kiln(&root, &["recipes", "--explain", "grpo_sequence"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for field in [
        "optim.lr",
        "trainer.steps",
        "algorithm.kl_beta",
        "sequence.group_size",
        "model.hidden_size",
        "logging.jsonl",
    ] {
        assert!(t.contains(field), "--explain lacks {field}:\n{t}");
    }
    assert!(
        t.contains("[default: 0.001]"),
        "kl_beta default shown:\n{t}"
    );
    let out = run_kiln(&root, &["--version"]);
    assert!(text(&out).starts_with("kiln "), "{}", text(&out));
}
