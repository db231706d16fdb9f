"""The msgpack codec of everything that crosses a process boundary on the step path: the step
messages (distributed/step_messages.py) and the engine core's (distributed/core_messages.py), both
re-exported here, so callers import messages and codec from one place.

Hot path: `encode` / `decode` run once per step on the driver and on every worker. What may live
here: the wire form of the messages. No torch, no sockets, no pickle.

Wire form: `msgpack([type_tag, field_0, field_1, ...])`, fields in declaration order. A numpy array
in a field that declares its dtype (`default_factory=_i32 / _i64 / _bool`) travels, when it is 1-D of
that dtype, as msgpack bin of its raw bytes. Any other array travels as a msgpack ext: 1-D int32 /
int64 / bool / float32 as ext 3 / 4 / 5 / 6 holding its raw bytes alone, else ext 1 holding
`[dtype.str, shape, raw C-order bytes]`. Each decodes to a read-only `np.frombuffer` view of the
received bytes (no copy). Ext 2 is retired (it carried the block-table updates as a dict).

Every message carries a step number (`Hello` / `Ready` carry the handshake round instead: step -1
is "before step 0").

A `RankBatch`'s block-table updates travel as four flat arrays (see step_messages.py); `decode`
checks that the three per-update arrays are equally long and that the counts, none negative, add up
to the ids sent.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import fields
from operator import attrgetter
from typing import Any, Union

import msgpack
import numpy as np

from atomrt.distributed.core_messages import (
    CoreAbort,
    CoreOutput,
    CoreOutputs,
    CoreReady,
    CoreRequest,
    CoreShutdown,
    CoreStats,
)
from atomrt.distributed.step_messages import (
    DRAFT_TOKEN,
    PENDING_TOKEN,
    Flush,
    GrammarBitmask,
    Hello,
    NewRequest,
    PromptLogprobs,
    RankBatch,
    Ready,
    StepPlan,
    StepResult,
    WorkerSamplingParams,
)
from atomrt.distributed.wire_arrays import _bool, _i32, _i64
from atomrt.runtime.decision import ForwardDecision, ForwardKind
from atomrt.runtime.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [  # the messages (re-exported) and the codec
    "DRAFT_TOKEN",
    "PENDING_TOKEN",
    "CoreAbort",
    "CoreOutput",
    "CoreOutputs",
    "CoreReady",
    "CoreRequest",
    "CoreShutdown",
    "CoreStats",
    "Flush",
    "GrammarBitmask",
    "Hello",
    "Message",
    "MessageError",
    "NewRequest",
    "PromptLogprobs",
    "RankBatch",
    "Ready",
    "StepPlan",
    "StepResult",
    "WorkerSamplingParams",
    "decode",
    "encode",
    "wire_prefix",
]


class MessageError(ValueError):
    """Bytes that are not a message of this protocol (wrong tag, wrong arity, bad array)."""


Message = Union[
    NewRequest,
    RankBatch,
    StepPlan,
    StepResult,
    Hello,
    Ready,
    Flush,
    GrammarBitmask,
    CoreRequest,
    CoreAbort,
    CoreShutdown,
    CoreOutputs,
    CoreReady,
]

# The wire tag of each type; append only (a tag is never reused). ForwardDecision,
# WorkerSamplingParams, PromptLogprobs and StructuredOutputsParams travel only nested, in a
# StepPlan, a NewRequest, a StepResult and a SamplingParams.
_TAGS: dict[type, int] = {
    NewRequest: 1,
    RankBatch: 2,
    StepPlan: 3,
    StepResult: 4,
    Hello: 5,
    Ready: 6,
    Flush: 7,
    ForwardDecision: 8,
    WorkerSamplingParams: 9,
    CoreRequest: 10,
    CoreAbort: 11,
    CoreShutdown: 12,
    CoreOutput: 13,
    CoreStats: 14,
    CoreOutputs: 15,
    CoreReady: 16,
    SamplingParams: 17,
    PromptLogprobs: 18,
    StructuredOutputsParams: 19,
    GrammarBitmask: 20,
}
_TYPES: dict[int, type] = {tag: cls for cls, tag in _TAGS.items()}
_FIELDS: dict[type, tuple[str, ...]] = {cls: tuple(f.name for f in fields(cls)) for cls in _TAGS}


# ------------------------------------------------------------------------------------------ codec
#
# `encode` hands the message itself to msgpack's C packer; `_default` is called back only for what
# msgpack cannot pack: a message (-> its field list), an array (-> an ext), a numpy scalar.
# `decode` gets arrays back from `_unpack_ext` and builds the dataclasses.

# msgpack ext type codes; append only (a code is never reused)
_EXT_NDARRAY = 1  # any array: dtype and shape in the payload (see _pack_array)
# 2: retired, never to be reused (it carried RankBatch.block_table_updates, a dict, now flat arrays)
# 1-D arrays of the dtypes a step carries: the ext code names the dtype, the payload is the raw bytes
_EXT_1D: dict[np.dtype, int] = {
    np.dtype("<i4"): 3,
    np.dtype("<i8"): 4,
    np.dtype("|b1"): 5,
    np.dtype("<f4"): 6,
}
_EXT_1D_DTYPES: dict[int, np.dtype] = {code: dt for dt, code in _EXT_1D.items()}

_HEADS: dict[
    tuple[str, int], tuple[bytes, struct.Struct]
] = {}  # (dtype.str, ndim) -> header prefix, shape format
_DTYPES: dict[bytes, np.dtype] = {}


def _pack_array(a: np.ndarray) -> msgpack.ExtType:
    code = _EXT_1D.get(a.dtype)
    if code is not None and a.ndim == 1:
        return msgpack.ExtType(code, a.tobytes())
    # ext 1 payload: len(dtype.str) u8 | dtype.str | ndim u8 | shape int64[ndim] | raw C-order bytes
    key = (a.dtype.str, a.ndim)
    head = _HEADS.get(key)
    if head is None:
        if a.dtype.hasobject:
            raise MessageError(
                f"cannot send an object array (dtype {a.dtype}); use a numeric dtype"
            )
        dt = a.dtype.str.encode()
        head = _HEADS[key] = (bytes([len(dt)]) + dt + bytes([a.ndim]), struct.Struct(f"<{a.ndim}q"))
    return msgpack.ExtType(_EXT_NDARRAY, b"".join((head[0], head[1].pack(*a.shape), a.tobytes())))


def _unpack_ndarray(data: bytes) -> np.ndarray:
    n = data[0]
    ndim = data[1 + n]
    dtype = _DTYPES.get(data[1 : 1 + n])
    if dtype is None:
        dtype = _DTYPES[data[1 : 1 + n]] = np.dtype(data[1 : 1 + n].decode())
    off = 2 + n + 8 * ndim
    if ndim == 1:
        return np.frombuffer(data, dtype=dtype, offset=off)
    shape = struct.unpack_from(f"<{ndim}q", data, 2 + n)
    return np.frombuffer(data, dtype=dtype, offset=off).reshape(shape)


def _unpack_ext(code: int, data: bytes) -> Any:
    try:
        dtype = _EXT_1D_DTYPES.get(code)
        if dtype is not None:
            return np.frombuffer(data, dtype)
        if code == _EXT_NDARRAY:
            return _unpack_ndarray(data)
    except (IndexError, TypeError, ValueError, struct.error) as e:
        raise MessageError(
            f"bad payload of msgpack ext type {code} ({len(data)} bytes): {e}"
        ) from e
    raise MessageError(f"unknown msgpack ext type {code}")


def _getter(names: tuple[str, ...]) -> Any:
    """A callable giving a message's field values as a tuple (attrgetter of one name gives the value)."""
    if len(names) == 1:
        name = names[0]
        return lambda msg: (getattr(msg, name),)
    return attrgetter(*names)


