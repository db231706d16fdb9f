"""Dynamo's guards on a kept trace, recorded so that another process can check them itself.

Dynamo guards every graph it traces: the call's tensors (type, dtype, device, the sizes and strides
that are not dynamic), each value the trace read and folded into the graph (a module global, a
class or instance attribute, a function, a module's hook dicts), which sources are one object
(tied parameters, shared modules), the relations of the dynamic sizes, and the global state (grad
mode, default dtype, threads, ...). A process that builds a model from a kept trace runs no Dynamo,
so it checks the same things itself, before the trace is used:

- each guard is recorded as the path that reads the guarded value (`L['self']._modules['norm']`,
  `G['SCALE']`, `dict(type(L['self']).__dict__)['factor']`) and what Dynamo compared it with;
- the path is read again in the loading process: a global in the decorated forward's module, a
  module that Dynamo names `__import_a_dot_b` through this process's `import a.b`;
- a value compared by identity (a function, a module, a class) is recorded by its importable name
  and compared with what that name is in this process; a class read as a type, by the names of
  its bases; a compared value, by itself (numbers, strings, flags, dtypes, devices, tuples of them).

A guard of a kind not listed in `record()`, or on a value none of these can name, makes the trace
`Ineligible`: it is not kept. The shape relations are Dynamo's own Python text over the call's
sizes (`2 <= L['input_ids'].size()[0]`), evaluated on the first call of the loading process.
"""

from __future__ import annotations

import ast
import builtins
import collections
import enum
import functools
import importlib
import math
import operator
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

_LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)
_FUNCTION_HOMES = (torch, torch.nn.functional, torch._C._nn, operator, math, builtins)
# guards on state that no path reads: global_state() covers what each checks
_GLOBAL_STATE_GUARDS = {
    "GLOBAL_STATE",
    "GRAD_MODE",
    "DETERMINISTIC_ALGORITHMS",
    "TORCH_FUNCTION_STATE",
    "DEFAULT_DEVICE",
    "AUTOGRAD_SAVED_TENSORS_HOOKS",
}
_IDENTITY_GUARDS = {
    "ID_MATCH",
    "MODULE_MATCH",
    "FUNCTION_MATCH",
    "CLASS_MATCH",
    "BUILTIN_MATCH",
    "CLOSURE_MATCH",
}


class Ineligible(ValueError):
    """Why a trace cannot be kept (logged; the model keeps Dynamo's bytecode)."""


def plain_value(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(plain_value(v) for v in value)
    return isinstance(value, _LITERALS)


# ---- importable names ---------------------------------------------------------------------------


def object_ref(value: Any) -> tuple:
    """A name that `resolve()` turns back into `value` in any process importing the same code."""
    if isinstance(value, torch._ops._OpNamespace):  # `torch.ops.atomrt`: a module by its type
        return ("op", value.name)
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, torch._ops.OpOverloadPacket):
        return ("op", value._qualified_op_name)
    if isinstance(value, torch._ops.OpOverload):
        return ("op", value._schema.name, value._overloadname)
    if isinstance(value, enum.Enum):
        return ("enum", *object_ref(type(value))[1:], value.name)
    module = getattr(value, "__module__", None)
    for name in (getattr(value, "__qualname__", None), getattr(value, "__name__", None)):
        if module and name and resolve(("fn", module, name)) is value:
            return ("fn", module, name)
        if module and name and resolve(("fget", module, name)) is value:  # a property's getter
            return ("fget", module, name)
    name = getattr(value, "__name__", None)
    for home in _FUNCTION_HOMES:
        if name and getattr(home, name, None) is value:
            return ("fn", home.__name__, name)
    raise Ineligible(f"{value!r} has no importable name")


def resolve(ref: tuple) -> Any:
    """The object `ref` names in this process, or None."""
    kind = ref[0]
    try:
        if kind == "op":  # a namespace, an op or one of its overloads: registered at import
            namespace, _, name = ref[1].partition("::")
            value = getattr(torch.ops, namespace)
            value = getattr(value, name) if name else value
            return getattr(value, ref[2]) if len(ref) == 3 else value
        value = _import(ref[1])
        for part in ref[2].split(".") if kind != "module" else ():
            value = getattr(value, part)
        if kind == "fget":
            return value.fget if isinstance(value, property) else None
        return getattr(value, ref[3]) if kind == "enum" else value
    except (ImportError, AttributeError, ValueError):
        return None


def _import(name: str) -> types.ModuleType:
    module = sys.modules.get(name)
    return module if module is not None else importlib.import_module(name)


