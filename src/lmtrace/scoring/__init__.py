"""Checks against another computation, one family a folder: teacher/ (teacher-forced scoring,
rescoring a trace, verifying the loop against model.generate), variants/ (a model changed one
way: the specs and the worlds that run them), stability/ (will this token flip: the ledger and
its noise arithmetic), kld.py (quantization over a corpus, as llama-perplexity), uncertainty/
(the estimators that need one more pass: PMI, p(True)), rollouts/ (RL rollouts against the
trainer)."""
