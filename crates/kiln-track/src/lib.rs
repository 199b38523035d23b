//! kiln-track: experiment tracking (Weights & Biases offline/online, TensorBoard, JSONL, console),
//! plots and run reports.

pub mod cli;
