# Hot path (worker, once per draft pass): whether a pass replays a recording or runs eagerly. What
# may live here: the drafters' shared graph bookkeeping; nothing that launches work.
"""`DraftRecordings`: what every drafter on the worker keeps about its graphs (the draft model's
`DraftModel`, MTP's `MTPDrafter`): one `DraftGraph` per kind of pass, the capture sizes they hold,
and the count of passes that ran eagerly with graphs on although a recording should have served
them (`EngineStats.spec_decode.num_eager_draft_passes`; `atomrt bench latency
--speculative-config` reports any as an error).

A drafter decides when a pass may replay (its own rule: the target's step kind, the ladder) and
asks `replays(key, rows)`, which finds the recording or counts the pass.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from atomrt.graphs.buckets import bucket_for
from atomrt.graphs.draft_graph import DraftGraph


class DraftRecordings:
    def __init__(self, enabled: bool, keys: Iterable[Hashable] = (None,)) -> None:
        """`enabled`: CUDA graphs on; `keys`: one DraftGraph each (none when graphs are off)."""
        self.enabled = enabled
        self.graphs: dict[Hashable, DraftGraph] = (
            {key: DraftGraph() for key in keys} if enabled else {}
        )
        self.capture_sizes: list[int] = []  # ascending, once captured
        self.num_eager_passes = 0  # passes that fit the ladder but ran eagerly (graphs on)

    def captured(self, sizes: Iterable[int]) -> None:
        """Capture recorded these sizes."""
        self.capture_sizes = sorted(set(sizes))

    def padded(self, rows: int) -> int:
        """The rows a pass of `rows` runs: the capture size it fits once captured, else `rows`."""
        if self.enabled and self.capture_sizes:
            return bucket_for(rows, self.capture_sizes) or rows
        return rows

    def beyond_ladder(self, rows: int) -> bool:
        """Whether `rows` exceeds every capture size (such a pass runs eagerly, uncounted)."""
        return bool(self.capture_sizes) and rows > self.capture_sizes[-1]

    def replays(self, key: Hashable, rows: int) -> bool:
        """Whether graph `key` holds a recording at `rows`; a pass that finds none is counted."""
        graph = self.graphs.get(key)
        if graph is not None and (rows, "decode") in graph:
            return True
        self.num_eager_passes += 1
        return False

    def take_eager_passes(self) -> int:
        """Passes counted since the last call."""
        n, self.num_eager_passes = self.num_eager_passes, 0
        return n
