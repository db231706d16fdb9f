"""Every Triton kernel reads only globals that compile on a GPU: Triton's code generator refuses a
plain Python number, string or tensor read from a kernel's module ("Cannot access global variable
... from within @jit'ed function") unless it is a `tl.constexpr(...)`, while the interpreter the
CPU tests run the kernels through accepts it. This check walks each kernel's source instead."""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
import triton
from package_walk import modules_mentioning

import atomrt

REFUSED = (bool, int, float, str, torch.Tensor)


def _kernels():
    for module in modules_mentioning("triton.jit"):
        for name, value in vars(module).items():
            if _is_kernel(value) and value.fn.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", value


def _is_kernel(value: object) -> bool:
    """A @triton.jit function: JITFunction, or InterpretedFunction under TRITON_INTERPRET=1."""
    return type(value).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(value, "fn")


def _refused_globals(kernel: object) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
    local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    local |= {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in local}
    scope = kernel.fn.__globals__
    return sorted(n for n in names if n in scope and isinstance(scope[n], REFUSED))


def test_kernels_read_only_constexpr_globals() -> None:
    kernels = dict(_kernels())
    assert "atomrt.workers.kernels.gemm.fp8_gemm.fp8_quant_kernel" in kernels, sorted(kernels)
    refused = {name: bad for name, k in kernels.items() if (bad := _refused_globals(k))}
    assert not refused, f"globals to wrap in tl.constexpr(...): {refused}"


def test_the_check_finds_a_plain_float() -> None:
    """A kernel reading a module-level float is reported (the check is not vacuous)."""
    namespace = {"tl": triton.language, "LIMIT": 448.0, "atomrt": atomrt}
    kernel_source = (
        "def clamp_kernel(x_ptr):\n"
        "    x = tl.load(x_ptr)\n"
        "    tl.store(x_ptr, tl.minimum(x, LIMIT))\n"
    )
    path = "<test_triton_globals>"
    exec(compile(kernel_source, path, "exec"), namespace)
    fn = namespace["clamp_kernel"]
    linecache_entry = (len(kernel_source), None, kernel_source.splitlines(True), path)
    import linecache

    linecache.cache[path] = linecache_entry
    try:
        assert _refused_globals(triton.jit(fn)) == ["LIMIT"]
        namespace["LIMIT"] = triton.language.constexpr(448.0)
        assert _refused_globals(triton.jit(fn)) == []
    finally:
        linecache.cache.pop(path, None)