def class_names(cls: type) -> tuple[str, ...]:
    """A class as its bases' names: what a type guard compares across processes (the decorated
    model class shares its name with the class it decorates, but not its bases)."""
    return tuple(f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__)


# ---- paths: Dynamo's source text as steps ---------------------------------------------------------


def parse_path(text: str) -> tuple:
    """Dynamo's source text (`L['self']._modules['a'].eps`) as read steps; Ineligible for a source
    of another form."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise Ineligible(f"guard source {text!r} is not an expression") from e
    return _steps(tree, text)


def _constant(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_constant(node.operand, text)
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int)):
        return node.value
    raise Ineligible(f"guard source {text!r} indexes with {ast.dump(node)}")


def _steps(node: ast.AST, text: str) -> tuple:
    if isinstance(node, ast.Subscript):
        if isinstance(node.value, ast.Name) and node.value.id in ("L", "G"):
            return ((node.value.id, _constant(node.slice, text)),)
        return (*_steps(node.value, text), ("item", _constant(node.slice, text)))
    if isinstance(node, ast.Attribute):
        return (*_steps(node.value, text), ("attr", node.attr))
    if isinstance(node, ast.Call) and not node.keywords:
        func, args = ast.unparse(node.func), node.args
        if func in ("type", "dict") and len(args) == 1:
            return (*_steps(args[0], text), (func,))
        if func == "getattr" and len(args) == 2:
            return (*_steps(args[0], text), ("attr", _constant(args[1], text)))
        if func in ("___odict_getitem", "dict.__getitem__", "list.__getitem__") and len(args) == 2:
            return (*_steps(args[0], text), (func, _constant(args[1], text)))
        if func == "__import__" and len(args) == 1:
            return (("module", _constant(args[0], text)),)
    raise Ineligible(f"guard source {text!r} cannot be read in another process")


_STEPS = {
    "item": lambda v, k: v[k],
    "attr": getattr,
    "type": type,
    "dict": dict,
    "___odict_getitem": collections.OrderedDict.__getitem__,
    "dict.__getitem__": dict.__getitem__,
    "list.__getitem__": list.__getitem__,
}


class _Reader:
    """Reads paths against one call's arguments and the forward's globals, each prefix once."""

    def __init__(self, arguments: dict[str, Any], global_scope: dict[str, Any]):
        self.arguments = arguments
        self.global_scope = global_scope
        self.memo: dict[tuple, Any] = {}

    def read(self, path: tuple) -> Any:
        if path in self.memo:
            return self.memo[path]
        if len(path) == 1:
            kind, name = path[0]
            value = (
                self.arguments[name]
                if kind == "L"
                else _import(name)
                if kind == "module"
                else self._global(name)
            )
        else:
            step = path[-1]
            value = _STEPS[step[0]](self.read(path[:-1]), *step[1:])
        self.memo[path] = value
        return value

    def _global(self, name: str) -> Any:
        if name.startswith("__import_"):  # Dynamo's alias of a module an inlined function uses
            return _import(name[len("__import_") :].replace("_dot_", "."))
        if name.startswith("__builtins_dict__"):
            return builtins.__dict__
        return self.global_scope[name]


# ---- the record -------------------------------------------------------------------------------


@dataclass
class Guards:
    """What Dynamo checked when it traced, in a form any process can check."""

    # (kind, path, expected), kind one of _CHECKS
    checks: list
    # Dynamo's size relations, Python over `L` (`2 <= L['input_ids'].size()[0]`)
    shapes: list
    state: dict  # global_state() at the traced call


def global_state() -> dict[str, Any]:
    """What Dynamo's global-state guards compare: grad and inference mode, default dtype and
    device, deterministic algorithms, threads, torch-function modes, autocast, matmul precision
    and saved-tensor hooks."""
    matmul = torch.backends.cuda.matmul
    modes = [
        type(torch._C._get_function_stack_at(i))
        for i in range(torch._C._len_torch_function_stack())
    ]
    return {
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
        "default_device": str(torch.get_default_device()),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "num_threads": torch.get_num_threads(),
        "torch_function": (torch._C._is_torch_function_enabled(), [class_names(m) for m in modes]),
        "autocast": [
            (d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d)))
            for d in ("cpu", "cuda")
        ],
        "matmul": (
            matmul.allow_tf32,
            matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction,
        ),
        "saved_tensor_hooks": torch._C._autograd._top_saved_tensors_default_hooks(True) is not None,
    }


def tensor_spec(value: torch.Tensor, example: Any) -> tuple:
    """What TENSOR_MATCH compares; sizes and strides symbolic in `example` (the graph input's
    fake, if it is one) are None."""
    reference = example if isinstance(example, torch.Tensor) else value
    return (
        class_names(type(value)),
        value.dtype,
        str(value.device),
        value.requires_grad,
        [s if isinstance(s, int) else None for s in reference.shape],
        [s if isinstance(s, int) else None for s in reference.stride()],
        str(torch._C._dispatch_keys(value)),
    )


def _keyword(guard: Any, name: str) -> Any:
    create = guard.create_fn
    if isinstance(create, functools.partial) and name in create.keywords:
        return create.keywords[name]
    raise Ineligible(f"{guard.name}: Dynamo's guard has no {name!r}")


def _hasattr_check(guard: Any, path: tuple, value: Any) -> tuple:
    """Newer torch guards `value` (the base) with the attribute as a keyword; torch 2.8 guards the
    attribute's own source, `base.attr`."""
    create = guard.create_fn
    if isinstance(create, functools.partial) and "attr" in create.keywords:
        attr = create.keywords["attr"]
        return ("hasattr", path, (attr, hasattr(value, attr)))
    if path[-1][0] != "attr":
        raise Ineligible(f"{guard.name}: Dynamo's hasattr guard names no attribute")
    return ("hasattr", path[:-1], (path[-1][1], True))


