"""Training: the learner (algorithm-blind updates), the synchronous trainer, checkpoints."""
