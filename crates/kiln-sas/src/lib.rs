//! kiln's SAS task (Self-Aware Scheduling of the unmasking order of a masked diffusion model;
//! METHODS, SAS; where each formula lives: the repository's `ARCHITECTURE.md`).
//!
//! - [`sudoku`]: boards, solver, expert order, generator, loaders, token encoding, puzzle sets,
//!   board symmetries;
//! - [`denoiser`]: the Sudoku masked-diffusion denoiser, its pre-training and its store;
//! - [`schedule`]: decoding with every unmasking schedule (heuristics, expert, learned policy),
//!   one or k positions per step, block (semi-autoregressive) restriction;
//! - [`policy`]: the order policy (MLP over per-position denoiser features, masked softmax);
//! - [`reward`]: the self-aware reward and the teacher-forced rollout record (Sudoku and text);
//! - [`task`]: the GRPO task for kiln-rl's trainer on Sudoku; [`stage2`]: fine-tuning the
//!   denoiser along the learned orders;
//! - [`eval`]: accuracy tables with bootstrap confidence intervals, order images;
//! - [`gsm8k`]: GSM8K answer extraction and LLaDA-style decoding for masked diffusion LMs;
//! - [`text`]: the text order policy (one transformer layer) and its self-aware GRPO task;
//!   [`text_lm`]: kiln-lm's transformer as the frozen text denoiser;
//! - [`pipeline`]: what `kiln train` / `kiln eval` run for `mdm_sudoku`, `sas` and `sas_gsm8k`.

pub mod denoiser;
pub mod eval;
pub mod gsm8k;
pub mod pipeline;
pub mod policy;
pub mod reward;
pub mod schedule;
pub mod stage2;
pub mod sudoku;
pub mod task;
pub mod text;
pub mod text_lm;
