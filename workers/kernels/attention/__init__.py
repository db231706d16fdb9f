"""Triton attention kernels: decode (split-KV), paged prefill, rotary + KV write."""
