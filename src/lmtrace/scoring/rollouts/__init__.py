"""RL rollouts against the trainer: read a rollout dump (readers, one module per format), the
exact per-token numbers (forward, tokens), the frameworks' metrics, the causes, where two
computations part (locate). `lmtrace.rollouts(lm, records)` is report.rollouts."""
