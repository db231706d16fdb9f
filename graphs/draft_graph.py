"""`DraftGraph`: a drafter's own recordings, in either graph mode.

Drafters are not marked `@token_graph`: the target's recording unit records the target, and a
drafter (workers/spec_decode/draft_model.py) records each of its passes with
`DraftGraph.record(num_tokens, phase, fn, *static_inputs)` and replays them with
`DraftGraph.replay(num_tokens, phase)`, exactly as a TokenGraph: segments broken at eager regions,
recorded into the shared `graph_pool()`, outputs valid until the next replay of any recording.
Whether the target replays request graphs (FULL) or token graphs (TR_HYBRID), the drafter's passes
replay DraftGraphs.
"""

from atomrt.graphs.region_graph import TokenGraph


class DraftGraph(TokenGraph):
    """A TokenGraph owned by a drafter rather than by a `@token_graph` unit."""
