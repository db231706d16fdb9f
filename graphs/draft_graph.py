"""`DraftGraph`: a drafter's own recordings (MTP / EAGLE passes), in either graph mode.

Placeholder (the guide's name): no drafter exists yet, so nothing records one.

Drafters are not marked `@token_graph`; a drafter records each of its passes with
`DraftGraph.record(num_tokens, phase, fn, *static_inputs)` and replays with
`DraftGraph.replay(num_tokens, phase)`, exactly as a TokenGraph: segments broken at eager regions,
recorded into `graph_pool()`, outputs valid until the next replay of any recording.
"""

from atomrt.graphs.region_graph import TokenGraph


class DraftGraph(TokenGraph):
    """A TokenGraph owned by a drafter rather than by a `@token_graph` unit."""
