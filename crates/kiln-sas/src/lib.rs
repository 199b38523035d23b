//! kiln's SAS task (Self-Aware Scheduling of the unmasking order of a masked diffusion model).
//!
//! This crate currently holds the model-free Sudoku core ([`sudoku`]): boards, a fast solver,
//! the "expert" fill order, a seeded puzzle generator with a dataset cache, loaders for the
//! shared Sudoku datasets, and the token encoding a masked-diffusion denoiser sees.

pub mod sudoku;
