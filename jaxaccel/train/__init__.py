"""Training: state, jitted steps, the loop, checkpoints and metrics."""
