"""Weights (safetensors, GGUF, dummy presets) and tokenizers."""
