"""Many samples of one prompt: decoded as rows of one batch, an answer extracted from each,
votes and answer-level uncertainty over them, DeepConf's online early stop (samples/run.py)."""
