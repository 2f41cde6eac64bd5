"""Models: loading (load.py, the only from_pretrained), the LM a load returns (lm.py), its
architecture summary, writing and exporting safetensors folders, and GGUF files (gguf/)."""
