"""Dynamo's trace kept beside the compile cache: a warm start calls the model without tracing it.

At levels 2 and 3 a decorated model's first call runs Dynamo, which turns `forward` into an FX
graph and bytecode that gathers the graph's inputs (the call's tensors, their sizes, the module's
parameters and buffers) and calls the compiled graph. The compile cache keeps the compiled pieces,
but every process used to trace again: seconds of Python before the first piece loads.

When Dynamo's bytecode does nothing but gather inputs and return the graph's one output,
`capture()` records the graph (each node's op, name, target and arguments), each input's source
(`L['self']._modules['norm']._parameters['weight']`, `L['input_ids'].size()[0]`), the modules
whose code Dynamo traced, and Dynamo's guards on the trace (compile/trace_guards.py); the entry is
kept where compile/trace_store.py says, found only by a process that imports the same code.
That process checks the guards against its first call (a global the forward reads, a class
attribute, which parameters are one tensor, the grad mode, ...), rebuilds the graph, makes fake
inputs of the traced kinds (dim 0 of each dynamic argument symbolic), hands both to the backend,
which loads its pieces as after a trace, and calls the result through `forward_calling()`, a
function generated from the sources. The tracing process calls through the same generated
function, so a traced start and a warm one run the same code. Anything the entry cannot express
(a graph attribute or submodule, an unknown target or argument kind, bytecode with side effects,
more than one output, a guard that cannot be checked in another process) keeps Dynamo's bytecode
and writes no entry.
"""

from __future__ import annotations

import ast
import dis
import inspect
import logging
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from atomrt.compile.trace_guards import Guards, Ineligible, object_ref, plain_value, resolve

logger = logging.getLogger("atomrt.compile.trace_cache")

FORMAT = 2

# What Dynamo's bytecode may read besides the attribute paths of the inputs' sources: the compiled
# graph (a global `__compiled_fn_*`) and these utilities. Anything else (a store, another global,
# another attribute) may be a side effect the generated forward would not replay.
_DYNAMO_UTILS = {"call_size", "record_pregraph_bytecode_enter", "record_pregraph_bytecode_exit"}
_GLOBALS = ("__compiled_fn", "__import_torch_dot__dynamo_dot_utils")
_STORES = {
    "STORE_ATTR",
    "STORE_GLOBAL",
    "STORE_SUBSCR",
    "STORE_DEREF",
    "DELETE_ATTR",
    "DELETE_GLOBAL",
    "DELETE_SUBSCR",
    "IMPORT_NAME",
}
_LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)


@dataclass(frozen=True)
class _Ref:
    """A graph node named in another node's arguments."""

    name: str


@dataclass
class TracedForward:
    """One decorated model's trace: enough to rebuild the graph and call it without Dynamo."""

    # (op, name, target reference, args, kwargs, type, stack trace), in graph order; the type
    # (an input's annotation) and the stack trace (the source line the generated code names) make
    # the pieces' code, the compile cache's fingerprint, come out as after a trace
    nodes: list
    # per graph input, in order: (source expression, dtype or None for a SymInt, static dims with
    # None where the dim is symbolic)
    inputs: list
    modules: list  # the modules whose code Dynamo traced, by name
    source_hash: str  # their files' hash when traced (Sources.hash)
    guards: Guards  # Dynamo's guards on the trace (compile/trace_guards.py)
    format: int = FORMAT


@dataclass(frozen=True)
class Sources:
    """The modules a trace covers, the files this process imports them from, and their hash."""

    modules: list[str]
    files: list[str]
    hash: str


def plain_attributes(model: torch.nn.Module) -> dict[str, Any]:
    """Every plain attribute of `model` and its submodules, by dotted name (`layers.0.calls`)."""
    found = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if not key.startswith("_") and plain_value(value):
                found[f"{name}.{key}" if name else key] = value
    return found


# ---- capture ----------------------------------------------------------------------------------


def _target_ref(target: Any) -> tuple:
    if isinstance(target, str):
        return ("str", target)
    try:
        return object_ref(target)
    except Ineligible:
        raise Ineligible(f"graph target {target!r} has no importable name") from None


def _resolve(ref: tuple) -> Any:
    return ref[1] if ref[0] == "str" else resolve(ref)