def _source_text(source: Any) -> str:
    return source.name() if callable(source.name) else source.name


def record(entries: Sequence[Any], examples: dict[str, Any], state: dict[str, Any]) -> Guards:
    """Guards from Dynamo's guard entries (`torch.compile`'s `guard_filter_fn` sees them) with
    `examples`, the graph inputs' fakes by source text, and the call's `global_state()`."""
    checks: list = []
    shapes: list[str] = []
    tensors: list[tuple] = []
    for entry in entries:
        kind, guard, value = entry.guard_type, entry.orig_guard, entry.value
        if kind in _GLOBAL_STATE_GUARDS:
            continue
        if kind == "SHAPE_ENV":
            for text in guard.code_list or []:
                if text not in shapes:
                    _check_shape_text(text)
                    shapes.append(text)
            continue
        path = parse_path(guard.name)
        if kind == "TENSOR_MATCH":
            checks.append(("tensor", path, tensor_spec(value, examples.get(guard.name))))
            tensors.append(path)
        elif kind == "TYPE_MATCH":
            checks.append(("type", path, class_names(type(value))))
        elif kind in _IDENTITY_GUARDS or (kind == "CONSTANT_MATCH" and not plain_value(value)):
            if isinstance(value, type):
                checks.append(("class", path, class_names(value)))
            else:
                checks.append(("is", path, object_ref(value)))
        elif kind in ("CONSTANT_MATCH", "EQUALS_MATCH", "BOOL_MATCH", "NONE_MATCH"):
            if not plain_value(value):
                raise Ineligible(f"{guard.name} is compared with {value!r}, not a plain value")
            checks.append(("equals", path, value))
        elif kind == "NOT_NONE_MATCH":
            checks.append(("not_none", path, None))
        elif kind == "SEQUENCE_LENGTH":
            checks.append(("type", path, class_names(type(value))))
            checks.append(("len", path, len(value)))
        elif kind == "EMPTY_NN_MODULE_HOOKS_DICT":
            checks.append(("len", path, 0))
        elif kind in ("DICT_KEYS_MATCH", "DICT_KEYS", "MAPPING_KEYS_CHECK"):
            keys = list(value.keys())
            if not plain_value(keys):
                raise Ineligible(f"{guard.name} has keys that are not plain values")
            checks.append(("type", path, class_names(type(value))))
            checks.append(("keys", path, keys))
        elif kind == "NOT_PRESENT_IN_GENERIC_DICT":
            checks.append(("not_in_dict", path, _keyword(guard, "attr")))
        elif kind == "HASATTR":
            checks.append(_hasattr_check(guard, path, value))
        elif kind in ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS", "SET_NOT_CONTAINS"):
            key = _keyword(guard, "key")
            if not plain_value(key):
                raise Ineligible(f"{guard.name} is checked for the key {key!r}")
            checks.append(("contains", path, (key, key in value)))
        elif kind == "DUPLICATE_INPUT":
            checks.append(("same", path, parse_path(_source_text(_keyword(guard, "source_b")))))
        else:
            raise Ineligible(f"Dynamo guards {guard.name or 'the trace'} with {kind}")
    if len(tensors) > 1:  # the graph takes each distinct tensor once: so must the loading call
        checks.append(("distinct", tensors[0], tensors))
    return Guards(checks, shapes, state)


