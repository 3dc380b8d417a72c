"""Training: the GRPO driver's policy, loss and trainer checkpoints."""
