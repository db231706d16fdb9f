"""atomrt.compile: compilation levels 0-3 (see compile/decorators.py for how a model opts in).

Every name the guide places in its backends, compiler interface, piecewise backend, decorator and
custom-op modules is importable from here.
"""

from atomrt.compile.backends import (
    CompilationCounter,
    CompilerManager,
    PiecewiseCompileBackend,
    PiecewiseCompileInterpreter,
    SplitItem,
    VllmBackend,
    compilation_counter,
    split_graph,
)
from atomrt.compile.cache import CacheHash, CorruptCacheEntry, compute_cache_hash
from atomrt.compile.compiler_interface import (
    AlwaysHitShapeEnv,
    CompilerInterface,
    EagerAdaptor,
    InductorAdaptor,
    InductorStandaloneAdaptor,
    make_compiler,
)
from atomrt.compile.custom_register import atomrt_lib, direct_register_custom_op
from atomrt.compile.decorators import (
    TorchCompileWrapperWithCustomDispatcher,
    compile_model,
    start_monitoring_torch_compile,
    support_torch_compile,
)
from atomrt.compile.piecewise_backend import ConcreteSizeEntry, PiecewiseBackend

__all__ = [
    "AlwaysHitShapeEnv",
    "CacheHash",
    "CompilationCounter",
    "CompilerInterface",
    "CompilerManager",
    "ConcreteSizeEntry",
    "CorruptCacheEntry",
    "EagerAdaptor",
    "InductorAdaptor",
    "InductorStandaloneAdaptor",
    "PiecewiseBackend",
    "PiecewiseCompileBackend",
    "PiecewiseCompileInterpreter",
    "SplitItem",
    "TorchCompileWrapperWithCustomDispatcher",
    "VllmBackend",
    "atomrt_lib",
    "compilation_counter",
    "compile_model",
    "compute_cache_hash",
    "direct_register_custom_op",
    "make_compiler",
    "split_graph",
    "start_monitoring_torch_compile",
    "support_torch_compile",
]
