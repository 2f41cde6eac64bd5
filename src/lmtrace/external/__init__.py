"""Traces of other people's decoding: model.generate's outputs (from_generate), its generation
config, and a user's own loop watched (watch, watch_trace, misuse)."""
