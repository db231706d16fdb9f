"""Everything that crosses a process boundary on the step path, with its msgpack codec.

Hot path: `encode` / `decode` run once per step on the driver and on every worker. What may live
here: message dataclasses and their wire form. No torch, no sockets, no pickle.

Wire form: `msgpack([type_tag, field_0, field_1, ...])`, fields in declaration order. A numpy array
travels as msgpack ext type 1 holding `[dtype.str, shape, raw C-order bytes]`; it decodes to a
read-only `np.frombuffer` view of the received bytes (no copy). Every message carries a step
number (`Hello` / `Ready` carry the handshake round instead: step -1 is "before step 0").

A decode step ships only what the worker lacks: the new token of each sequence (`input_ids`), its
context length (`num_computed_tokens`, from which the worker derives positions), and the block-table
entries it has not seen (`block_table_updates`). A sequence's prompt and sampling settings travel
once, in its `NewRequest`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

import msgpack
import numpy as np

_EXT_NDARRAY = 1


class MessageError(ValueError):
    """Bytes that are not a message of this protocol (wrong tag, wrong arity, bad array)."""


def _i32(x: Any = ()) -> np.ndarray:
    return np.asarray(x, dtype=np.int32)


def _i64(x: Any = ()) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def _bool(x: Any = ()) -> np.ndarray:
    return np.asarray(x, dtype=np.bool_)


# ---------------------------------------------------------------------------------------- messages


@dataclass
class NewRequest:
    """A sequence a worker has not seen: what it prefills and how its rows are sampled."""

    seq_id: int
    token_ids: np.ndarray = field(default_factory=_i32)  # int32 [n]: prompt (+ outputs after preemption)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int = -1  # -1: unseeded
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int = -1  # -1: none; 0: the sampled token's; k: plus the top k


@dataclass
class RankBatch:
    """One DP rank's share of a step. Row order of every [bs] array is `seq_ids` order."""

    new_requests: list[NewRequest] = field(default_factory=list)
    seq_ids: np.ndarray = field(default_factory=_i64)  # int64 [bs]
    num_new_tokens: np.ndarray = field(default_factory=_i32)  # int32 [bs]: query rows per sequence
    num_computed_tokens: np.ndarray = field(default_factory=_i32)  # int32 [bs]: context before this step
    input_ids: np.ndarray = field(default_factory=_i32)  # int32 [num_tokens]: this step's rows
    # seq_id -> (start index in the block table, int32 new block ids): only entries the worker lacks
    block_table_updates: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)
    sample_mask: np.ndarray = field(default_factory=_bool)  # bool [bs]: last row sampled this step
    finished_seq_ids: np.ndarray = field(default_factory=_i64)  # int64: free the worker's mirror
    preempted_seq_ids: np.ndarray = field(default_factory=_i64)  # int64: reset the worker's mirror

    @property
    def num_seqs(self) -> int:
        return int(self.seq_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class StepPlan:
    """Driver -> every worker, once per step: the ForwardMode decision and each DP rank's batch."""

    step: int
    mode: int = 0  # 0 eager, 1 token graph, 2 request graph
    bucket: int = 0  # the graph bucket every DP rank runs (0 when eager)
    running_bs: int = 0  # padded sequence count
    running_tokens: int = 0  # padded row count (what the DP all_gather pads to)
    is_prefill: bool = False
    num_tokens_across_dp: list[int] = field(default_factory=list)  # real rows per DP rank
    ranks: list[RankBatch] = field(default_factory=list)  # index = DP rank
    shutdown: bool = False

    MODE_EAGER = 0
    MODE_TOKEN_GRAPH = 1
    MODE_REQUEST_GRAPH = 2


@dataclass
class StepResult:
    """TP-rank-0 of a DP rank -> driver: the tokens it sampled this step (or the error it hit)."""

    step: int
    dp_rank: int
    seq_ids: np.ndarray = field(default_factory=_i64)  # int64 [n]: sampled rows' sequences
    sampled_token_ids: np.ndarray = field(default_factory=_i32)  # int32 [n]
    logprobs: Optional[np.ndarray] = None  # float32 [n]: the sampled token's logprob
    top_logprob_ids: Optional[np.ndarray] = None  # int32 [n, k]
    top_logprobs: Optional[np.ndarray] = None  # float32 [n, k]
    error: Optional[str] = None


@dataclass
class Hello:
    """Driver -> workers over PUB, repeated until every worker has answered with `Ready`."""

    step: int = -1  # the handshake precedes step 0
    instance: str = ""  # the engine instance: a worker ignores another engine's probe
    nonce: int = 0


@dataclass
class Ready:
    """Worker -> driver over PUSH: "my SUB receives your plans"."""

    rank: int
    nonce: int = 0
    step: int = -1
    pid: int = 0


Message = Union[NewRequest, RankBatch, StepPlan, StepResult, Hello, Ready]

# The wire tag of each type; append only (a tag is never reused).
_TAGS: dict[type, int] = {NewRequest: 1, RankBatch: 2, StepPlan: 3, StepResult: 4, Hello: 5, Ready: 6}
_TYPES: dict[int, type] = {tag: cls for cls, tag in _TAGS.items()}
_FIELDS: dict[type, tuple[str, ...]] = {cls: tuple(f.name for f in fields(cls)) for cls in _TAGS}


# ------------------------------------------------------------------------------------------ codec


_SCALARS = {int, float, bool, str}
_HEADS: dict[tuple[str, int], tuple[bytes, struct.Struct]] = {}  # (dtype.str, ndim) -> header prefix, shape format
_DTYPES: dict[bytes, np.dtype] = {}


def _pack_array(a: np.ndarray) -> msgpack.ExtType:
    # payload: len(dtype.str) u8 | dtype.str | ndim u8 | shape int64[ndim] | raw C-order bytes
    key = (a.dtype.str, a.ndim)
    head = _HEADS.get(key)
    if head is None:
        if a.dtype.hasobject:
            raise MessageError(f"cannot send an object array (dtype {a.dtype}); use a numeric dtype")
        dt = a.dtype.str.encode()
        head = _HEADS[key] = (bytes([len(dt)]) + dt + bytes([a.ndim]), struct.Struct(f"<{a.ndim}q"))
    return msgpack.ExtType(_EXT_NDARRAY, b"".join((head[0], head[1].pack(*a.shape), a.tobytes())))


def _unpack_ext(code: int, data: bytes) -> Any:
    if code != _EXT_NDARRAY:
        raise MessageError(f"unknown msgpack ext type {code}")
    try:
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
    except (IndexError, TypeError, ValueError, struct.error) as e:
        raise MessageError(f"bad array payload ({len(data)} bytes): {e}") from e


def _to_wire(obj: Any) -> Any:
    if obj is None or type(obj) in _SCALARS:
        return obj
    if isinstance(obj, np.ndarray):
        return _pack_array(obj)
    if isinstance(obj, (NewRequest, RankBatch)):
        return [_TAGS[type(obj)]] + [_to_wire(getattr(obj, n)) for n in _FIELDS[type(obj)]]
    if isinstance(obj, list):
        return [_to_wire(x) for x in obj]
    if isinstance(obj, dict):  # block_table_updates
        return _pack_block_table_updates(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _pack_block_table_updates(updates: dict[int, tuple[int, np.ndarray]]) -> list:
    """Flat on the wire: [seq_ids int64, starts int32, counts int32, concatenated block ids int32]."""
    entries = list(updates.values())
    blocks = [e[1] for e in entries]
    flat = np.concatenate(blocks).astype(np.int32, copy=False) if blocks else _i32()
    return [
        _pack_array(np.array(list(updates), dtype=np.int64)),
        _pack_array(np.array([e[0] for e in entries], dtype=np.int32)),
        _pack_array(np.array([len(b) for b in blocks], dtype=np.int32)),
        _pack_array(flat),
    ]


def _unpack_block_table_updates(wire: list) -> dict[int, tuple[int, np.ndarray]]:
    if not isinstance(wire, list) or len(wire) != 4:
        raise MessageError("RankBatch.block_table_updates: expected 4 arrays")
    seq_ids, starts, counts, flat = wire
    if not (seq_ids.shape == starts.shape == counts.shape) or int(counts.sum()) != flat.shape[0]:
        raise MessageError("RankBatch.block_table_updates: inconsistent array lengths")
    ends = np.cumsum(counts).tolist()
    begins = [0] + ends[:-1]
    return {s: (b, flat[lo:hi]) for s, b, lo, hi in zip(seq_ids.tolist(), starts.tolist(), begins, ends)}


def _from_wire_obj(cls: type, items: list) -> Any:
    names = _FIELDS[cls]
    if len(items) != len(names):
        raise MessageError(f"{cls.__name__}: expected {len(names)} fields, got {len(items)}")
    kwargs = dict(zip(names, items))
    if cls is RankBatch:
        kwargs["new_requests"] = [_nested(NewRequest, r) for r in kwargs["new_requests"]]
        kwargs["block_table_updates"] = _unpack_block_table_updates(kwargs["block_table_updates"])
    elif cls is StepPlan:
        kwargs["ranks"] = [_nested(RankBatch, r) for r in kwargs["ranks"]]
    return cls(**kwargs)


def _nested(cls: type, item: Any) -> Any:
    if not isinstance(item, list) or not item or item[0] != _TAGS[cls]:
        raise MessageError(f"expected a nested {cls.__name__}")
    return _from_wire_obj(cls, item[1:])


def encode(msg: Message) -> bytes:
    """Serialize a message to bytes (msgpack; arrays as raw buffers)."""
    cls = type(msg)
    if cls not in _TAGS:
        raise MessageError(f"not a message type: {cls.__name__}")
    wire = [_TAGS[cls]] + [_to_wire(getattr(msg, n)) for n in _FIELDS[cls]]
    return msgpack.packb(wire, use_bin_type=True)


def decode(data: Union[bytes, memoryview]) -> Message:
    """Parse bytes from `encode`. Arrays in the result are read-only views of `data`."""
    try:
        wire = msgpack.unpackb(data, raw=False, ext_hook=_unpack_ext, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise MessageError(f"undecodable message ({len(data)} bytes): {e}") from e
    if not isinstance(wire, list) or not wire or wire[0] not in _TYPES:
        raise MessageError(f"unknown message tag {wire[0] if isinstance(wire, list) and wire else wire!r}")
    try:
        return _from_wire_obj(_TYPES[wire[0]], wire[1:])
    except (TypeError, AttributeError, KeyError, IndexError) as e:
        raise MessageError(f"malformed {_TYPES[wire[0]].__name__}: {e}") from e
