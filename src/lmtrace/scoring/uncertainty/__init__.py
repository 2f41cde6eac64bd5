"""Uncertainty estimators that need one more pass of the model (polygraph.py: PMI, conditional
PMI, p(True)); the per-step and per-sequence scores over logits live in lmtrace.logits."""
