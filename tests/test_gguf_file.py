"""GGUFFile against gguf's own GGUFReader (the reference): every metadata value and every tensor
the same, on the embedded SmolLM2 GGUF and on a file written with every value type; arrays are
decoded only when asked for; files that do not parse are refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType, GGUFValueType

from atomrt.workers.loading.gguf_file import GGUFFile
from atomrt.workers.loading.loader import embedded_gguf_path

READER_ONLY = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # GGUFReader's own entries


def assert_same_as_reader(path: Path) -> GGUFFile:
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == [k for k in ref.fields if k not in READER_ONLY]
    for key, field in ours.fields.items():
        assert field.contents() == ref.fields[key].contents(), key
    assert ours.data_offset == ref.data_offset and ours.alignment == ref.alignment
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name,
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        )
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name
    return ours


def test_the_embedded_model_reads_as_gguf_reads_it() -> None:
    try:
        path = embedded_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
    ours = assert_same_as_reader(path)
    assert ours.fields["tokenizer.ggml.tokens"].count == 49152


def _write_every_type(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ☃")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.strs", ["a", "", "ü" * 40])
    w.add_array("t.bools", [True, False])
    w.add_array("t.none", [])
    w.add_key_value("t.nested", [[1, 2], [3]], GGUFValueType.ARRAY, GGUFValueType.ARRAY)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor(
        "q8",
        gguf.quants.quantize(q, GGMLQuantizationType.Q8_0),
        raw_dtype=GGMLQuantizationType.Q8_0,
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_type_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    _write_every_type(path)
    ours = assert_same_as_reader(path)
    assert ours.fields["t.str"].contents() == "héllo ☃"
    assert ours.fields["t.strs"].count == 3 and ours.fields["t.nested"].contents() == [1, 2, 3]
    q8 = next(t for t in ours.tensors if t.name == "q8")
    assert q8.data.shape == (4, 64 // 32 * 34)  # GGUFReader's layout: bytes per row


def test_arrays_decode_on_first_use(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    _write_every_type(path)
    field = GGUFFile(path).fields["t.strs"]
    assert not field._decoded and field.item_type == GGUFValueType.STRING
    assert field.contents() == ["a", "", "ü" * 40] and field._decoded


@pytest.mark.parametrize("keep", [0.0, 0.001, 0.5, 0.9])
def test_a_truncated_or_foreign_file_is_refused(tmp_path: Path, keep: float) -> None:
    good = tmp_path / "types.gguf"
    _write_every_type(good)
    bad = tmp_path / "bad.gguf"
    data = good.read_bytes()
    bad.write_bytes(data[: int(len(data) * keep)] if keep else b"not a gguf file" * 10)
    with pytest.raises(Exception) as e:
        GGUFFile(bad)
    assert isinstance(e.value, (ValueError, OverflowError)) or type(e.value).__name__ == "error"
