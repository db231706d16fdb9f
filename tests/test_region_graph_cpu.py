"""Region-graph bookkeeping without CUDA: a fake segment backend logs begin / end / replay, so the
segment and eager-region sequencing, per-phase bucket reporting and the non-owning invariant are
checked on CPU. The real CUDA backend is tested in tests/gpu/test_region_graph_gpu.py.

Eager regions here only log (they never write at replay): on CPU nothing keeps a finished
recording's memory alive, so writing through its aliases would be a use-after-free.
"""

import contextlib
import gc
import weakref

import pytest
import torch

from atomrt.graphs import region_graph as rg
from atomrt.graphs.markers import (
    captured_token_sizes,
    eager_region,
    token_graph,
    token_graph_of,
    token_graph_units,
)
from atomrt.graphs.region_graph import ReqGraph, TokenGraph, non_owning_alias
from atomrt.runtime.forward_context import Context, set_forward_context


class FakeBackend:
    """Segments are numbers; every call is logged in order."""

    def __init__(self, log: list):
        self.log = log
        self.next_id = 0
        self.open = None

    @contextlib.contextmanager
    def session(self):
        self.log.append("session")
        yield
        self.log.append("/session")

    def begin(self, keep=False, part=False):
        assert self.open is None
        self.open = self.next_id
        self.next_id += 1
        self.log.append(("begin", self.open))

    def end(self):
        seg, self.open = self.open, None
        self.log.append(("end", seg))
        return seg

    def abort(self):
        if self.open is not None:
            self.log.append(("abort", self.end()))

    def replay(self, seg):
        self.log.append(("replay", seg))


LOG: list = []
SEEN: list = []  # weak references to the tensors eager regions were called with


@eager_region
def toy_attention(q: torch.Tensor, output: torch.Tensor, layer: int) -> None:
    from atomrt.runtime.forward_context import get_forward_context

    SEEN.append(weakref.ref(q))
    LOG.append(
        ("eager", layer, get_forward_context().attn_metadata, q.data_ptr(), output.data_ptr())
    )


class Layer(torch.nn.Module):
    def __init__(self, idx: int, hidden: int):
        super().__init__()
        self.idx = idx
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q = self.proj(h)
        out = torch.empty_like(q)
        toy_attention(q, out, self.idx)
        return h + out


