"""Teacher forcing: a given text's tokens scored in one uncached forward pass per window
(score.py), a generated trace rescored that way and compared with its cached numbers
(rescore.py), and the cached greedy loop verified against a recompute and model.generate
(verify.py)."""
