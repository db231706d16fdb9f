"""Request graphs inside token graphs, without CUDA: a decode recording given a `RegionRequest`
records its request-fixed eager regions again under the request's metadata, joins segments and
region graphs (and a whole step's before / after parts) with a logging fake backend, and a replay
with the request key launches the join. The real join: tests/gpu/test_region_graph_gpu.py."""

import pytest
import torch
from test_region_graph_cpu import LOG, FakeBackend, Layer, ToyModel, static_buffers, toy_attention

from atomrt.graphs import region_graph as rg
from atomrt.graphs.markers import eager_region, token_graph, token_graph_of
from atomrt.graphs.region_graph import TokenGraph
from atomrt.runtime.forward_context import Context, set_forward_context


@pytest.fixture(autouse=True)
def clean_log():
    LOG.clear()
    yield
    assert rg._active is None


class ComposingBackend(FakeBackend):
    """A FakeBackend that keeps segments when asked and joins them: a composite is the tuple of
    its parts, and launching it logs that tuple."""

    def begin(self, keep=False, part=False):
        super().begin()
        if keep:
            self.log[-1] = ("begin", self.open, "part" if part else "keep")

    def compose(self, parts):
        self.log.append(("compose", tuple(parts)))
        return tuple(parts)

    def launch(self, composite):
        self.log.append(("launch", composite))


@eager_region(request_fixed=True)
def fixed_attention(q: torch.Tensor, output: torch.Tensor, layer: int) -> None:
    from atomrt.runtime.forward_context import get_forward_context

    LOG.append(("eager", layer, get_forward_context().attn_metadata))


def test_region_request_graphs_join_the_recording_into_one_launch():
    """A decode recording given a RegionRequest records each request-fixed region again, as its
    own kept graph under the request's metadata; the segments and those graphs are joined in
    order, and a replay with the request key launches the join instead of segments + eager calls.
    Without the key (a prefill or mixed step at the bucket) the segments replay as before."""
    graph = TokenGraph(backend=ComposingBackend(LOG))
    x, out = torch.arange(4.0), torch.zeros(4)

    def forward(x):
        fixed_attention(x, out, 0)
        fixed_attention(x, out, 1)
        return out

    ctx = Context(running_tokens=4)
    with set_forward_context("host-planned", None, ctx):
        rec_out = graph.record(4, "decode", forward, x, request=rg.RegionRequest((4, 0), "safe"))
    assert LOG == [
        "session",
        ("begin", 0, "keep"),
        ("end", 0),
        ("eager", 0, "host-planned"),  # the region runs eagerly, with the recording's metadata
        ("begin", 1, "part"),  # its request graph: recorded under the request's metadata
        ("eager", 0, "safe"),
        ("end", 1),
        ("begin", 2, "keep"),
        ("end", 2),
        ("eager", 1, "host-planned"),
        ("begin", 3, "part"),
        ("eager", 1, "safe"),
        ("end", 3),
        ("begin", 4, "keep"),
        ("end", 4),
        "/session",
        ("compose", (0, 1, 2, 3, 4)),  # segment, region graph, segment, region graph, segment
    ]
    assert graph.req_keys() == [(4, 0)] and graph.num_segments(4, "decode") == 3
    LOG.clear()
    with set_forward_context("live", None, ctx):
        assert graph.replay(4, "decode", req_key=(4, 0)) is rec_out
        assert LOG == [("launch", (0, 1, 2, 3, 4))]
        LOG.clear()
        graph.replay(4, "decode")
        assert [e[:2] for e in LOG] == [
            ("replay", 0),
            ("eager", 0),
            ("replay", 2),
            ("eager", 1),
            ("replay", 4),
        ]
        LOG.clear()
        graph.replay(4, "decode", req_key=(2, 1))  # a key it holds no join for: segments
        assert LOG[0] == ("replay", 0) and len(LOG) == 5


def test_a_region_no_request_bucket_fixes_leaves_the_recording_segmented():
    graph = TokenGraph(backend=ComposingBackend(LOG))
    x, out = torch.arange(4.0), torch.zeros(4)

    def forward(x):
        fixed_attention(x, out, 0)
        toy_attention(x, out, 1)  # host-planned only
        return out

    with set_forward_context("meta", None, Context(running_tokens=4)):
        graph.record(4, "decode", forward, x, request=rg.RegionRequest((4, 0), "safe"))
    assert not [e for e in LOG if e[0] == "compose"] and graph.req_keys() == []
    LOG.clear()
    graph.replay(4, "decode", req_key=(4, 0))
    assert [e[0] for e in LOG] == ["replay", "eager", "replay", "eager", "replay"]


