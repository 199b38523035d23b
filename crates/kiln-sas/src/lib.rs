//! kiln's SAS task (Self-Aware Scheduling of the unmasking order of a masked diffusion model,
//! METHODS.md section 2).
//!
//! - [`sudoku`]: boards, solver, expert order, generator, loaders, token encoding;
//! - [`denoiser`]: the Sudoku masked-diffusion denoiser, its pre-training and checkpoints;
//! - [`schedule`]: decoding with every unmasking schedule (heuristics, expert, learned policy),
//!   one or k positions per step, block (semi-autoregressive) restriction;
//! - [`policy`]: the order policy (MLP over per-position denoiser features, masked softmax);
//! - [`task`]: the self-aware reward, the GRPO task for kiln-rl's trainer, and stage 2;
//! - [`eval`]: accuracy tables with bootstrap confidence intervals, order images;
//! - [`gsm8k`]: GSM8K answer extraction and LLaDA-style decoding for masked diffusion LMs;
//! - [`text`]: the text order policy (one transformer layer) and its self-aware GRPO task.

pub mod denoiser;
pub mod eval;
pub mod gsm8k;
pub mod policy;
pub mod schedule;
pub mod sudoku;
pub mod task;
pub mod text;
