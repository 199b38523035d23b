//! The `kiln` command-line tool.

mod config;
mod doctor;
mod explain;
mod recipe;
mod resources;
mod run;
mod tasks;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kiln: reinforcement-learning training for LLM agents and masked-diffusion schedulers.
#[derive(Parser, Debug)]
#[command(name = "kiln", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train with a recipe: `kiln train recipes/grpo_sequence.yaml --set optim.lr=1e-3`.
    Train {
        /// Recipe file (optional with --resume: the run's saved recipe is used).
        recipe: Option<PathBuf>,
        /// Override a recipe field: `--set trainer.steps=50` (repeatable; values are YAML).
        #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
        sets: Vec<String>,
        /// Continue a run directory from its newest complete checkpoint.
        #[arg(long, value_name = "RUN_DIR")]
        resume: Option<PathBuf>,
        /// Only load and validate the recipe, print the resolved recipe, and exit.
        #[arg(long)]
        dry_run: bool,
    },
    /// Evaluate a checkpoint (or the newest checkpoint of a run directory).
    Eval {
        /// `runs/<run>/checkpoints/step-N` or `runs/<run>`; or a recipe file (`search_r2` task):
        /// its policy before training (warm / cold start, refiner start; made first when missing,
        /// as `kiln train` would), into a new `<name>-start-<time>` run.
        checkpoint: PathBuf,
        /// Override a field of the run's recipe for evaluation (e.g. `sequence.eval_prompts=512`).
        #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
        sets: Vec<String>,
        /// Evaluation task when it differs from the run's task (e.g. `sudoku`, `gsm8k`, `qa`).
        #[arg(long)]
        task: Option<String>,
        /// Evaluation data: a dataset name or a file path (`--task qa`: a comma list, or `synthetic`).
        #[arg(long)]
        data: Option<String>,
        /// `--task qa`: the search engine, a `kiln index` directory or a retrieval server URL.
        #[arg(long)]
        retriever: Option<String>,
        /// `--task qa`: `direct` (no retrieval), `rag` (retrieve once), `agent` (default: all three).
        #[arg(long)]
        mode: Option<String>,
        /// At most this many questions per dataset.
        #[arg(long)]
        limit: Option<usize>,
    },
    /// List recipes with their descriptions, or document every field of a task.
    Recipes {
        /// Print every recipe field of TASK with its type, default and documentation.
        #[arg(long, value_name = "TASK")]
        explain: Option<String>,
        /// Directory to list.
        #[arg(long, default_value = "recipes")]
        dir: PathBuf,
    },
    /// Build a BM25 index from JSONL corpora.
    Index(kiln_retrieval::cli::IndexArgs),
    /// Serve a BM25 index over HTTP with Search-R1's `/retrieve` API.
    ServeRetriever(kiln_retrieval::cli::ServeArgs),
    /// Benchmark index build, search QPS and server latency.
    BenchRetriever(kiln_retrieval::cli::BenchArgs),
    /// Write plots and a report for a run directory.
    Report(kiln_track::cli::ReportArgs),
    /// Generate a completion with a model.
    Generate(kiln_lm::cli::GenerateArgs),
    /// Export a checkpoint as an HF model folder.
    Export(kiln_lm::cli::ExportArgs),
    /// Generate (or show the cached) synthetic multi-hop world: corpus + 1-hop/2-hop questions.
    SyntheticWorld(kiln_search::cli::SyntheticArgs),
    /// Say what this machine and build have and lack for each backend and recipe.
    Doctor(doctor::DoctorArgs),
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("KILN_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(run::stderr_colours())
        .with_writer(|| run::SuspendingStderr)
        .try_init();
}

fn dispatch(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Train {
            recipe,
            sets,
            resume,
            dry_run,
        } => {
            let (path, raw) = match (&recipe, &resume) {
                (_, Some(run_dir)) => {
                    let p = run_dir.join(run::RECIPE_FILE);
                    if !p.is_file() {
                        anyhow::bail!(
                            "{} is not a kiln run directory: {} is missing",
                            run_dir.display(),
                            p.display()
                        );
                    }
                    let raw = recipe::load_raw(&p, &sets)?;
                    (recipe.clone(), raw)
                }
                (Some(p), None) => (Some(p.clone()), recipe::load_raw(p, &sets)?),
                (None, None) => anyhow::bail!(
                    "give a recipe (`kiln train recipes/grpo_sequence.yaml`) or --resume RUN_DIR"
                ),
            };
            if dry_run {
                let resolved = tasks::validate(&raw)?;
                print!("{}", serde_norway::to_string(&resolved)?);
                eprintln!(
                    "[kiln] memory estimate: {} ({})",
                    resources::Estimate::of(&resolved),
                    resources::machine_memory()
                        .map(|m| format!("this machine has {}", resources::fmt_bytes(m)))
                        .unwrap_or_else(|| "this machine's memory is unknown".into())
                );
                return Ok(());
            }
            tasks::train(tasks::TrainRequest {
                raw,
                recipe_path: path,
                resume,
            })?;
            Ok(())
        }
        Command::Eval {
            checkpoint,
            sets,
            task,
            data,
            retriever,
            mode,
            limit,
        } => {
            tasks::eval(tasks::EvalRequest {
                checkpoint,
                sets,
                task,
                data,
                retriever,
                mode,
                limit,
            })?;
            Ok(())
        }
        Command::Recipes { explain, dir } => {
            match explain {
                Some(task) => match tasks::schemas(&task) {
                    Some(s) => {
                        println!(
                            "Recipe fields of task `{task}` (top-level keys, then task sections)."
                        );
                        println!(
                            "Any mapping may also hold `extends: FILE` (or a list) to include a file at that level."
                        );
                        print!("{}", explain::explain(&s));
                    }
                    None => {
                        let names: Vec<&str> = tasks::TASKS.iter().map(|t| t.name()).collect();
                        return Err(recipe::RecipeError::Task {
                            at: recipe::Origin::Default,
                            msg: format!(
                                "unknown task `{task}`; known tasks: {}",
                                names.join(", ")
                            ),
                        }
                        .into());
                    }
                },
                None => {
                    println!("tasks:");
                    for t in tasks::TASKS {
                        println!("  {:<16} {}", t.name(), t.summary());
                    }
                    println!("\nrecipes in {}:", dir.display());
                    for (f, d) in explain::list_recipes(&dir) {
                        println!("  {f:<36} {d}");
                    }
                }
            }
            Ok(())
        }
        Command::Index(a) => Ok(kiln_retrieval::cli::run_index(a)?),
        Command::ServeRetriever(a) => Ok(kiln_retrieval::cli::run_serve(a)?),
        Command::BenchRetriever(a) => Ok(kiln_retrieval::cli::run_bench(a)?),
        Command::Report(a) => Ok(kiln_track::cli::run_report(a)?),
        Command::Generate(a) => Ok(kiln_lm::cli::run_generate(a)?),
        Command::Export(a) => Ok(kiln_lm::cli::run_export(a)?),
        Command::SyntheticWorld(a) => Ok(kiln_search::cli::run_synthetic(a)?),
        Command::Doctor(a) => doctor::run(a),
    }
}

fn main() -> ExitCode {
    // Keep freed tensor memory for reuse (glibc): see `kiln_lm::malloc`; `KILN_MALLOC=system` opts out.
    kiln_lm::malloc::keep_freed_memory();
    let cli = Cli::parse();
    init_tracing();
    match dispatch(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(re) = e.downcast_ref::<recipe::RecipeError>() {
                eprintln!("error: bad recipe: {re}");
                return ExitCode::from(2);
            }
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
