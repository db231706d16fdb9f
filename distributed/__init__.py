"""atomrt.distributed: process groups, graph-safe collectives, the NCCL drain, the step messages
and their ZeroMQ transport.

Modules (import them directly; this package imports nothing heavy, so a GPU machine without pyzmq
can still use the process groups):

- `messages`: `StepPlan`, `RankBatch`, `NewRequest`, `StepResult`, `Hello`, `Ready`, `encode`, `decode`
  (`step_messages`: the step path's dataclasses, and `core_messages`: the engine core's
  `CoreRequest`, `CoreOutputs`, ..., both re-exported there; `wire_arrays`: the declared-dtype
  array fields)
- `transport`: `TransportAddresses`, `CurveKeys` (tcp:// authentication), `PlanPublisher`,
  `ResultCollector`, `PlanSubscriber`, `ResultPusher` (`zmq_sockets`: the addresses, keys, socket
  setup and errors it re-exports; `zap`: the driver's CURVE admission)
- `parallel_state`: `init_distributed`, `get_world_group` / `get_tp_group` / `get_dp_group`
  (`GroupInfo`), `destroy_distributed`
- `communication_op`: `TPInfo`, `DPInfo` and the collectives models call (`tp_all_reduce`,
  `tp_all_gather`, `tp_broadcast`; `dp_all_gather`, `dp_reduce_scatter` for MoE layers), graph-safe
- `nccl_watchdog`: `drain_nccl_works`, `graph_capture_kwargs`
- `net_utils`: host IP, free ports, per-instance ipc directories
"""
