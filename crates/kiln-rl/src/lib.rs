//! kiln-rl: the algorithm layer (group advantages, PPO-clip / GRPO / Dr.GRPO losses, KL
//! estimators, optimiser and LR schedule, the generic on-policy trainer loop, checkpoints).
//! Knows nothing of search or Sudoku.
