"""The batch-invariant operations: every number a row gets is bitwise the same whatever else is
computed beside it (lmtrace.load(batch_invariant=True), lmtrace.batch_invariant(model))."""
