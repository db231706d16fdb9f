"""split_graph, the piecewise backend and the custom dispatcher, without Inductor (fast).

Level 3 with `use_inductor=False` runs the same split / interpreter / PiecewiseBackend path as
production with each piece left as traced FX code; test_compile_inductor.py repeats the
end-to-end checks with Inductor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_compile_toys import ToyModelEager, inputs, make_config, make_models, max_diff

from atomrt.compile import (
    PiecewiseBackend,
    SplitItem,
    TorchCompileWrapperWithCustomDispatcher,
    compilation_counter,
    compile_model,
    split_graph,
    support_torch_compile,
)
from atomrt.compile.backends import CopyInputsToStaticBuffers


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    compilation_counter.reset()
    yield


def _dynamo_graph(model: nn.Module, num_tokens: int = 8) -> tuple[torch.fx.GraphModule, list]:
    """Dynamo's graph of `model` and the real arguments it was traced with."""
    captured: list = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        captured.append(
            (gm, [num_tokens if isinstance(x, torch.SymInt) else x for x in example_inputs])
        )
        return gm.forward

    ids, pos = inputs(num_tokens)
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    torch.compile(model, backend=capture, fullgraph=True, dynamic=False)(ids, pos)
    assert len(captured) == 1
    return captured[0]


def _count_calls(gm: torch.fx.GraphModule, op: object) -> int:
    return sum(
        1
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "overloadpacket", n.target) is op
    )


@pytest.mark.parametrize("num_layers", [1, 3])
def test_split_has_one_piece_more_than_splitting_calls(num_layers):
    gm, args = _dynamo_graph(ToyModelEager(num_layers=num_layers))
    before = gm.code
    split_gm, items = split_graph(gm, ["atomrt.test_attn"])
    assert gm.code == before, "split_graph must not modify its input"
    assert all(isinstance(i, SplitItem) for i in items)
    assert [i.graph_id for i in items] == sorted(i.graph_id for i in items)
    splitting = [i for i in items if i.is_splitting_graph]
    pieces = [i for i in items if not i.is_splitting_graph]
    assert len(splitting) == _count_calls(gm, torch.ops.atomrt.test_attn) == num_layers
    assert len(pieces) == num_layers + 1
    for item in splitting:  # each splitting piece holds exactly the op call
        assert _count_calls(item.graph, torch.ops.atomrt.test_attn) == 1
    # Pieces alternate and the stitched module computes what the graph computes.
    assert [i.is_splitting_graph for i in items] == [k % 2 == 1 for k in range(len(items))]
    torch.testing.assert_close(split_gm(*args), gm(*args))


def test_split_is_driven_by_the_configured_list():
    gm, _ = _dynamo_graph(ToyModelEager(num_layers=4, two_ops=True))
    _, both = split_graph(gm, ["atomrt.test_attn", "atomrt.test_mix"])
    _, attn_only = split_graph(gm, ["atomrt.test_attn"])
    _, mix_only = split_graph(gm, ["atomrt.test_mix.default"])  # an overload name works too
    _, none = split_graph(gm, [])
    assert sum(i.is_splitting_graph for i in both) == 4
    assert len([i for i in both if not i.is_splitting_graph]) == 5
    assert sum(i.is_splitting_graph for i in attn_only) == 2
    assert sum(i.is_splitting_graph for i in mix_only) == 2
    assert len(none) == 1 and not none[0].is_splitting_graph
    # Unregistered names split nothing; malformed names are a user error.
    _, unknown = split_graph(gm, ["atomrt.no_such_op"])
    assert len(unknown) == 1
    with pytest.raises(ValueError, match="splitting_ops"):
        split_graph(gm, ["no_namespace"])


@pytest.mark.parametrize("two_ops", [False, True])
def test_levels_agree_without_inductor(tmp_path, two_ops):
    torch.manual_seed(0)
    for level in (0, 1):
        model, eager = make_models(make_config(level, str(tmp_path)), two_ops=two_ops)
        assert model.do_not_compile
        assert compile_model(model, model.atomrt_config) is model
        assert max_diff(model, eager) == 0.0
    model, eager = make_models(make_config(3, str(tmp_path), use_inductor=False), two_ops=two_ops)
    assert not model.do_not_compile
    assert max_diff(model, eager) <= 1e-6
    pieces = [
        v
        for v in model.compile_backend.split_gm.__dict__.values()
        if isinstance(v, PiecewiseBackend)
    ]
    assert len(pieces) == 3  # two splitting calls -> three compiled pieces
    assert all(set(p.concrete_size_entries) == {4} for p in pieces)
    assert all(p.concrete_size_entries[4].compiled for p in pieces)  # 4 ran after the first call
    assert compilation_counter.num_inductor_compiles == 0