_GETTERS: dict[type, Any] = {cls: _getter(names) for cls, names in _FIELDS.items()}
# (field index, dtype) of the array fields whose default factory names their dtype: a 1-D array of that
# dtype travels there as msgpack bin of its raw bytes (no ext, no callback); any other as an ext
_DECLARED_DTYPES = {_i32: np.dtype("<i4"), _i64: np.dtype("<i8"), _bool: np.dtype("|b1")}
_ARRAY_FIELDS: dict[type, tuple[tuple[int, np.dtype], ...]] = {
    cls: tuple(
        (i, _DECLARED_DTYPES[f.default_factory])
        for i, f in enumerate(fields(cls))
        if f.default_factory in _DECLARED_DTYPES
    )
    for cls in _TAGS
}
_NEW_REQUESTS_FIELD = _FIELDS[RankBatch].index("new_requests")
_NEW_BLOCK_FIELDS = slice(
    _FIELDS[RankBatch].index("new_block_seq_ids"), _FIELDS[RankBatch].index("new_block_ids") + 1
)
assert _FIELDS[RankBatch][_NEW_BLOCK_FIELDS] == (  # _check_new_blocks' arguments, in order
    "new_block_seq_ids",
    "new_block_starts",
    "num_new_blocks",
    "new_block_ids",
)
_RANKS_FIELD = _FIELDS[StepPlan].index("ranks")
_DECISION_FIELD = _FIELDS[StepPlan].index("decision")
_SAMPLING_FIELD = _FIELDS[NewRequest].index("sampling_params")
_PROMPT_LOGPROBS_FIELD = _FIELDS[StepResult].index("prompt_logprobs")
_STRUCTURED_FIELD = _FIELDS[SamplingParams].index("structured_outputs")
_DECISION_TUPLES = tuple(
    _FIELDS[ForwardDecision].index(n) for n in ("req_key", "dp_num_tokens", "dp_padded_tokens")
)


