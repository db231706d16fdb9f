"""The sampling worker's upload of a step's grammar masks (workers/runner/grammar_upload.py): the
rows and masks arrive unchanged, as int64 and int32; pinned buffers are a CUDA device's only."""

from __future__ import annotations

import numpy as np
import torch

from atomrt.workers.runner.grammar_upload import GrammarUpload


def test_a_cpu_worker_takes_the_masks_as_they_are() -> None:
    send = GrammarUpload(torch.device("cpu"), pinned=True)
    assert not send.pinned  # pinned memory is for a copy to a CUDA device
    rows = np.array([0, 3, 5], dtype=np.int32)
    bitmask = np.random.default_rng(0).integers(-(2**31), 2**31, (3, 7), dtype=np.int32)
    got_rows, got_mask = send(rows, bitmask)
    assert got_rows.dtype == torch.int64 and got_rows.tolist() == [0, 3, 5]
    assert got_mask.dtype == torch.int32 and np.array_equal(got_mask.numpy(), bitmask)
