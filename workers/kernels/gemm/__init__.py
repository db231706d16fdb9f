"""Triton GEMM kernels: the skinny (small-batch) GEMM and its launch configs."""