def _message_wire(msg: Any) -> list:
    cls = type(msg)
    wire = [_TAGS[cls], *_GETTERS[cls](msg)]  # [tag, field_0, ...]
    for i, dtype in _ARRAY_FIELDS[cls]:
        a = wire[1 + i]
        if type(a) is np.ndarray and a.dtype == dtype and a.ndim == 1:
            wire[1 + i] = a.tobytes()
    return wire


_ENCODERS: dict[type, Any] = {cls: _message_wire for cls in _TAGS}
_ENCODERS[np.ndarray] = _pack_array


def _default(obj: Any) -> Any:
    enc = _ENCODERS.get(type(obj))
    if enc is not None:
        return enc(obj)
    if isinstance(obj, np.ndarray):
        return _pack_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise MessageError(f"cannot encode a {type(obj).__name__}")


def _from_wire_obj(cls: type, items: list) -> Any:
    if len(items) != len(_FIELDS[cls]):
        raise MessageError(f"{cls.__name__}: expected {len(_FIELDS[cls])} fields, got {len(items)}")
    for i, dtype in _ARRAY_FIELDS[cls]:
        if type(items[i]) is bytes:
            items[i] = np.frombuffer(items[i], dtype=dtype)
    if cls is RankBatch:
        items[_NEW_REQUESTS_FIELD] = [_nested(NewRequest, r) for r in items[_NEW_REQUESTS_FIELD]]
        _check_new_blocks(*items[_NEW_BLOCK_FIELDS])
    elif cls is StepPlan:
        items[_RANKS_FIELD] = [_nested(RankBatch, r) for r in items[_RANKS_FIELD]]
        if items[_DECISION_FIELD] is not None:
            items[_DECISION_FIELD] = _nested(ForwardDecision, items[_DECISION_FIELD])
    elif cls is NewRequest:
        items[_SAMPLING_FIELD] = _nested(WorkerSamplingParams, items[_SAMPLING_FIELD])
    elif cls is StepResult:
        if items[_PROMPT_LOGPROBS_FIELD] is not None:
            items[_PROMPT_LOGPROBS_FIELD] = _nested(PromptLogprobs, items[_PROMPT_LOGPROBS_FIELD])
    elif cls is CoreRequest:
        if items[2] is not None:
            items[2] = _nested(SamplingParams, items[2])
    elif cls is SamplingParams:
        if items[_STRUCTURED_FIELD] is not None:
            items[_STRUCTURED_FIELD] = _nested(StructuredOutputsParams, items[_STRUCTURED_FIELD])
    elif cls is CoreOutputs:
        items[0] = [_nested(CoreOutput, o) for o in items[0]]
        items[1] = _nested(CoreStats, items[1])
    elif cls is ForwardDecision:
        items[0] = ForwardKind(items[0])
        for i in _DECISION_TUPLES:
            if items[i] is not None:
                items[i] = tuple(items[i])
    return cls(*items)


