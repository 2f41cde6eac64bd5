"""The only decoding loops: the one step (step.py), the engine's batch loop (engine.py), what is
recorded beside each step (observers.py), a row's records (rows.py), the public API
(tracing.py), continuous batching and branching."""
