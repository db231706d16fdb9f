"""Quantized weights: FP8 checkpoints and online FP8 quantization (fp8.py)."""