def _check_new_blocks(
    seq_ids: np.ndarray, starts: np.ndarray, counts: np.ndarray, block_ids: np.ndarray
) -> None:
    """What `SeqMirrors.apply` relies on: a seq id, a start and a count per update, and counts that
    are never negative and add up to the block ids sent."""
    n = len(seq_ids)
    if len(starts) != n or len(counts) != n:
        raise MessageError(
            f"RankBatch: {n} new_block_seq_ids, {len(starts)} new_block_starts and {len(counts)} "
            "num_new_blocks; expected one of each per block-table update"
        )
    num_new_blocks = counts.tolist()  # a list's sum and min: faster than numpy's at these sizes
    if n and min(num_new_blocks) < 0:
        raise MessageError(f"RankBatch: a negative count in num_new_blocks ({min(num_new_blocks)})")
    if sum(num_new_blocks) != len(block_ids):
        raise MessageError(
            f"RankBatch: num_new_blocks add up to {sum(num_new_blocks)} block ids, "
            f"but {len(block_ids)} new_block_ids were sent"
        )


def _nested(cls: type, item: Any) -> Any:
    if not isinstance(item, list) or not item or item[0] != _TAGS[cls]:
        raise MessageError(f"expected a nested {cls.__name__}")
    return _from_wire_obj(cls, item[1:])


_LOCAL = (
    threading.local()
)  # one Packer per thread: `_default` runs Python, so threads may interleave


def wire_prefix(cls: type, *leading: int) -> bytes:
    """The bytes every encoding of a `cls` message starts with, its first fields being `leading`
    (small non-negative ints): what a ZeroMQ subscriber filters messages by."""
    num_items = 1 + len(_FIELDS[cls])
    assert num_items <= 15 and all(0 <= v < 128 for v in leading), "fixarray, positive fixints"
    return bytes([0x90 | num_items, _TAGS[cls], *leading])


def encode(msg: Message) -> bytes:
    """Serialize a message to bytes (msgpack; arrays as raw buffers)."""
    if type(msg) not in _TAGS:
        raise MessageError(f"not a message type: {type(msg).__name__}")
    packer = getattr(_LOCAL, "packer", None)
    if packer is None:
        packer = _LOCAL.packer = msgpack.Packer(use_bin_type=True, default=_default)
    return packer.pack(msg)  # the Packer empties itself after each pack, raised or not


def decode(data: Union[bytes, memoryview]) -> Message:
    """Parse bytes from `encode`. Arrays in the result are read-only views of `data`."""
    try:
        wire = msgpack.unpackb(data, raw=False, ext_hook=_unpack_ext, strict_map_key=False)
    except MessageError:
        raise
    except (ValueError, msgpack.UnpackException) as e:
        raise MessageError(f"undecodable message ({len(data)} bytes): {e}") from e
    if not isinstance(wire, list) or not wire or wire[0] not in _TYPES:
        raise MessageError(
            f"unknown message tag {wire[0] if isinstance(wire, list) and wire else wire!r}"
        )
    try:
        return _from_wire_obj(_TYPES[wire[0]], wire[1:])
    except MessageError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        raise MessageError(f"malformed {_TYPES[wire[0]].__name__}: {e}") from e
