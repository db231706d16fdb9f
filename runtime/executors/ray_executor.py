"""`RayExecutor`: one Ray actor per (DP, TP) rank in a placement group. Ray is the control plane only.

- Cluster: `parallel_config.ray_address`, else RAY_ADDRESS, else a Ray already initialised in this
  process, else a local one this executor starts (and stops at shutdown).
- Placement: one bundle per rank ({"GPU": 1, "CPU": 1} on GPU clusters, {"CPU": 1} otherwise).
  Strategy "auto": STRICT_PACK when one node can hold every bundle, else PACK; or pass
  STRICT_PACK / PACK / SPREAD / STRICT_SPREAD.
- Control calls (node info, rendezvous + load, KV sizing, capture) are `ray.get`s bounded by
  `parallel_config.worker_timeout_s`; an error names the rank and the phase.
- Steps never touch Ray: the plan goes out on ZeroMQ (ipc:// when every rank is on the driver's
  node, tcp:// otherwise, authenticated with CURVE keys made for this engine and handed to the
  actors through Ray: distributed/transport.py) and results come back on the PULL
  (runtime/executors/channel.py). Only when no result arrived for 0.5 s does the driver look at
  Ray, without blocking: has a rank's plan loop call ended (actor died, loop raised), or has its
  pending `ping` gone unanswered for `heartbeat_timeout_s`?
- The actors get the driver's ATOMRT_* settings (runtime/envs.py, FORWARDED_TO_WORKERS).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from atomrt.runtime.config import Config
from atomrt.runtime.envs import ENV
from atomrt.runtime.executors.base import WorkerError
from atomrt.runtime.executors.channel import PHASES, ChannelExecutor, StepChannel, gather_infos
from atomrt.workers.process import DESTROY_TIMEOUT_S, NodeInfo, RankSpec, WorkerProcess

logger = logging.getLogger(__name__)

STRATEGIES = ("auto", "STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
TRANSPORTS = ("auto", "ipc", "tcp")
ACTOR_CPUS = (
    1.0  # logical CPUs per rank's bundle (a scheduling token: the rank mostly waits or runs torch)
)
_KILL_WAIT_S = 5.0  # after ray.kill, how long shutdown waits to see the actors gone


class RayExecutor(ChannelExecutor):
    kind = "ray"

    def __init__(
        self, config: Config, placement_strategy: str = "auto", transport: str = "auto"
    ) -> None:
        super().__init__(config)
        if placement_strategy not in STRATEGIES:
            raise ValueError(
                f"placement_strategy: expected one of {STRATEGIES}, got {placement_strategy!r}"
            )
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
        self.placement_strategy = placement_strategy
        self.transport = transport
        self.actors: list[Any] = []
        self.nodes: list[NodeInfo] = []
        self.pg: Any = None
        self.pg_strategy = ""
        self._owns_ray = False
        self._loop_refs: list[Any] = []
        self._pings: list[tuple[Any, float]] = []

    @property
    def worker_pids(self) -> dict[int, int]:
        """Global rank -> pid of its actor process."""
        return {s.rank: n.pid for s, n in zip(self.specs, self.nodes)}

    @property
    def node_ids(self) -> dict[int, str]:
        """Global rank -> the Ray node id its actor runs on."""
        return {s.rank: n.node_id for s, n in zip(self.specs, self.nodes)}

    # ------------------------------------------------------------------------------- start-up

    def _start(self) -> Any:
        import ray

        pc = self.config.parallel_config
        self._connect()
        use_gpu = self._use_gpu()
        self.pg = self._placement_group(use_gpu)
        self.actors = [self._actor(i, spec, use_gpu) for i, spec in enumerate(self.specs)]
        n = len(self.specs)
        self.nodes = self._get([a.node_info.remote() for a in self.actors], "node_info")
        master = self.nodes[0]
        self._get(
            [a.init_worker.remote(master.node_ip, master.free_port) for a in self.actors],
            "init_worker",
        )
        num_blocks = min(
            self._get(
                [a.determine_num_blocks.remote() for a in self.actors], "determine_num_blocks"
            )
        )
        infos = self._get([a.initialize.remote(num_blocks) for a in self.actors], "initialize")
        driver_node = ray.get_runtime_context().get_node_id()
        local = self.transport == "ipc" or (
            self.transport == "auto" and all(node.node_id == driver_node for node in self.nodes)
        )
        host_ip = "" if local else (ENV.host_ip or ray.util.get_node_ip_address())
        spin_s = pc.resolved_spin_s(
            "cuda" if use_gpu else "cpu"
        )  # the device the ranks were placed on
        self.channel = StepChannel(n, pc.data_parallel_size, local, host_ip, spin_s)
        addresses = self.channel.addresses.to_dict()
        self._loop_refs = [a.run_plan_loop.remote(addresses) for a in self.actors]
        now = time.monotonic()
        self._pings = [(a.ping.remote(), now) for a in self.actors]
        self.channel.handshake(pc.worker_timeout_s, self._check_alive)
        logger.info(
            "ray executor: %d ranks on %d node(s), %s placement, %s transport, %d KV blocks each",
            n,
            len({node.node_id for node in self.nodes}),
            self.pg_strategy,
            "ipc" if local else "tcp",
            num_blocks,
        )
        return gather_infos(infos)

    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        address = self.config.parallel_config.ray_address or ENV.ray_address
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
        else:
            ray.init(
                num_cpus=int(len(self.specs) * ACTOR_CPUS + 0.999),
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
        self._owns_ray = True

    def _use_gpu(self) -> bool:
        import ray

        if self.config.device == "cpu":
            return False
        gpus = ray.cluster_resources().get("GPU", 0)
        if self.config.device == "cuda" and gpus < len(self.specs):
            raise ValueError(
                f"device 'cuda': {len(self.specs)} ranks need {len(self.specs)} GPUs, the Ray cluster has {gpus:g}"
            )
        return gpus >= len(self.specs)

    def _placement_group(self, use_gpu: bool) -> Any:
        import ray
        from ray.util.placement_group import placement_group

        bundle = {"CPU": ACTOR_CPUS, "GPU": 1.0} if use_gpu else {"CPU": ACTOR_CPUS}
        strategy = self.placement_strategy
        if strategy == "auto":
            need = {k: v * len(self.specs) for k, v in bundle.items()}
            fits = any(
                node["Alive"] and all(node["Resources"].get(k, 0) >= v for k, v in need.items())
                for node in ray.nodes()
            )
            strategy = "STRICT_PACK" if fits else "PACK"
        self.pg_strategy = strategy
        self.pg = pg = placement_group([dict(bundle) for _ in self.specs], strategy=strategy)
        timeout = self.config.parallel_config.worker_timeout_s
        if not pg.wait(timeout_seconds=timeout):
            raise WorkerError(
                f"start-up: placement group of {len(self.specs)} x {bundle} ({strategy}) not placed within "
                f"{timeout:.0f} s; cluster has {ray.cluster_resources()}"
            )
        return pg

    def _actor(self, index: int, spec: RankSpec, use_gpu: bool) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = ray.remote(WorkerProcess)
        # The driver's ATOMRT_* settings hold for its ranks too (runtime/envs.py).
        env = {"env_vars": dict(ENV.forwarded)} if ENV.forwarded else None
        return cls.options(
            runtime_env=env,
            num_cpus=ACTOR_CPUS,
            num_gpus=1 if use_gpu else 0,
            max_concurrency=2,  # the plan loop and a ping
            max_restarts=0,
            name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=index
            ),
        ).remote(self.config, spec, None, True)

    def _get(self, refs: list[Any], phase: str) -> list[Any]:
        """ray.get every rank's ref, bounded by the phase's limit (PHASES, else worker_timeout_s);
        an error names the rank and the phase."""
        import ray

        what, knob = PHASES.get(phase, ("", "worker_timeout_s"))
        timeout = getattr(self.config.parallel_config, knob)
        if what:
            logger.info(
                "ray executor: %s on %d ranks (limit %.0f s, parallel_config.%s)",
                what,
                len(refs),
                timeout,
                knob,
            )
        deadline = time.monotonic() + timeout
        index = {ref: i for i, ref in enumerate(refs)}
        values: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                names = ", ".join(self.specs[index[r]].name for r in pending)
                raise WorkerError(
                    f"{phase}: no answer within {timeout:.0f} s from {names} (parallel_config.{knob})"
                )
            for ref in ready:
                i = index[ref]
                try:
                    values[i] = ray.get(ref, timeout=0)
                except ray.exceptions.RayError as e:
                    raise WorkerError(f"{self.specs[i].name}: {phase} failed: {e}") from e
        return [values[i] for i in range(len(refs))]

    # ---------------------------------------------------------------------------------- steps

    def _check_alive(self) -> None:
        """Non-blocking: a rank whose plan loop call ended, or whose ping is overdue, raises WorkerError."""
        import ray

        ended, _ = ray.wait(self._loop_refs, num_returns=len(self._loop_refs), timeout=0)
        if ended:
            raise WorkerError(self._why_ended(ended))
        hb_timeout = self.config.parallel_config.heartbeat_timeout_s
        now = time.monotonic()
        stuck, waiting = [], False  # ranks that answer but made no progress; a ping still out
        for i, (ref, sent) in enumerate(self._pings):
            done, _ = ray.wait([ref], timeout=0)
            if done:
                try:
                    idle = ray.get(ref, timeout=0)
                except ray.exceptions.RayError as e:
                    raise WorkerError(f"{self.specs[i].name}: health check failed: {e}") from e
                if idle > hb_timeout:
                    stuck.append((idle, i))
                self._pings[i] = (self.actors[i].ping.remote(), now)
            elif now - sent > hb_timeout:  # answers nothing at all: the likeliest culprit
                raise WorkerError(
                    f"{self.specs[i].name}: no heartbeat for {now - sent:.1f} s "
                    f"(parallel_config.heartbeat_timeout_s={hb_timeout})"
                )
            else:
                waiting = True
        if (
            stuck and not waiting
        ):  # a rank blocked in a collective waits for a peer: name the first stopped
            idle, i = max(stuck)
            raise WorkerError(
                f"{self.specs[i].name}: its step loop made no progress for {idle:.1f} s, a missed heartbeat "
                f"(parallel_config.heartbeat_timeout_s={hb_timeout})"
            )

    def _why_ended(self, ended: list[Any]) -> str:
        """Name the ranks whose loop ended; a dead actor is named before a rank whose collective then failed."""
        import ray

        died, failed = [], []
        for ref in ended:
            spec = self.specs[self._loop_refs.index(ref)]
            try:
                ray.get(ref, timeout=0)
                failed.append(f"{spec.name}: left the plan loop unexpectedly")
            except ray.exceptions.RayActorError as e:
                died.append(
                    f"{spec.name}: worker actor died (pid {self.worker_pids.get(spec.rank)}): {_first_line(e)}"
                )
            except ray.exceptions.RayError as e:
                failed.append(f"{spec.name}: plan loop failed: {_first_line(e)}")
        return "; ".join(died + failed)

    # ------------------------------------------------------------------------------- shutdown

    def _stop(self, graceful: bool) -> None:
        """Shutdown plan (graceful), kill every actor, remove the placement group, stop our Ray. Bounded."""
        if self._closed:
            return
        self._closed = True
        import ray

        if ray.is_initialized():
            if graceful and self._loop_refs:
                self._leave_loops()
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            self._wait_actors_gone()
            if self.pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
            if self._owns_ray:
                ray.shutdown()
        if self.channel is not None:
            self.channel.close()

    def _leave_loops(self) -> None:
        """Let every rank leave its loop and its process groups (bounded), before ray.kill."""
        import ray

        try:
            if self.channel is not None and self.channel.ready:
                self.channel.publish_shutdown()
            else:  # the handshake never finished: a rank may not receive plans
                for actor in self.actors:
                    actor.stop.remote()
            ray.wait(
                self._loop_refs, num_returns=len(self._loop_refs), timeout=DESTROY_TIMEOUT_S + 2.0
            )
        except Exception as e:  # sockets or Ray already gone: ray.kill follows
            logger.warning("ray executor: graceful stop failed: %s", e)

    def _wait_actors_gone(self) -> None:
        """ray.kill is asynchronous: wait (bounded) until every actor's pending call has failed."""
        import ray

        refs = list(self._loop_refs) or [a.ping.remote() for a in self.actors]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=_KILL_WAIT_S)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
