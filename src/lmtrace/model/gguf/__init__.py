"""GGUF files: their blocks, the converted safetensors copy kept in the user's cache, the
checks before a load, transformers' quiet loading, and the packed 4-bit weights."""
