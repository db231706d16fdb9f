"""CUDA graphs: region graphs (TokenGraph, ReqGraph, eager regions, the shared pool) and bucket arithmetic."""

from atomrt.graphs.buckets import RequestBucket, bucket_for, capture_order, fill_padded, request_bucket
from atomrt.graphs.region_graph import (
    CudaGraphBackend,
    ReqGraph,
    TokenGraph,
    captured_token_sizes,
    eager_region,
    graph_pool,
    graph_pool_bytes,
    token_graph,
    token_graph_of,
    token_graph_units,
)

__all__ = [
    "CudaGraphBackend",
    "ReqGraph",
    "RequestBucket",
    "TokenGraph",
    "bucket_for",
    "capture_order",
    "captured_token_sizes",
    "eager_region",
    "fill_padded",
    "graph_pool",
    "graph_pool_bytes",
    "request_bucket",
    "token_graph",
    "token_graph_of",
    "token_graph_units",
]