def test_level1_compiles_with_dynamo_only(tmp_path):
    model, eager = make_models(make_config(1, str(tmp_path)))
    compile_model(model, model.atomrt_config)
    assert model._compiled_call_impl is not None
    assert max_diff(model, eager) == 0.0


def test_custom_dispatcher_skips_guards(tmp_path):
    model, eager = make_models(make_config(3, str(tmp_path), use_inductor=False))
    ids, pos = inputs(8)
    model(ids, pos)
    assert len(model.compiled_codes) == 1
    frames = torch._dynamo.utils.counters["frames"]["total"]
    # Dynamo guards on this attribute; through the dispatcher nothing re-checks it, so the compiled
    # code keeps the traced branch and Dynamo sees no new frame.
    model.scale_output = True
    eager.scale_output = True
    with torch.no_grad():
        out = model(ids, pos)
        torch.testing.assert_close(out * 2.0, eager(ids, pos))
    assert torch._dynamo.utils.counters["frames"]["total"] == frames


def test_more_instances_than_the_recompile_limit(tmp_path):
    """Every LLM in a process compiles its own model: past Dynamo's recompile limit (8 per code
    object) the instances still compile, and each gives eager's output."""
    limit = torch._dynamo.config.recompile_limit
    for i in range(limit + 3):
        model, eager = make_models(make_config(3, str(tmp_path), use_inductor=False))
        assert max_diff(model, eager) <= 1e-6, f"instance {i}"
        assert model._compiled_forward is not None, (
            f"instance {i} runs through the custom dispatcher"
        )


class _BufferUpdater(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1  # assigns a buffer: forbidden in a compiled forward
        return self.proj(x) + self.steps


def test_buffer_update_in_forward_is_refused(tmp_path):
    cls = support_torch_compile(_BufferUpdater)
    model = cls(config=make_config(2, str(tmp_path), use_inductor=False))
    with pytest.raises(RuntimeError, match="buffers.*CUDA graphs"):
        model(torch.randn(4, 8))


def test_decorator_makes_a_subclass_once():
    cls = support_torch_compile(ToyModelEager)
    assert cls.__mro__[1:3] == (TorchCompileWrapperWithCustomDispatcher, ToyModelEager)
    assert cls.__name__ == "ToyModelEager" and ToyModelEager.__bases__ == (nn.Module,)
    plain = cls(num_layers=1)  # no config: eager
    assert plain.do_not_compile
    with pytest.raises(TypeError, match="nn.Module"):
        support_torch_compile(int)


def test_first_compiled_call_needs_two_rows(tmp_path):
    model, _ = make_models(make_config(3, str(tmp_path), use_inductor=False))
    with pytest.raises(ValueError, match=">= 2 rows"):
        model(*inputs(1))


def test_debug_dump_and_computation_graph(tmp_path):
    dump = tmp_path / "dump"
    model, eager = make_models(
        make_config(3, str(tmp_path / "cache"), use_inductor=False, debug_dump_path=str(dump))
    )
    assert max_diff(model, eager, [8]) <= 1e-6
    rank_dir = dump / "rank_0"
    assert (rank_dir / "computation_graph.py").read_text().count("submod_") >= 5
    assert "test_attn" in (rank_dir / "traced_graph_backbone.py").read_text()
    assert "original source" in (rank_dir / "transformed_code_backbone.txt").read_text()
    assert (model.compile_backend.cache_dir / "computation_graph.py").is_file()


def test_cudagraph_copy_inputs_uses_static_buffers(tmp_path):
    model, eager = make_models(
        make_config(3, str(tmp_path), use_inductor=False, cudagraph_copy_inputs=True)
    )
    assert max_diff(model, eager) <= 1e-6
    ids, pos = inputs(3)
    model(ids, pos)
    copier = model.compile_backend.compiled_callable
    assert isinstance(copier, CopyInputsToStaticBuffers)
    assert copier.buffers and all(
        b.shape[0] == 8 for b in copier.buffers
    )  # max(first call 8, capture 8)
    assert torch.equal(
        copier.buffers[copier.indices.index(_input_index(model, "l_input_ids_"))][:3], ids
    )


def _input_index(model, name: str) -> int:
    """Position of a forward argument among the stitching graph's placeholders."""
    placeholders = [
        n.name for n in model.compile_backend.split_gm.graph.nodes if n.op == "placeholder"
    ]
    return placeholders.index(name)
