"""atomrt.distributed: process groups, graph-safe collectives, the NCCL drain, DP padding, the
step messages and their ZeroMQ transport.

Modules (import them directly; this package imports nothing heavy, so a GPU machine without pyzmq
can still use the process groups):

- `messages`: `StepPlan`, `RankBatch`, `NewRequest`, `StepResult`, `Hello`, `Ready`, `encode`, `decode`
- `transport`: `TransportAddresses`, `PlanPublisher`, `ResultCollector`, `PlanSubscriber`, `ResultPusher`
- `parallel_state`: `init_distributed`, `get_world_group` / `get_tp_group` / `get_dp_group`
  (`GroupInfo`), `destroy_distributed`
- `communication_op`: `tensor_model_parallel_all_reduce`, `tensor_model_parallel_all_gather`,
  `dp_all_gather_num_tokens`, `dp_pad`, `make_dp_metadata`
- `nccl_watchdog`: `drain_nccl_works`, `graph_capture_kwargs`
- `net_utils`: host IP, free ports, per-instance ipc directories
- `transport_bench`: `python -m atomrt.runtime.bench.transport`
"""

from atomrt.runtime.forward_context import DPMetadata

__all__ = ["DPMetadata"]
