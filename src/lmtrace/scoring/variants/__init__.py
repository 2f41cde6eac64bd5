"""A model changed one way (another dtype, its packed weights, another attention kernel, a batch,
threads, compiled, another engine or file): spec.py parses and checks the spec before any model
loads (no torch); worlds.py builds the world that teacher-forces and decodes under it. Used by
the stability ledger, kld and rollouts."""
