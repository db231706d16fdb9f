"""`make_executor`: the executor `parallel_config.executor` names."""

from __future__ import annotations

from atomrt.runtime.config import Config
from atomrt.runtime.executors.base import Executor
from atomrt.runtime.executors.inproc import InProcExecutor
from atomrt.runtime.executors.mp_executor import MPExecutor
from atomrt.runtime.executors.ray_executor import RayExecutor


def make_executor(config: Config) -> Executor:
    kind = config.parallel_config.executor
    if kind == "inproc":
        return InProcExecutor(config)
    if kind == "mp":
        return MPExecutor(config)
    pc = config.parallel_config
    return RayExecutor(config, placement_strategy=pc.placement_strategy, transport=pc.transport)
