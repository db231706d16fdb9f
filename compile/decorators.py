"""`@support_torch_compile`: compile a model class at levels 2 and 3, dispatch without guards.

Usage (the `*Model` class of a model file; the config reaches it through the constructor):

    @support_torch_compile
    class LlamaModel(nn.Module):
        def __init__(self, arch, tp): ...
        def forward(self, input_ids, positions): ...

    model = LlamaModel(arch, tp, config=config)   # config: atomrt.runtime.config.Config

The decorator returns a subclass, made once at decoration time, whose bases are
(TorchCompileWrapperWithCustomDispatcher, LlamaModel); nothing is patched at run time. The
`config` keyword is consumed by the wrapper (and passed on too if `__init__` declares it).
Without `config` the model runs eagerly.

- Levels 0 and 1: `do_not_compile = True`; calls go to `nn.Module.__call__`. At level 1 the model
  runner calls `compile_model(model, config)`, which runs `Module.compile(backend="eager",
  fullgraph=True)` on each decorated submodule.
- Levels 2 and 3: the first call marks dim 0 of every tensor argument dynamic (the token
  dimension; it must hold >= 2 rows then) and runs `torch.compile(forward, backend=
  PiecewiseCompileBackend, fullgraph=True, dynamic=False)`. A Dynamo bytecode hook records the
  compiled code object; later calls run it directly with `forward`'s globals, so Dynamo's guards
  are never evaluated again (the runner is responsible for keeping inputs of the traced kind).
  Where Dynamo's code only gathers the graph's inputs, the trace is kept beside the compile cache
  and calls go through a function generated from it instead, with Dynamo's guards on it; a later
  process with the same key and model sources checks those guards and builds the model from the
  kept trace without Dynamo (compile/trace_cache.py).
"""

from __future__ import annotations

import dis
import inspect
import logging
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from atomrt.compile import trace_cache, trace_guards, trace_store
from atomrt.compile.backends import PiecewiseCompileBackend, compilation_counter, current_rank
from atomrt.compile.cache import cache_root, is_read_only
from atomrt.runtime.config import CompilationLevel, Config
from atomrt.runtime.envs import ENV

logger = logging.getLogger("atomrt.compile.decorators")

DynamicArgDims = dict[str, Union[int, list[int]]]


def start_monitoring_torch_compile(config: Config) -> float:
    """Log the start of a model's compile; return the start time for the backend's Dynamo timing."""
    logger.info("torch.compile at level %d starts", config.compilation_config.level)
    return time.perf_counter()


