"""Mixture-of-experts kernels: routing metadata (`moe_align_block_size`), the fused expert GEMMs
(`fused_experts`) and their launch configs (`moe_configs`)."""
