"""Custom-op registration under the `atomrt` torch library namespace.

An op registered here is visible to Dynamo as `torch.ops.atomrt.<name>` and may be named in
`CompilationConfig.splitting_ops` as "atomrt.<name>". Its `fake_impl` gives output shapes while
tracing; ops that write into an output buffer list it in `mutates_args` and return None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch.library import Library

ATOMRT_NAMESPACE = "atomrt"
# One Library object for the namespace ("FRAGMENT": other libraries may add to it too).
atomrt_lib = Library(ATOMRT_NAMESPACE, "FRAGMENT")


def direct_register_custom_op(
    op_name: str,
    op_func: Callable,
    mutates_args: Optional[list[str]] = None,
    fake_impl: Optional[Callable] = None,
    target_lib: Optional[Library] = None,
    dispatch_key: str = "CompositeExplicitAutograd",
    tags: tuple = (),
) -> None:
    """Register `op_func` as `torch.ops.<namespace>.<op_name>`.

    The schema is inferred from `op_func`'s annotations. The guide's default dispatch key is
    "CUDA"; ours is "CompositeExplicitAutograd" so the same op serves CPU and CUDA tensors (the
    implementation picks its kernel by device). Registering the same name twice is a no-op.
    """
    lib = target_lib or atomrt_lib
    namespace = lib.ns
    if hasattr(torch.ops, namespace) and hasattr(getattr(torch.ops, namespace), op_name):
        return
    schema_str = torch.library.infer_schema(op_func, mutates_args=mutates_args or [])
    lib.define(op_name + schema_str, tags=tags)
    lib.impl(op_name, op_func, dispatch_key)
    if fake_impl is not None:
        lib._register_fake(op_name, fake_impl)