class TorchCompileWrapperWithCustomDispatcher:
    """The compile half of a decorated model class; see the module docstring."""

    _compile_prefix = "backbone"
    _dynamic_arg_dims: Optional[DynamicArgDims] = None  # None: dim 0 of every tensor argument
    _init_takes_config = False

    def __init__(self, *args: Any, config: Optional[Config] = None, **kwargs: Any):
        self._init_text = trace_store.describe_init(args, kwargs)
        if self._init_takes_config:
            kwargs["config"] = config
        super().__init__(*args, **kwargs)
        level = (
            config.compilation_config.level
            if config is not None
            else CompilationLevel.NO_COMPILATION
        )
        self.atomrt_config = config
        self.do_not_compile = level < CompilationLevel.DYNAMO_ONCE
        self.use_custom_dispatcher = level >= CompilationLevel.DYNAMO_ONCE
        self.compiled_codes: list[types.CodeType] = []
        self._compiled_forward: Optional[Callable] = None
        self._guard_entries: list = []  # Dynamo's guards on the first trace, while it is kept
        if self.do_not_compile:
            return
        self._new_backend()

    def _new_backend(self) -> None:
        """A fresh backend and Dynamo entry point (at construction, and after a kept trace that
        did not fit, which may have left the first backend half built)."""
        self.compile_backend = PiecewiseCompileBackend(
            self.atomrt_config, prefix=self._compile_prefix
        )
        # Dynamo shows each guard to this filter (keeping all): a kept trace records them
        options = {"guard_filter_fn": self._see_guards} if self._keeps_traces() else None
        self.compiled_callable = torch.compile(
            self.forward,
            backend=self.compile_backend,
            fullgraph=True,
            dynamic=False,
            options=options,
        )

    def _keeps_traces(self) -> bool:
        return ENV.trace_cache and self._init_text is not None

    def _see_guards(self, entries: list) -> list[bool]:
        self._guard_entries = list(entries)
        return [True] * len(entries)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.do_not_compile:
            return super().__call__(*args, **kwargs)
        if self._compiled_forward is not None:
            return self._compiled_forward(self, *args, **kwargs)
        return self._compile_and_call(args, kwargs)

    def bytecode_hook(self, old_code: types.CodeType, new_code: types.CodeType) -> None:
        """Registered only around our first call: keep what Dynamo made of our `forward`."""
        if old_code is type(self).forward.__code__:
            self.compiled_codes.append(new_code)

    def dispatch_to_code(self, index: int) -> Callable:
        """A function running compiled code object `index` as `forward` (call it with self first)."""
        forward = type(self).forward
        fn = types.FunctionType(
            self.compiled_codes[index],
            forward.__globals__,
            forward.__name__,
            forward.__defaults__,
            forward.__closure__,
        )
        fn.__kwdefaults__ = forward.__kwdefaults__
        return fn

    def _compile_and_call(self, args: tuple, kwargs: dict) -> Any:
        start = start_monitoring_torch_compile(self.atomrt_config)
        self._mark_dynamic(args, kwargs)
        attributes = trace_cache.plain_attributes(self)
        directory = self._trace_dir(args, kwargs)
        arguments = self._arguments(args, kwargs)
        state = trace_guards.global_state()
        found = trace_store.find(directory) if directory is not None else None
        output = None
        if found is not None:
            output = self._call_traced(*found, arguments, args, kwargs)
        if self._compiled_forward is None:
            self.compile_backend.compile_start = start
            hook = torch._dynamo.convert_frame.register_bytecode_hook(self.bytecode_hook)
            try:
                output = self.compiled_callable(*args, **kwargs)
            finally:
                hook.remove()
            self._install_dispatcher()
            self._keep_trace(directory, output, arguments, state)
        self._warn_of_changed_attributes(attributes)
        elapsed = time.perf_counter() - start
        compilation_counter.compile_seconds += elapsed
        logger.info("torch.compile of %s took %.2f s in total", type(self).__name__, elapsed)
        return output

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """`forward`'s arguments of this call by name, defaults included: what Dynamo's guards
        call `L`."""
        bound = inspect.signature(type(self).forward).bind(self, *args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def _warn_of_changed_attributes(self, before: dict[str, Any]) -> None:
        """A forward that sets a plain attribute (a counter, a flag) of the model: Dynamo's bytecode
        stores the value it traced, and calls skip its guards, so every later call stores that same
        value. Say so: the model's state would silently stop changing."""
        after = trace_cache.plain_attributes(self)
        changed = [name for name, value in after.items() if before.get(name, value) != value]
        if changed:
            logger.warning(
                "%s.forward changed %s on its first call; compiled calls bypass Dynamo's guards and "
                "store the value traced then on every call. Keep such state outside the compiled "
                "forward.",
                type(self).__name__,
                ", ".join(f"{n} ({before[n]!r} -> {after[n]!r})" for n in changed),
            )

    def _trace_dir(self, args: tuple, kwargs: dict) -> Optional[Path]:
        """Where this model's traces are kept (compile/trace_store.py), or None where they are not."""
        if not self._keeps_traces():
            return None
        device = next(
            (x.device for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)),
            torch.device("cpu"),
        )
        key = trace_store.trace_key(
            self.atomrt_config.compute_hash(),
            type(self),
            self._init_text,
            self._compile_prefix,
            device,
        )
        root = cache_root(self.atomrt_config.compilation_config.cache_dir)
        return trace_store.entry_dir(root, key, current_rank(), self._compile_prefix)

    def _call_traced(
        self,
        entry: Path,
        sources: trace_cache.Sources,
        arguments: dict[str, Any],
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """Build the compiled model from a kept trace and call it; None (and a fresh backend for
        Dynamo) where the trace does not fit this model, process or call."""
        name = type(self).__name__
        traced = trace_store.load(entry, sources)
        if traced is None:
            return None
        start = time.perf_counter()
        forward = type(self).forward
        try:
            failed = trace_guards.check(traced.guards, arguments, forward.__globals__)
            if failed is not None:
                logger.info(
                    "%s: the trace kept at %s does not hold (%s); tracing", name, entry, failed
                )
                return None
            graph = trace_cache.rebuild_graph(traced)
            inputs, fakes, fake_mode = trace_cache.example_inputs(traced, arguments)
            trace_cache.propagate(graph, fakes, fake_mode)
            rebuilt = time.perf_counter() - start
            with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
                compiled = self.compile_backend.build(graph, inputs, sources.files, loads_only=True)
            self._compiled_forward = trace_cache.forward_calling(compiled, traced, forward)
            output = self._compiled_forward(self, *args, **kwargs)
        except Exception as e:  # a kept trace never stops a start: trace as if it were not there
            logger.warning(
                "%s: the trace kept at %s does not fit (%s: %s); tracing",
                name,
                entry,
                type(e).__name__,
                e,
            )
            self._compiled_forward = None
            self._new_backend()
            return None
        compilation_counter.num_trace_loads += 1
        logger.info(
            "%s: built from Dynamo's trace kept at %s (guards checked, graph rebuilt in %.2f s), "
            "no Dynamo",
            name,
            entry,
            rebuilt,
        )
        return output

    def _keep_trace(
        self, directory: Optional[Path], output: Any, arguments: dict[str, Any], state: dict
    ) -> None:
        """After Dynamo's trace: call through the generated forward from now on and write the
        trace in `directory`, if the trace can be kept."""
        traced_by_backend, self.compile_backend.traced = self.compile_backend.traced, None
        entries, self._guard_entries = self._guard_entries, []
        if directory is None or traced_by_backend is None or not self.compiled_codes:
            return
        forward = type(self).forward
        if (
            not self.use_custom_dispatcher
            or self.compiled_codes[0].co_freevars != forward.__code__.co_freevars
        ):
            return
        graph, inputs, files = traced_by_backend
        try:
            sources = trace_store.traced_sources(files)
            examples = trace_guards.graph_examples(graph)
            guards = trace_guards.record(entries, examples, state)
            failed = trace_guards.check(guards, arguments, forward.__globals__)
            if failed is not None:  # what another process would check must hold here
                raise trace_cache.Ineligible(f"its guards do not hold as recorded: {failed}")
            traced = trace_cache.capture(
                graph, inputs, self.compiled_codes[0], output, sources, guards
            )
            compiled = self.compile_backend.compiled_callable
            self._compiled_forward = trace_cache.forward_calling(compiled, traced, forward)
        except trace_cache.Ineligible as e:
            logger.info("%s: Dynamo's trace is not kept: %s", type(self).__name__, e)
            return
        except Exception as e:  # noqa: BLE001 - keeping the trace never stops a start
            logger.warning(
                "%s: Dynamo's trace is not kept (%s: %s)", type(self).__name__, type(e).__name__, e
            )
            return
        if ENV.compile_cache_read_only or is_read_only(directory):
            return
        try:
            entry = trace_store.save(directory, traced, sources)
        except OSError as e:  # a full or failing disk: the next start traces again
            logger.warning(
                "%s: Dynamo's trace not written to %s: %s", type(self).__name__, directory, e
            )
            return
        logger.info("%s: Dynamo's trace kept at %s", type(self).__name__, entry)

    def _mark_dynamic(self, args: tuple, kwargs: dict) -> None:
        bound = inspect.signature(type(self).forward).bind(self, *args, **kwargs)
        for name, value in bound.arguments.items():
            if not isinstance(value, torch.Tensor):
                continue
            dims = (self._dynamic_arg_dims or {}).get(
                name, 0 if self._dynamic_arg_dims is None else None
            )
            for dim in [dims] if isinstance(dims, int) else dims or []:
                if value.shape[dim] < 2:
                    raise ValueError(
                        f"{type(self).__name__}: the first compiled call needs >= 2 rows in dim {dim} of "
                        f"'{name}' (got {value.shape[dim]}; size 1 would be specialised). Warm up with a "
                        "larger batch first."
                    )
                torch._dynamo.mark_dynamic(value, dim)

    def _install_dispatcher(self) -> None:
        cls_name = type(self).__name__
        original = type(self).forward.__code__
        if not self.compiled_codes:
            logger.warning(
                "%s: Dynamo produced no new code for forward; calls keep Dynamo's guards", cls_name
            )
            self._compiled_forward = lambda _self, *a, **k: self.compiled_callable(*a, **k)
            return
        code = self.compiled_codes[0]
        if "update" in code.co_names:
            raise RuntimeError(
                f"{cls_name}.forward assigns or updates nn.Module buffers (Dynamo's compiled code calls "
                "`update`). The compiled model must not change its own state: under CUDA graphs the update "
                "is replayed against captured memory and the results are silently wrong. Pass such state "
                "in as an argument, or update it outside the compiled forward."
            )
        if code.co_freevars != original.co_freevars:
            logger.warning(
                "%s: compiled code has other free variables; calls keep Dynamo's guards", cls_name
            )
            self._compiled_forward = lambda _self, *a, **k: self.compiled_callable(*a, **k)
            return
        self._compiled_forward = self.dispatch_to_code(0) if self.use_custom_dispatcher else None
        if self._compiled_forward is not None:
            # Calls bypass Dynamo from here on, so its cache entry for `forward`'s code is dead
            # weight. Left there, every instance compiled in this process adds one (Dynamo guards on
            # `self`), and the one past torch._dynamo.config.recompile_limit (8) fails to compile:
            # a hard error under fullgraph=True.
            torch._dynamo.eval_frame.remove_from_cache(original)
        self._dump_transformed_code(code)

    def _dump_transformed_code(self, code: types.CodeType) -> None:
        dump = self.atomrt_config.compilation_config.debug_dump_path if self.atomrt_config else ""
        if not dump:
            return
        rank_dir = Path(dump) / f"rank_{current_rank()}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        forward = type(self).forward
        text = (
            f"# original source of {type(self).__qualname__}.forward\n"
            + "".join("# " + line for line in inspect.getsourcelines(forward)[0])
            + "\n# Dynamo's compiled bytecode (what the custom dispatcher runs)\n"
            + dis.Bytecode(code).dis()
        )
        (rank_dir / f"transformed_code_{self._compile_prefix}.txt").write_text(text)


def support_torch_compile(
    cls: Optional[type] = None,
    *,
    dynamic_arg_dims: Optional[DynamicArgDims] = None,
    prefix: str = "backbone",
) -> Any:
    """Class decorator (also usable as `@support_torch_compile(dynamic_arg_dims=..., prefix=...)`).

    `dynamic_arg_dims` maps forward argument names to the dims marked dynamic (default: dim 0 of
    every tensor argument); `prefix` names the model's directory in the compile cache.
    """

    def decorate(model_cls: type) -> type:
        if not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
            raise TypeError(
                f"@support_torch_compile decorates nn.Module classes, not {model_cls!r}"
            )
        namespace = {
            "__module__": model_cls.__module__,
            "__qualname__": model_cls.__qualname__,
            "__doc__": model_cls.__doc__,
            "_compile_prefix": prefix,
            "_dynamic_arg_dims": dynamic_arg_dims,
            "_init_takes_config": "config" in inspect.signature(model_cls.__init__).parameters,
        }
        return type(
            model_cls.__name__, (TorchCompileWrapperWithCustomDispatcher, model_cls), namespace
        )

    return decorate if cls is None else decorate(cls)


def compile_model(model: nn.Module, config: Config) -> nn.Module:
    """What the model runner calls after loading: level 1 compiles with Dynamo only
    (`backend="eager"`, `fullgraph=True`), in place; other levels change nothing here (levels 2
    and 3 compile inside the decorated class on its first call). Returns `model`."""
    if config.compilation_config.level != CompilationLevel.DYNAMO_AS_IS:
        return model
    targets = [
        m for m in model.modules() if isinstance(m, TorchCompileWrapperWithCustomDispatcher)
    ] or [model]
    for module in targets:
        module.compile(backend="eager", fullgraph=True)
    return model
