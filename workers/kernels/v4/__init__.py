"""DeepSeek-V4's Triton kernels: the compressor, the indexer's scores, sparse attention."""
