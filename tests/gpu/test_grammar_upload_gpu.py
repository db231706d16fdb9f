"""Grammar masks through the pinned buffers (workers/runner/grammar_upload.py) arrive on the device
unchanged, step after step, while the buffers take turns and grow, and a buffer is written again
only once the copy out of it has run (the host copy of a later step never shows in an earlier
step's device mask)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atomrt.workers.runner.grammar_upload import SLOTS, GrammarUpload

pytestmark = pytest.mark.gpu


def test_pinned_uploads_keep_every_steps_masks() -> None:
    send = GrammarUpload(torch.device("cuda"), pinned=True)
    assert send.pinned
    rng = np.random.default_rng(0)
    sent, got = [], []
    for step, m in enumerate([3, 64, 5, 128, 1, 64, 64]):
        torch.cuda._sleep(2_000_000)  # a forward still queued ahead of the copy
        rows = rng.permutation(200)[:m].astype(np.int32)
        rows.setflags(write=False)  # as a decoded message's arrays are
        bitmask = rng.integers(-(2**31), 2**31, (m, 4008), dtype=np.int32)
        sent.append((rows, bitmask.copy()))
        got.append(send(rows, bitmask))
        bitmask[:] = step  # the driver's array is its own again once sent
    torch.cuda.synchronize()
    for (rows, bitmask), (dev_rows, dev_mask) in zip(sent, got):
        assert dev_rows.dtype == torch.int64 and dev_mask.dtype == torch.int32
        assert np.array_equal(dev_rows.cpu().numpy(), rows)
        assert np.array_equal(dev_mask.cpu().numpy(), bitmask)
    assert len(send._slots) == SLOTS and all(s.host.is_pinned() for s in send._slots)