@token_graph
class ToyModel(torch.nn.Module):
    def __init__(self, hidden: int = 8, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(32, hidden)
        self.layers = torch.nn.ModuleList(Layer(i, hidden) for i in range(layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + positions[:, None]
        for layer in self.layers:
            h = layer(h)
        return h


@token_graph(per_phase=True)
class PerPhaseModel(ToyModel):
    pass


class Outer(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.model = inner


@pytest.fixture(autouse=True)
def clean_log():
    LOG.clear()
    SEEN.clear()
    yield
    assert rg._active is None


def static_buffers(n: int = 16):
    return torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)


def run(model, ids, pos, n, tr_graph, is_prefill=False, meta="meta"):
    ctx = Context(is_prefill=is_prefill, running_tokens=n)
    with set_forward_context(meta, None, ctx, tr_graph=tr_graph), torch.inference_mode():
        return model(ids[:n], pos[:n])


def test_eager_region_passthrough_outside_recording():
    q = torch.ones(2, 3)
    out = torch.empty_like(q)
    assert toy_attention(q, out, 7) is None
    assert LOG == [("eager", 7, None, q.data_ptr(), out.data_ptr())]
    assert toy_attention.__name__ == "toy_attention" and toy_attention.__atomrt_eager_region__


def test_unit_runs_forward_without_tr_graph():
    model = ToyModel()
    log: list = []
    token_graph_of(model, backend=FakeBackend(log))
    ids, pos = static_buffers()
    out = run(model, ids, pos, 4, tr_graph=None)
    assert out.shape == (4, 8) and log == [] and len(token_graph_of(model)) == 0
    assert [e[0] for e in LOG] == ["eager", "eager"]


def test_record_breaks_at_each_eager_region_and_replay_interleaves():
    model = ToyModel(layers=2)
    graph = token_graph_of(
        model, backend=FakeBackend(LOG)
    )  # backend and eager regions share one log
    ids, pos = static_buffers()

    out = run(model, ids, pos, 4, tr_graph="record", meta="capture-meta")
    assert graph.num_segments(4, "decode") == 3
    eager = [e for e in LOG if e[0] == "eager"]
    assert [e if e[0] != "eager" else e[:3] for e in LOG] == [
        "session",
        ("begin", 0),
        ("end", 0),
        ("eager", 0, "capture-meta"),  # eager regions run eagerly at record, between segments
        ("begin", 1),
        ("end", 1),
        ("eager", 1, "capture-meta"),
        ("begin", 2),
        ("end", 2),
        "/session",
    ]

    LOG.clear()
    again = run(model, ids, pos, 4, tr_graph="replay", meta="live-meta")
    assert [e if e[0] != "eager" else e[:3] for e in LOG] == [
        ("replay", 0),
        ("eager", 0, "live-meta"),  # with the live step's metadata
        ("replay", 1),
        ("eager", 1, "live-meta"),
        ("replay", 2),
    ]
    # On the recorded addresses; the output is the recorded output.
    assert [e[3:] for e in LOG if e[0] == "eager"] == [e[3:] for e in eager]
    assert again.data_ptr() == out.data_ptr() and again.shape == (4, 8)


def test_recording_keeps_no_owning_reference():
    model = ToyModel(layers=2)
    token_graph_of(model, backend=FakeBackend([]))
    ids, pos = static_buffers()
    out = run(model, ids, pos, 8, tr_graph="record")
    del out
    gc.collect()
    assert len(SEEN) == 2 and all(ref() is None for ref in SEEN)  # eager args freed after recording
    rec = token_graph_of(model)._recordings[(8, None)]
    for call in rec.eager_calls:
        q = call.args[0]
        assert isinstance(q, torch.Tensor) and q.shape == (8, 8)


def test_captured_sizes_per_phase_shared_recordings():
    model = ToyModel()
    log: list = []
    graph = token_graph_of(model, backend=FakeBackend(log))
    ids, pos = static_buffers()
    for n in (4, 2, 1):
        run(model, ids, pos, n, tr_graph="record", is_prefill=False)
    assert graph.captured_sizes("decode") == [1, 2, 4] and graph.captured_sizes("prefill") == []
    log.clear()
    for n in (8, 4):
        run(model, ids, pos, n, tr_graph="record", is_prefill=True)
    assert graph.captured_sizes("prefill") == [4, 8] and graph.captured_sizes("decode") == [1, 2, 4]
    assert (
        len(graph) == 4
    )  # bucket 4 serves both phases: recorded once, replayed for the prefill ask
    assert log.count("session") == 1 and ("replay", 0) in log
    assert (4, "prefill") in graph and (8, "decode") in graph and (16, "decode") not in graph


def test_per_phase_unit_records_each_phase():
    model = PerPhaseModel()
    graph = token_graph_of(model, backend=FakeBackend([]))
    assert graph.per_phase
    ids, pos = static_buffers()
    run(model, ids, pos, 4, tr_graph="record", is_prefill=False)
    run(model, ids, pos, 4, tr_graph="record", is_prefill=True)
    assert len(graph) == 2 and graph.captured_sizes("prefill") == [4] == graph.captured_sizes(
        "decode"
    )
    assert (4, "decode") in graph and (8, "decode") not in graph


def test_replay_checks_static_buffers_and_bucket():
    model = ToyModel()
    token_graph_of(model, backend=FakeBackend([]))
    ids, pos = static_buffers()
    run(model, ids, pos, 4, tr_graph="record")
    other_ids, other_pos = static_buffers()
    with pytest.raises(AssertionError, match="static input buffers"):
        run(model, other_ids, other_pos, 4, tr_graph="replay")
    with pytest.raises(KeyError, match="no token graph recorded for 8 rows"):
        run(model, ids, pos, 8, tr_graph="replay")


def test_record_asserts_running_tokens_matches_rows():
    model = ToyModel()
    token_graph_of(model, backend=FakeBackend([]))
    ids, pos = static_buffers()
    ctx = Context(running_tokens=8)
    with set_forward_context(None, None, ctx, tr_graph="record"), pytest.raises(AssertionError):
        model(ids[:4], pos[:4])


def test_eager_region_returning_a_new_tensor_is_rejected():
    @eager_region
    def bad(q: torch.Tensor) -> torch.Tensor:
        return q * 2

    log: list = []
    graph = TokenGraph(backend=FakeBackend(log))
    with pytest.raises(TypeError, match="output argument"):
        graph.record(2, "decode", lambda x: bad(x + 1), torch.ones(2))
    assert rg._active is None and len(graph) == 0

    @eager_region
    def returns_its_output(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out

    out = graph.record(
        2, "decode", lambda x: returns_its_output(x, torch.empty_like(x)) + 1, torch.ones(2)
    )
    assert out.shape == (2,) and graph.num_segments(2, "decode") == 2


def test_error_inside_a_segment_aborts_the_capture():
    log: list = []
    graph = TokenGraph(backend=FakeBackend(log))

    def boom(x):
        raise ValueError("model bug")

    with pytest.raises(ValueError, match="model bug"):
        graph.record(2, "decode", boom, torch.ones(2))
    assert ("abort", 0) in log and rg._active is None and len(graph) == 0


def test_req_graph_records_eager_regions_inline():
    log: list = []
    req = ReqGraph(backend=FakeBackend(log))
    model = ToyModel()
    ids, pos = static_buffers()

    def full_forward():
        return model(ids[:4], pos[:4])

    with (
        set_forward_context("capture-meta", None, Context(running_tokens=4)),
        torch.inference_mode(),
    ):
        out = req.record((4, 0), full_forward)
    assert log == ["session", ("begin", 0), ("end", 0), "/session"]
    assert len(LOG) == 2  # the eager regions ran inside the one segment
    assert (4, 0) in req and (2, 0) not in req and req.keys() == [(4, 0)] and len(req) == 1
    log.clear()
    LOG.clear()
    again = req.replay((4, 0))
    assert log == [("replay", 0)] and LOG == [] and again.data_ptr() == out.data_ptr()
    with pytest.raises(AssertionError):
        req.record((4, 0), full_forward)


def test_units_in_a_model_and_their_sizes():
    inner = ToyModel()
    model = Outer(inner)
    assert token_graph_units(model) == [inner]
    assert captured_token_sizes(model, "decode") == []
    token_graph_of(inner, backend=FakeBackend([]))
    ids, pos = static_buffers()
    for n in (2, 1):
        run(inner, ids, pos, n, tr_graph="record")
    assert (
        captured_token_sizes(model, "decode") == [1, 2]
        and captured_token_sizes(model, "prefill") == []
    )
    assert captured_token_sizes(torch.nn.Linear(2, 2), "decode") == []


def test_nested_unit_runs_inline_inside_a_recording():
    @token_graph
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = ToyModel()

        def forward(self, ids, pos):
            return self.inner(ids, pos) * 2

    model = Wrapper()
    token_graph_of(model, backend=FakeBackend([]))
    token_graph_of(model.inner, backend=FakeBackend([]))
    ids, pos = static_buffers()
    run(model, ids, pos, 4, tr_graph="record")
    assert len(token_graph_of(model)) == 1 and len(token_graph_of(model.inner)) == 0


def test_token_graph_marks_modules_only():
    with pytest.raises(TypeError):
        token_graph(object)
    with pytest.raises(TypeError):
        token_graph_of(torch.nn.Linear(2, 2))


def test_non_owning_alias():
    base = torch.arange(24.0).reshape(4, 6)
    view = base[1:, ::2]  # non-contiguous, offset
    alias = non_owning_alias(view)
    assert (
        alias.data_ptr() == view.data_ptr()
        and alias.shape == view.shape
        and alias.stride() == view.stride()
    )
    assert torch.equal(alias, view)
    base[2, 2] = -1.0
    assert alias[1, 1] == -1.0
    ref = weakref.ref(base)
    del base, view
    gc.collect()
    assert ref() is None  # the alias kept nothing alive
    empty = non_owning_alias(torch.empty(0, 3))
    assert empty.shape == (0, 3)


def _op_impl(x: torch.Tensor, output: torch.Tensor, tag: int) -> None:
    LOG.append(("op", tag))


def test_eager_region_as_a_custom_op_impl_breaks_even_under_torch_compile():
    """The attention op registers its @eager_region impl: the break happens at run time, inside the
    dispatcher call, so compiled code (opaque custom op) breaks the recording as eager code does."""
    from torch.library import Library

    from atomrt.compile.custom_register import direct_register_custom_op

    lib = Library("atomrt_rg_test", "FRAGMENT")
    direct_register_custom_op(
        "toy_op",
        eager_region(_op_impl),
        mutates_args=["output"],
        fake_impl=lambda x, output, tag: None,
        target_lib=lib,
    )

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        out = torch.empty_like(y)
        torch.ops.atomrt_rg_test.toy_op(y, out, 3)
        return out * 2

    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    for fn in (forward, compiled):
        LOG.clear()
        graph = TokenGraph(backend=FakeBackend(LOG))
        x = torch.ones(4)
        fn(x)  # warm-up (compiles), outside any recording: no break
        assert LOG == [("op", 3)]
        LOG.clear()
        graph.record(4, "decode", fn, x)
        assert LOG == [
            "session",
            ("begin", 0),
            ("end", 0),
            ("op", 3),
            ("begin", 1),
            ("end", 1),
            "/session",
        ]
        LOG.clear()
        graph.replay(4, "decode", x)
        assert LOG == [("replay", 0), ("op", 3), ("replay", 1)]
    del lib


def test_a_bound_eager_region_runs_its_binding_at_replay():
    """`eager_region(bind=...)`: the binder gets the kept arguments once, at the recording; every
    replay runs what it returned, between the same segments, and never the region itself."""
    log: list = []
    bound_with: list = []

    def binder(q: torch.Tensor, out: torch.Tensor, scale: float):
        bound_with.append((q.data_ptr(), out.data_ptr(), scale))

        def run() -> None:
            out.copy_(q * scale)
            log.append("bound")

        return run

    @eager_region(bind=binder)
    def scaled(q: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        out.copy_(q * scale)
        log.append("region")

    graph = TokenGraph(backend=FakeBackend(log))
    x, out = torch.arange(2.0), torch.zeros(2)

    def forward(x):
        scaled(x, out, 3.0)
        return out

    graph.record(2, "decode", forward, x)
    assert bound_with == [(x.data_ptr(), out.data_ptr(), 3.0)] and "region" in log
    log.clear()
    x.copy_(torch.tensor([5.0, 7.0]))
    graph.replay(2, "decode")
    assert log == [("replay", 0), "bound", ("replay", 1)]
    assert out.tolist() == [15.0, 21.0]
    assert scaled(x, out, 1.0) is None and log[-1] == "region"  # outside a recording: the region
