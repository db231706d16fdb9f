"""The array fields of the wire messages (distributed/messages.py's codec): a field whose default
factory is one of these declares its dtype, and a 1-D array of that dtype travels as raw bytes."""

from __future__ import annotations

from typing import Any

import numpy as np


def _i32(x: Any = ()) -> np.ndarray:
    return np.asarray(x, dtype=np.int32)


def _i64(x: Any = ()) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def _bool(x: Any = ()) -> np.ndarray:
    return np.asarray(x, dtype=np.bool_)