def _map_nested(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """`value` with every leaf inside its slices, tuples, lists and dicts replaced by `leaf(it)`."""
    if isinstance(value, slice):
        return slice(*(_map_nested(v, leaf) for v in (value.start, value.stop, value.step)))
    if isinstance(value, tuple):
        return tuple(_map_nested(v, leaf) for v in value)
    if isinstance(value, list):  # FX's immutable lists come out as plain ones
        return [_map_nested(v, leaf) for v in value]
    if isinstance(value, dict):
        return {k: _map_nested(v, leaf) for k, v in value.items()}
    return leaf(value)


def _plain_leaf(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return _Ref(value.name)
    if isinstance(value, _LITERALS) or value is Ellipsis or isinstance(value, torch.memory_format):
        return value
    raise Ineligible(f"graph argument {value!r} ({type(value).__name__}) cannot be kept")


def _plain(value: Any) -> Any:
    """A node argument with nodes as `_Ref`s and containers as plain ones; Ineligible for a value
    the entry could not rebuild."""
    return _map_nested(value, _plain_leaf)


def _check_bytecode(code: types.CodeType, sources: list[str]) -> None:
    """Dynamo's bytecode must only read: the compiled graph and its utilities module (globals),
    the attribute paths of the inputs' sources and the utilities it calls (attributes)."""
    attributes = set(_DYNAMO_UTILS)
    for source in sources:
        attributes.update(re.findall(r"\w+", source))
    for instruction in dis.get_instructions(code):
        name = instruction.opname
        if name in _STORES:
            raise Ineligible(f"Dynamo's bytecode has {name} {instruction.argval}")
        if name in ("LOAD_GLOBAL", "LOAD_NAME"):
            if not str(instruction.argval).startswith(_GLOBALS):
                raise Ineligible(f"Dynamo's bytecode reads the global {instruction.argval!r}")
        elif name in ("LOAD_ATTR", "LOAD_METHOD") and instruction.argval not in attributes:
            raise Ineligible(f"Dynamo's bytecode reads the attribute {instruction.argval!r}")


def capture(
    graph: torch.fx.GraphModule,
    example_inputs: list,
    code: types.CodeType,
    output: Any,
    sources: Sources,
    guards: Guards,
) -> TracedForward:
    """The trace of one model; Ineligible where it cannot be kept."""
    nodes = []
    inputs = []
    for node, example in zip(
        (n for n in graph.graph.nodes if n.op == "placeholder"), example_inputs
    ):
        source = getattr(node, "_dynamo_source", None)
        if source is None:
            raise Ineligible(f"graph input {node.name} has no Dynamo source")
        expression = source.name() if callable(source.name) else source.name
        if isinstance(example, torch.SymInt):
            inputs.append((expression, None, None))
        elif isinstance(example, torch.Tensor):
            value = node.meta.get("example_value")
            if not isinstance(value, torch.Tensor):
                raise Ineligible(f"graph input {node.name} has no example value")
            dims = [d if isinstance(d, int) else None for d in value.shape]
            inputs.append((expression, example.dtype, dims))
        else:
            raise Ineligible(f"graph input {node.name} is a {type(example).__name__}")
    expressions = [expression for expression, _, _ in inputs]
    for expression in expressions:
        _python_expression(expression)
    _check_bytecode(code, expressions)
    for node in graph.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            raise Ineligible(f"the graph reads module state ({node.op} {node.target})")
        nodes.append(
            (
                node.op,
                node.name,
                _target_ref(node.target),
                _plain(tuple(node.args)),
                _plain(dict(node.kwargs)),
                None if node.type is None else _target_ref(node.type),
                node.meta.get("stack_trace"),
            )
        )
    returned = nodes[-1][3][0]
    if not (
        isinstance(output, torch.Tensor) and isinstance(returned, tuple) and len(returned) == 1
    ):
        raise Ineligible("forward does not return the graph's one output")
    return TracedForward(nodes, inputs, sources.modules, sources.hash, guards)


# ---- rebuild and call -------------------------------------------------------------------------


def rebuild_graph(traced: TracedForward) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    by_name: dict[str, torch.fx.Node] = {}

    def real(value: Any) -> Any:
        return _map_nested(value, lambda v: by_name[v.name] if isinstance(v, _Ref) else v)

    for op, name, target, args, kwargs, type_ref, stack_trace in traced.nodes:
        resolved = _resolve(target)
        type_expr = None if type_ref is None else _resolve(type_ref)
        if resolved is None or (type_ref is not None and type_expr is None):
            raise Ineligible(f"graph target {target} or type {type_ref} no longer exists")
        node = graph.create_node(
            op, resolved, real(args), real(kwargs), name=name, type_expr=type_expr
        )
        if stack_trace is not None:
            node.meta["stack_trace"] = stack_trace
        if node.name != name:
            raise Ineligible(f"graph node {name} came back as {node.name}")
        by_name[name] = node
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _python_expression(source: str) -> str:
    """A source expression with `L['name']` as the local `name`; Ineligible unless what is left
    reads attributes, subscripts with constants and `.size()`."""
    text = re.sub(r"L\['(\w+)'\]", r"\1", source)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise Ineligible(f"source {source!r} is not an expression") from e
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if not (
                isinstance(node.func, ast.Attribute)
                and node.func.attr == "size"
                and not node.args
                and not node.keywords
            ):
                raise Ineligible(f"source {source!r} calls something")
        elif not isinstance(
            node, (ast.Expression, ast.Attribute, ast.Subscript, ast.Constant, ast.Name, ast.Load)
        ):
            raise Ineligible(f"source {source!r} has a {type(node).__name__}")
    return text


def forward_calling(compiled: Callable, traced: TracedForward, forward: Callable) -> Callable:
    """A function with `forward`'s parameters that reads the graph's inputs from them (each
    source as Dynamo's bytecode reads it, on every call) and returns the compiled graph's output."""
    signature = inspect.signature(forward)
    params = []
    defaults: dict[str, Any] = {}
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise Ineligible(f"forward takes *{param.name}")
        text = param.name
        if param.default is not param.empty:
            defaults[f"__default_{param.name}"] = param.default
            text += f"=__default_{param.name}"
        if param.kind == param.KEYWORD_ONLY and "*" not in params:
            params.append("*")
        params.append(text)
    arguments = ", ".join(_python_expression(source) for source, _, _ in traced.inputs)
    source = (
        f"def {forward.__name__}({', '.join(params)}):\n    return __compiled({arguments})[0]\n"
    )
    namespace: dict[str, Any] = {"__compiled": compiled, **defaults}
    exec(compile(source, f"<atomrt traced {forward.__qualname__}>", "exec"), namespace)
    return namespace[forward.__name__]


def example_inputs(
    traced: TracedForward, bound_arguments: dict[str, Any]
) -> tuple[list, list, Any]:
    """The backend's example inputs for a rebuilt graph: the real tensors and parameters of this
    call (checked against the traced dtypes and static dims) and each size input as a SymInt; with
    them, each input's fake (dim 0 of a dynamic argument symbolic, every other dim static) and the
    fake mode that made them. The caller holds the fakes while the backend runs: the fake mode
    finds a real tensor's fake only while the fake is alive. Ineligible where this call does not
    match the trace."""
    from torch._dynamo.source import LocalSource
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    fake_mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False))
    fake_scope: dict[str, Any] = {}
    values: list = []
    fakes: list = []
    for source, dtype, dims in traced.inputs:
        if dtype is None:  # a size: below, once the tensors it measures have fakes
            values.append(None)
            fakes.append(None)
            continue
        value = eval(_python_expression(source), {}, dict(bound_arguments))
        if not isinstance(value, torch.Tensor) or value.dtype != dtype:
            raise Ineligible(f"{source} is no longer a {dtype} tensor")
        if value.dim() != len(dims) or any(
            d is not None and d != s for d, s in zip(dims, value.shape)
        ):
            raise Ineligible(f"{source} has shape {tuple(value.shape)}, traced {dims}")
        name = re.fullmatch(r"L\['(\w+)'\]", source)
        if None in dims and name is None:
            raise Ineligible(f"{source} has a symbolic dim but is not an argument")
        context = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d is None else DimDynamic.STATIC for d in dims]
        )
        fake = fake_mode.from_tensor(
            value, symbolic_context=context, source=LocalSource(name.group(1) if name else source)
        )
        if name is not None:
            fake_scope[name.group(1)] = fake
        values.append(value)
        fakes.append(fake)
    for i, (source, dtype, _) in enumerate(traced.inputs):
        if dtype is None:
            size = eval(_python_expression(source), {}, fake_scope)
            if not isinstance(size, torch.SymInt):
                raise Ineligible(f"{source} is not a size of a dynamic argument")
            values[i] = fakes[i] = size
    return values, fakes, fake_mode


def propagate(graph: torch.fx.GraphModule, fakes: list, fake_mode: Any) -> None:
    """Give every node of a rebuilt graph the `example_value` Dynamo's would have: what splitting
    reads to pass sizes on to the pieces that use them."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(graph, fake_mode).propagate_dont_convert_inputs(*fakes)
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    for node, fake in zip(placeholders, fakes):
        node.meta["example_value"] = fake
    for node in graph.graph.nodes:
        if node.op != "placeholder" and "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
