"""Terminal views of records (rich): one module per feature (trace.py, score.py, branch.py,
stability.py, kvlab.py, ...)."""
