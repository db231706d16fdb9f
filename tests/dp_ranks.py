"""The ranks of tests/test_dp_collectives.py's gloo test, in a module of their own: a spawned
process imports its target's module, and this one imports only torch and the collectives."""

from __future__ import annotations

import os
import time
import traceback

import torch

from atomrt.distributed.communication_op import (
    CollectiveTimeout,
    DPInfo,
    dp_all_gather,
    dp_reduce_scatter,
)


def dp_ranks(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        dp = DPInfo(rank, 2, dist.group.WORLD, timeout_s=1.5)
        x = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 100 * rank  # [3, 2]
        gathered = dp_all_gather(x, dp)  # [6, 2]
        summed = dp_reduce_scatter(gathered * (rank + 1), dp)  # [3, 2]
        result = {"gathered": gathered, "summed": summed}
        if rank == 0:  # rank 1 never joins this one
            start = time.monotonic()
            try:
                dp_all_gather(x, dp)
            except CollectiveTimeout as e:
                result["timeout"] = (str(e), time.monotonic() - start)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    if rank == 1:
        time.sleep(2.5)  # stay up past rank 0's deadline: it must time out, not see a dead peer
    os._exit(0)  # gloo's teardown after a timed-out collective can abort; results are written