def test_the_unit_records_region_graphs_for_the_decode_pass_only():
    """`@token_graph` passes the forward context's tr_request to the decode recording (the prefill
    pass of the same bucket records nothing new) and its tr_req_key to a replay."""

    class FixedLayer(Layer):
        def forward(self, h):
            q = self.proj(h)
            o = torch.empty_like(q)
            fixed_attention(q, o, self.idx)
            return h + o

    @token_graph
    class FixedModel(ToyModel):
        def __init__(self):
            super().__init__(layers=2)
            self.layers = torch.nn.ModuleList(FixedLayer(i, 8) for i in range(2))

    model = FixedModel()
    log: list = []
    token_graph_of(model, backend=ComposingBackend(log))
    ids, pos = static_buffers()
    decode, prefill = Context(running_tokens=4), Context(running_tokens=4, is_prefill=True)
    with torch.inference_mode():
        request = rg.RegionRequest((4, 0), "safe")
        with set_forward_context("m", None, prefill, tr_graph="record", tr_request=request):
            model(ids[:4], pos[:4])  # a prefill pass: no region graphs, even with a key
        assert token_graph_of(model).req_keys() == []
        model2 = FixedModel()
        token_graph_of(model2, backend=ComposingBackend(log))
        with set_forward_context("m", None, decode, tr_graph="record", tr_request=request):
            out = model2(ids[:4], pos[:4])
        assert token_graph_of(model2).req_keys() == [(4, 0)]
        assert ("eager", 0, "safe") in LOG and ("eager", 1, "safe") in LOG
        log.clear()
        with set_forward_context("live", None, decode, tr_graph="replay", tr_req_key=(4, 0)):
            again = model2(ids[:4], pos[:4])
        assert [e[0] for e in log] == ["launch"] and again.data_ptr() == out.data_ptr()


def test_a_whole_step_request_joins_its_before_and_after_parts():
    """`before` is recorded ahead of the first segment and `after(output)` behind the last, while
    the output still owns its memory; `launch_step` runs the join and returns `after`'s result.
    A replay of the unit alone never runs that join (it would unpack and sample again)."""
    graph = TokenGraph(backend=ComposingBackend(LOG))
    x, out = torch.arange(4.0), torch.zeros(4)
    seen = []

    def forward(x):
        fixed_attention(x, out, 0)
        return out * 2

    def after(hidden):
        seen.append(hidden._base is None and hidden.data_ptr())
        LOG.append("after")
        return hidden + 1

    request = rg.RegionRequest((4, 0), "safe", before=lambda: LOG.append("before"), after=after)
    with set_forward_context("m", None, Context(running_tokens=4)):
        rec_out = graph.record(4, "decode", forward, x, request=request)
    assert [e if e[0] != "eager" else e[:3] for e in LOG] == [
        "session",
        ("begin", 0, "part"),
        "before",
        ("end", 0),
        ("begin", 1, "keep"),
        ("end", 1),
        ("eager", 0, "m"),
        ("begin", 2, "part"),
        ("eager", 0, "safe"),
        ("end", 2),
        ("begin", 3, "keep"),
        ("end", 3),
        ("begin", 4, "part"),
        "after",
        ("end", 4),
        "/session",
        ("compose", (0, 1, 2, 3, 4)),
    ]
    assert seen == [rec_out.data_ptr()]
    assert graph.step_keys() == [(4, 0)] and graph.req_keys() == []
    LOG.clear()
    result = graph.launch_step(4, "decode", (4, 0))
    assert LOG == [("launch", (0, 1, 2, 3, 4))] and result.shape == (4,)
    LOG.clear()
    graph.replay(4, "decode", req_key=(4, 0))
    assert [e[0] for e in LOG] == ["replay", "eager", "replay"]
    with pytest.raises(KeyError, match="no whole-step join"):
        graph.launch_step(4, "decode", (2, 1))
