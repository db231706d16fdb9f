"""A GGUF file's metadata and tensor table, read the way atomrt uses them.

`gguf.GGUFReader` turns every value of every array into numpy views as it opens a file: a model
with a large vocabulary carries its tokenizer as arrays of tens of thousands of strings, which
took seconds to open (the embedded SmolLM2's 49152 tokens and merges: about 4 s). `GGUFFile`
reads the header, skips arrays by their lengths, and decodes an array only when its contents are
asked for. Its fields and tensors answer what GGUFReader's do for the calls atomrt makes:
`fields[key].contents()`, and each tensor's `name`, `tensor_type`, `shape` and `data` (a read-only
view of the mapped file, in GGUFReader's layout: quantized types as bytes per row).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import quant_shape_to_byte_shape

_VERSIONS = (2, 3)
# scalar value types: (struct format, numpy dtype for arrays of them)
_SCALARS = {
    GGUFValueType.UINT8: ("<B", np.uint8),
    GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16),
    GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32),
    GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32),
    GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
    GGUFValueType.BOOL: ("<?", np.bool_),
}
# tensor types stored as plain numbers: GGUFReader's item dtype for them
_PLAIN_TENSORS = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFField:
    """One metadata value: decoded at once when it is a scalar or a string, at the first
    `contents()` when it is an array."""

    def __init__(self, buf: Any, name: str, vtype: GGUFValueType, offset: int) -> None:
        self.name, self.type = name, vtype
        self._buf, self._offset = buf, offset
        self._value: Any = None
        self._decoded = vtype != GGUFValueType.ARRAY
        if self._decoded:
            self._value, _ = _read_value(buf, vtype, offset)
        else:
            self.item_type, self.count, _ = _array_header(buf, offset)

    def contents(self) -> Any:
        """The value: a Python scalar or str, or a list (an array of arrays flattened, as
        GGUFReader gives it)."""
        if not self._decoded:
            self._value, _ = _read_value(self._buf, self.type, self._offset)
            self._decoded = True
        return self._value


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # uint64 dims, innermost first (GGUF's order)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """A GGUF file (versions 2 and 3, little-endian), mapped read-only: `fields` by key, `tensors`
    in file order. A file that does not parse raises ValueError or struct.error."""

    def __init__(self, path: str | Path) -> None:
        self.data = np.memmap(path, mode="r")
        buf = self.data
        size = buf.shape[0]
        if size < 24 or struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = struct.unpack_from("<I", buf, 4)[0]
        if version not in _VERSIONS:
            if version & 0xFFFF == 0:
                raise ValueError("a byte-swapped (big-endian) GGUF file is not supported")
            raise ValueError(f"GGUF version {version} is not supported ({_VERSIONS})")
        tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
        offs = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(kv_count):
            key, offs = _read_str(buf, offs)
            vtype = GGUFValueType(struct.unpack_from("<I", buf, offs)[0])
            offs += 4
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            self.fields[key] = GGUFField(buf, key, vtype, offs)
            offs = _skip_value(buf, vtype, offs)
        infos = []
        for _ in range(tensor_count):
            name, offs = _read_str(buf, offs)
            (n_dims,) = struct.unpack_from("<I", buf, offs)
            dims = np.frombuffer(buf, dtype="<u8", count=n_dims, offset=offs + 4).copy()
            offs += 4 + 8 * n_dims
            raw_type, rel = struct.unpack_from("<IQ", buf, offs)
            offs += 12
            infos.append((name, dims, GGMLQuantizationType(raw_type), rel))
        self.alignment = GGUF_DEFAULT_ALIGNMENT
        align = self.fields.get("general.alignment")
        if align is not None:
            if align.type != GGUFValueType.UINT32:
                raise ValueError("bad type for general.alignment")
            self.alignment = align.contents()
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise ValueError("invalid alignment: must be a non-zero power of two")
        self.data_offset = offs + (-offs % self.alignment)
        self.tensors = [self._tensor(*info, size) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    def _tensor(
        self, name: str, dims: np.ndarray, ttype: GGMLQuantizationType, rel: int, size: int
    ) -> GGUFTensor:
        n_elements = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[ttype]
        n_bytes = n_elements * type_size // block_size
        start = self.data_offset + rel
        if start + n_bytes > size:
            raise ValueError(f"tensor {name!r} ends past the end of the file")
        np_dims = tuple(reversed(dims.tolist()))
        dtype: Optional[type] = _PLAIN_TENSORS.get(ttype)
        if dtype is None:
            dtype, np_dims = np.uint8, quant_shape_to_byte_shape(np_dims, ttype)
        data = self.data[start : start + n_bytes].view(dtype).reshape(np_dims)
        return GGUFTensor(name, ttype, dims, n_elements, n_bytes, start, data)


def _read_str(buf: Any, offs: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offs)
    end = offs + 8 + n
    if end > buf.shape[0]:
        raise ValueError("a string runs past the end of the file")
    return bytes(buf[offs + 8 : end]).decode("utf-8"), end


def _array_header(buf: Any, offs: int) -> tuple[GGUFValueType, int, int]:
    """An array value's (item type, item count, offset of its first item)."""
    raw_type, count = struct.unpack_from("<IQ", buf, offs)
    return GGUFValueType(raw_type), count, offs + 12


def _skip_value(buf: Any, vtype: GGUFValueType, offs: int) -> int:
    """The offset just past a value of type `vtype` at `offs`, decoding none of it."""
    if vtype == GGUFValueType.STRING:
        return offs + 8 + struct.unpack_from("<Q", buf, offs)[0]
    scalar = _SCALARS.get(vtype)
    if scalar is not None:
        return offs + struct.calcsize(scalar[0])
    if vtype != GGUFValueType.ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype}")
    item_type, count, offs = _array_header(buf, offs)
    scalar = _SCALARS.get(item_type)
    if scalar is not None:
        return offs + count * struct.calcsize(scalar[0])
    if item_type == GGUFValueType.STRING:
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            offs += 8 + unpack(buf, offs)[0]
        return offs
    for _ in range(count):
        offs = _skip_value(buf, item_type, offs)
    return offs


def _read_value(buf: Any, vtype: GGUFValueType, offs: int) -> tuple[Any, int]:
    """(the value of type `vtype` at `offs`, the offset past it)."""
    if vtype == GGUFValueType.STRING:
        return _read_str(buf, offs)
    scalar = _SCALARS.get(vtype)
    if scalar is not None:
        return struct.unpack_from(scalar[0], buf, offs)[0], offs + struct.calcsize(scalar[0])
    if vtype != GGUFValueType.ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype}")
    item_type, count, offs = _array_header(buf, offs)
    scalar = _SCALARS.get(item_type)
    if scalar is not None:
        values = np.frombuffer(buf, dtype=scalar[1], count=count, offset=offs)
        return values.tolist(), offs + values.nbytes
    out: list[Any] = []
    for _ in range(count):
        value, offs = _read_value(buf, item_type, offs)
        if item_type == GGUFValueType.ARRAY:
            out.extend(value)  # GGUFReader flattens nested arrays
        else:
            out.append(value)
    return out, offs