def _check_shape_text(text: str) -> None:
    """Dynamo's size relations must be comparisons and arithmetic of sizes and strides."""
    allowed = (
        ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.cmpop, ast.boolop,
        ast.operator, ast.unaryop, ast.Constant, ast.Subscript, ast.Attribute, ast.Name, ast.Load,
    )  # fmt: skip
    for node in ast.walk(ast.parse(text, mode="eval")):
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Attribute) and node.func.attr in ("size", "stride")):
                raise Ineligible(f"Dynamo's size guard {text!r} calls something")
        elif isinstance(node, ast.Name) and node.id != "L":
            raise Ineligible(f"Dynamo's size guard {text!r} reads {node.id}")
        elif not isinstance(node, allowed):
            raise Ineligible(f"Dynamo's size guard {text!r} has a {type(node).__name__}")


# ---- the check ----------------------------------------------------------------------------------


def _same_tensor(value: Any, spec: tuple) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    names, dtype, device, requires_grad, sizes, strides, keys = spec
    return (
        class_names(type(value)) == names
        and value.dtype == dtype
        and str(value.device) == device
        and value.requires_grad == requires_grad
        and value.dim() == len(sizes)
        and all(e is None or e == s for e, s in zip(sizes, value.shape))
        and all(e is None or e == s for e, s in zip(strides, value.stride()))
        and str(torch._C._dispatch_keys(value)) == keys
    )


_CHECKS = {
    "tensor": lambda v, e, r: _same_tensor(v, e),
    "type": lambda v, e, r: class_names(type(v)) == e,
    "is": lambda v, e, r: v is resolve(e),
    "class": lambda v, e, r: isinstance(v, type) and class_names(v) == e,
    "equals": lambda v, e, r: type(v) is type(e) and v == e,
    "not_none": lambda v, e, r: v is not None,
    "len": lambda v, e, r: len(v) == e,
    "keys": lambda v, e, r: list(v.keys()) == e,
    "not_in_dict": lambda v, e, r: e not in v.__dict__,
    "hasattr": lambda v, e, r: hasattr(v, e[0]) == e[1],
    "contains": lambda v, e, r: (e[0] in v) == e[1],
    "same": lambda v, e, r: v is r.read(e),
    "distinct": lambda v, e, r: len({id(r.read(p)) for p in e}) == len(e),
}


def check(guards: Guards, arguments: dict[str, Any], global_scope: dict[str, Any]) -> Optional[str]:
    """None if every guard holds for this call (`arguments`: forward's, by name) in this process
    (`global_scope`: the forward's module globals); else what failed first."""
    state = global_state()
    for key, traced in guards.state.items():
        if state.get(key) != traced:
            return f"the global state {key} is {state.get(key)!r}, traced with {traced!r}"
    reader = _Reader(arguments, global_scope)
    for kind, path, expected in guards.checks:
        try:
            holds = _CHECKS[kind](reader.read(path), expected, reader)
        except Exception as e:  # a path this process cannot read: the guard fails
            return f"{_text(path)} cannot be read here ({type(e).__name__}: {e})"
        if not holds:
            return f"{_text(path)} fails its {kind} guard"
    for text in guards.shapes:
        try:
            holds = bool(eval(text, {"__builtins__": {}}, {"L": arguments}))
        except Exception as e:
            return f"the size guard {text} cannot be evaluated ({type(e).__name__}: {e})"
        if not holds:
            return f"the size guard {text} fails"
    return None


def _text(path: tuple) -> str:
    """A path as Dynamo writes its source, for messages."""
    (kind, name), *steps = path
    text = f"__import__({name!r})" if kind == "module" else f"{kind}[{name!r}]"
    for step, *args in steps:
        if step == "attr":
            text = f"{text}.{args[0]}"
        elif step == "item":
            text = f"{text}[{args[0]!r}]"
        else:
            text = f"{step}({', '.join([text, *map(repr, args)])})"
    return text


def graph_examples(graph: torch.fx.GraphModule) -> dict[str, Any]:
    """Each graph input's fake (its `example_value`) by its Dynamo source's text."""
    examples = {}
    for node in graph.graph.nodes:
        source = getattr(node, "_dynamo_source", None)
        if node.op == "placeholder" and source is not None:
            examples[_source_text(source)] = node.meta.get("example_value")
    return examples
