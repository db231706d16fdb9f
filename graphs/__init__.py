"""CUDA graphs: region graphs (TokenGraph, ReqGraph, eager regions, the shared pool) and bucket arithmetic.

How the ModelRunner uses them (every call under `torch.inference_mode()`):

Capture, sizes descending, per bucket `bs` (rows = bs * max_q_len):
  fill the static buffers with a dummy decode batch (`StepBuffers.prepare`); set the forward context with
  `running_tokens=rows`, then
  * warm-up: `model(input_ids[:rows], positions[:rows])` with `tr_graph=None`;
  * FULL: `req_graph.record(request_bucket(bs, max_q_len), lambda: model(ids[:rows], pos[:rows]))`,
    attention metadata graph-safe (read from static device buffers), `tr_graph=None`;
  * TR_HYBRID: the same call `model(ids[:rows], pos[:rows])` with `tr_graph="record"`: the
    `@token_graph` unit records for `rows` and the context's phase (`is_prefill`); call it once per
    phase that may replay the bucket.
  Then `CapturedBuckets(req_graph.keys(), captured_token_sizes(model, "prefill"),
  captured_token_sizes(model, "decode"))` goes to the driver's `ForwardMode`.

Replay, per step, following the driver's `ForwardDecision`:
  fill the static buffers up to `decision.running_tokens` rows (padding rows zeroed, slots -1), set
  the forward context with the live step's attention metadata, `running_tokens=decision.running_tokens`
  and `tr_graph=decision.tr_graph`, then
  * REQ_GRAPH: `out = req_graph.replay(decision.req_key)`;
  * TOKEN_GRAPH: `out = model(ids[:rows], pos[:rows])` -- the unit replays (same static slices);
    with `tr_req_key=decision.req_key` (a decode step at a bucket whose regions were recorded for
    its request bucket) as one launch;
  * EAGER: `out = model(ids[:n], pos[:n])`.
  A replay's output lives in the shared pool: consume it before the next replay.
"""

from atomrt.graphs.buckets import RequestBucket, bucket_for, capture_order, request_bucket
from atomrt.graphs.markers import (
    captured_token_sizes,
    eager_region,
    token_graph,
    token_graph_of,
    token_graph_units,
)
from atomrt.graphs.region_graph import (
    CudaGraphBackend,
    ReqGraph,
    TokenGraph,
    graph_pool,
    graph_pool_bytes,
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
    "graph_pool",
    "graph_pool_bytes",
    "request_bucket",
    "token_graph",
    "token_graph_of",
    "token_graph_units",
]
