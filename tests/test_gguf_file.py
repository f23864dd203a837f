"""pdlife's GGUF reader (``scheduler/model/gguf_file.py``) against ``gguf.GGUFReader``.

Both read the shipped SmolLM2 file and files written with ``gguf.GGUFWriter`` (every metadata
value type, arrays of each, every common tensor type, another alignment): the same metadata
(``field.contents()``), the same tensors (name, type, shape, data dtype, data shape and bytes),
so the same fingerprint. Damaged files (cut at any byte, a bad magic or version, unknown types,
data past the end) are refused with :class:`GGUFFileError`, and by the loader with a one-line
``CheckpointError``. The whole-tensor Q4_1 and Q8_0 dequantization equals ``gguf``'s bit for bit.
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf.quants import quantize
from hypothesis import given
from hypothesis import strategies as st

from scheduler.model.checkpoint import CheckpointError, WeightDigest
from scheduler.model.gguf_checkpoint import load_gguf
from scheduler.model.gguf_file import GGUFFile, GGUFFileError, dequantize, read_gguf
from scheduler.model.shipped import shipped_path
from tests.test_checkpoint import tiny_hf_model, write_gguf

# -- comparing with gguf's reader -----------------------------------------------------------------


def _typed(value: Any) -> Any:
    """``value`` with each item's type beside it and floats as their exact hex (NaN included),
    so that ``1 == 1.0 == True`` and ``nan != nan`` do not hide a difference."""
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return type(value).__name__, value.hex() if isinstance(value, float) else value


def _flat(value: Any) -> Any:
    """An array of arrays flattened, as ``GGUFReader`` gives it."""
    if isinstance(value, list) and any(isinstance(v, list) for v in value):
        return [leaf for v in value for leaf in _flat(v)]
    return value


def assert_reads_as_gguf_does(ours: GGUFFile, theirs: gguf.GGUFReader) -> None:
    assert list(ours.metadata) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, value in ours.metadata.items():
        assert _typed(_flat(value)) == _typed(theirs.fields[key].contents()), key
    assert ours.alignment == theirs.alignment and ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (t.name, t.tensor_type)
        assert mine.shape == tuple(reversed(t.shape.tolist())), t.name
        assert (mine.data.dtype, mine.data.shape) == (t.data.dtype, t.data.shape), t.name
        assert mine.data.tobytes() == t.data.tobytes(), t.name


def fingerprint_as_gguf_reads_it(path: Path, checkpoint: Any) -> str:
    """The fingerprint the loader gave when ``gguf.GGUFReader`` read the file."""
    digest = WeightDigest()
    for t in gguf.GGUFReader(str(path)).tensors:
        digest.add(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                   np.ascontiguousarray(t.data))
    return digest.fingerprint(checkpoint.config)


# -- the shipped file ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped() -> tuple[Path, GGUFFile, gguf.GGUFReader]:
    path = shipped_path("smollm2")
    return path, read_gguf(path), gguf.GGUFReader(str(path))


def test_the_shipped_file_reads_as_gguf_reads_it(shipped):
    _, ours, theirs = shipped
    assert_reads_as_gguf_does(ours, theirs)
    assert ours.version == 3 and len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert ours.metadata["tokenizer.ggml.add_bos_token"] is False


def test_the_shipped_files_fingerprint_is_what_it_was(shipped):
    path, _, _ = shipped
    checkpoint = load_gguf(path)
    assert checkpoint.fingerprint == fingerprint_as_gguf_reads_it(path, checkpoint)


def test_the_shipped_files_tensors_dequantize_as_gguf_dequantizes_them(shipped):
    _, ours, _ = shipped
    assert {Q.Q4_1, Q.Q8_0} <= {t.tensor_type for t in ours.tensors}
    for t in ours.tensors:
        expected = gguf.quants.dequantize(t.data, t.tensor_type)
        got = dequantize(t.data, t.tensor_type)
        assert (got.dtype, got.shape) == (np.float32, expected.shape), t.name
        assert got.tobytes() == expected.tobytes(), t.name


# -- files written with gguf's writer --------------------------------------------------------------

#: Each scalar value type with values at its edges (what a float32 reads back as, not 0.1).
EDGES: dict[V, list[Any]] = {
    V.UINT8: [0, 255], V.INT8: [-128, 127], V.UINT16: [0, 65535], V.INT16: [-32768, 32767],
    V.UINT32: [0, 2**32 - 1], V.INT32: [-2**31, 2**31 - 1], V.UINT64: [0, 2**64 - 1],
    V.INT64: [-2**63, 2**63 - 1], V.FLOAT32: [float(np.float32(0.1)), -3.5, float("inf")],
    V.FLOAT64: [0.1, -1e300, float("-inf")], V.BOOL: [True, False],
    V.STRING: ["", "llama", "naïve 日本語 🦙", "a\0b"],
}


def _write(path: Path, meta: dict[str, tuple[V, Any, V | None]],
           tensors: Sequence[tuple[str, np.ndarray, Q | None]] = (), alignment: int = 0) -> None:
    """A GGUF file from ``meta`` (key -> (type, value, array item type)) and ``tensors``
    (name, array, raw type: its bytes are then already of that type)."""
    w = gguf.GGUFWriter(str(path), arch=None)  # type: ignore[arg-type]  # no general.architecture
    if alignment:
        w.add_custom_alignment(alignment)
    for key, (kind, value, item) in meta.items():
        w.add_key_value(key, value, kind, sub_type=item)
    for name, array, raw in tensors:
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _every_kind(path: Path, alignment: int = 0) -> None:
    rng = np.random.default_rng(1)
    meta: dict[str, tuple[V, Any, V | None]] = {}
    for kind, values in EDGES.items():
        for i, value in enumerate(values):
            meta[f"scalar.{kind.name}.{i}"] = (kind, value, None)
        meta[f"array.{kind.name}"] = (V.ARRAY, values, kind)
    meta["array.nested"] = (V.ARRAY, [[1, 2], [3]], None)
    meta["array.nested.strings"] = (V.ARRAY, [["a"], ["b", "ç"]], None)
    weights = rng.standard_normal((4, 64)).astype(np.float32)
    tensors = [
        ("f32", weights, None), ("f16", weights.astype(np.float16), None),
        ("f32.scalar", np.array(2.5, np.float32), None),  # no dimensions
        ("f32.3d", rng.standard_normal((2, 3, 5)).astype(np.float32), None),
        ("i32", np.arange(7, dtype=np.int32), None),
        ("q8_0", quantize(weights, Q.Q8_0), Q.Q8_0), ("q4_1", quantize(weights, Q.Q4_1), Q.Q4_1),
        ("bf16", quantize(weights, Q.BF16), Q.BF16),
    ]
    _write(path, meta, tensors, alignment)


@pytest.mark.parametrize("alignment", [0, 64, 1])
def test_every_value_and_tensor_type_reads_as_gguf_reads_it(tmp_path, alignment):
    path = tmp_path / "every.gguf"
    _every_kind(path, alignment)
    ours = read_gguf(path)
    assert_reads_as_gguf_does(ours, gguf.GGUFReader(str(path)))
    assert ours.alignment == (alignment or 32) and ours.data_offset % ours.alignment == 0
    for kind, values in EDGES.items():
        assert _typed(ours.metadata[f"array.{kind.name}"]) == _typed(values)
        assert _typed(ours.metadata[f"scalar.{kind.name}.0"]) == _typed(values[0])
    assert ours.metadata["array.nested"] == [[1, 2], [3]]  # gguf's reader flattens them
    assert ours.metadata["array.nested.strings"] == [["a"], ["b", "ç"]]
    shapes = {t.name: t.shape for t in ours.tensors}
    assert shapes["f32"] == shapes["q4_1"] == (4, 64) and shapes["f32.scalar"] == ()
    assert shapes["f32.3d"] == (2, 3, 5)


@pytest.mark.parametrize("kind", [k for k in V if k != V.ARRAY] + [V.ARRAY])
def test_an_empty_array_of_each_type_reads_as_an_empty_list(tmp_path, kind):
    """gguf's writer will not write one; llama.cpp's can."""
    path = tmp_path / "empty.gguf"
    path.write_bytes(_file([_kv("empty", V.ARRAY, _u32(kind) + _u64(0))]))
    assert read_gguf(path).metadata == {"empty": []}
    assert gguf.GGUFReader(str(path)).fields["empty"].contents() == []


_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_SCALAR_VALUES: dict[V, st.SearchStrategy[Any]] = {
    V.UINT8: st.integers(0, 2**8 - 1), V.INT8: st.integers(-2**7, 2**7 - 1),
    V.UINT16: st.integers(0, 2**16 - 1), V.INT16: st.integers(-2**15, 2**15 - 1),
    V.UINT32: st.integers(0, 2**32 - 1), V.INT32: st.integers(-2**31, 2**31 - 1),
    V.UINT64: st.integers(0, 2**64 - 1), V.INT64: st.integers(-2**63, 2**63 - 1),
    V.FLOAT32: st.floats(width=32), V.FLOAT64: st.floats(), V.BOOL: st.booleans(),
    V.STRING: _TEXT,
}


@st.composite
def _metadata(draw: st.DrawFn) -> dict[str, tuple[V, Any, V | None]]:
    meta: dict[str, tuple[V, Any, V | None]] = {}
    for key in draw(st.lists(_TEXT.filter(bool), max_size=6, unique=True)):
        kind = draw(st.sampled_from(sorted(_SCALAR_VALUES)))
        if draw(st.booleans()):
            meta[key] = (kind, draw(_SCALAR_VALUES[kind]), None)
        else:
            meta[key] = (V.ARRAY, draw(st.lists(_SCALAR_VALUES[kind], min_size=1, max_size=8)),
                         kind)
    return meta


@given(_metadata())
def test_any_metadata_reads_as_gguf_reads_it(meta):
    with tempfile.TemporaryDirectory() as where:
        path = Path(where) / "meta.gguf"
        _write(path, meta)
        ours = read_gguf(path)
        assert_reads_as_gguf_does(ours, gguf.GGUFReader(str(path)))
        for key, (kind, value, _) in meta.items():
            if kind == V.FLOAT32:  # stored as float32: what it reads back as
                value = float(np.float32(value))
            elif kind == V.ARRAY and meta[key][2] == V.FLOAT32:
                value = [float(np.float32(v)) for v in value]
            assert _typed(ours.metadata[key]) == _typed(value), key


def test_a_test_models_fingerprint_is_what_it_was(tmp_path):
    """Every tensor type ``tests/test_checkpoint.py`` writes (F32, F16, BF16, Q4_0 ... Q8_0,
    Q6_K): the fingerprint as the file's bytes gave it when ``gguf`` read them."""
    write_gguf(tmp_path / "tiny.gguf", tiny_hf_model())
    checkpoint = load_gguf(tmp_path / "tiny.gguf")
    assert checkpoint.fingerprint == fingerprint_as_gguf_reads_it(tmp_path / "tiny.gguf",
                                                                   checkpoint)


# -- damaged files ---------------------------------------------------------------------------------


def _u32(value: int) -> bytes:
    return struct.pack("<I", value)


def _u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def _str(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return _u64(len(data)) + data


def _kv(key: str | bytes, kind: int, payload: bytes) -> bytes:
    return _str(key) + _u32(kind) + payload


def _info(name: str, dims: Sequence[int], kind: int, offset: int) -> bytes:
    return (_str(name) + _u32(len(dims)) + b"".join(map(_u64, dims)) + _u32(kind)
            + _u64(offset))


def _file(kvs: Sequence[bytes], infos: Sequence[bytes] = (), data: bytes = b"",
          version: int = 3) -> bytes:
    """A GGUF file built byte by byte (to write what gguf's writer will not)."""
    head = (b"GGUF" + _u32(version) + _u64(len(infos)) + _u64(len(kvs)) + b"".join(kvs)
            + b"".join(infos))
    return head + bytes(-len(head) % 32) + data


def _refused(tmp_path: Path, data: bytes, said: str) -> None:
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFFileError, match=said):
        read_gguf(path)
    with pytest.raises(CheckpointError) as refusal:
        load_gguf(path)
    message = str(refusal.value)
    assert message.startswith(f"{path}: not a readable GGUF file (damaged or truncated?): ")
    assert "\n" not in message


def test_a_file_cut_at_any_byte_is_refused(tmp_path):
    whole_path = tmp_path / "whole.gguf"
    _every_kind(whole_path, alignment=64)
    whole = whole_path.read_bytes()
    theirs = gguf.GGUFReader(str(whole_path))
    end = max(t.data_offset + t.n_bytes for t in theirs.tensors)
    assert end > theirs.data_offset > 1000
    cut = tmp_path / "cut.gguf"
    for length in [*range(theirs.data_offset + 1), *range(theirs.data_offset, end, 7), end - 1]:
        cut.write_bytes(whole[:length])
        with pytest.raises(GGUFFileError, match=r"empty|truncated"):
            read_gguf(cut)
    cut.write_bytes(whole[:end])  # the padding after the last tensor is not needed
    assert_reads_as_gguf_does(read_gguf(cut), theirs)


def test_a_model_file_cut_anywhere_is_refused_in_one_line(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", tiny_hf_model())
    whole = (tmp_path / "tiny.gguf").read_bytes()
    end = max(t.data_offset + t.n_bytes
              for t in gguf.GGUFReader(str(tmp_path / "tiny.gguf")).tensors)
    for length in range(0, end, max(1, end // 97)):
        _refused(tmp_path, whole[:length], "empty|truncated")


def test_bad_magic_and_versions_are_refused(tmp_path):
    good = _file([_kv("general.name", V.STRING, _str("x"))])
    _refused(tmp_path, b"GGML" + good[4:], "not GGUF's magic")
    _refused(tmp_path, b"not a gguf file at all", "not GGUF's magic")
    _refused(tmp_path, b"GG", "truncated")
    _refused(tmp_path, b"", "the file is empty")
    for version in (0, 1, 4):
        _refused(tmp_path, good[:4] + _u32(version) + good[8:],
                 f"GGUF version {version} is not supported")
    _refused(tmp_path, good[:4] + struct.pack(">I", 3) + good[8:], "big-endian")
    for version in (2, 3):
        path = tmp_path / f"v{version}.gguf"
        path.write_bytes(good[:4] + _u32(version) + good[8:])
        assert read_gguf(path).version == version


def test_damaged_metadata_is_refused(tmp_path):
    name = _kv("general.name", V.STRING, _str("x"))
    _refused(tmp_path, _file([_kv("k", 13, b"")]), "metadata k: value type 13 .* is not a GGUF")
    _refused(tmp_path, _file([_kv("k", V.ARRAY, _u32(99) + _u64(0))]), "value type 99")
    _refused(tmp_path, _file([name, name]), "metadata general.name appears twice")
    _refused(tmp_path, _file([_kv(b"\xff", V.UINT8, b"\0")]), "key #0: a string .* not UTF-8")
    _refused(tmp_path, _file([_kv("k", V.STRING, _str(b"a\xc3"))]), "metadata k: .*not UTF-8")
    strings = _u32(V.STRING) + _u64(2) + _str("ok") + _str(b"\xc3\x28")
    _refused(tmp_path, _file([_kv("k", V.ARRAY, strings)]), "metadata k: item 1 .* not UTF-8")
    _refused(tmp_path, _file([_kv("k", V.STRING, _u64(2**64 - 1))]), "truncated")
    _refused(tmp_path, _file([_kv("k", V.ARRAY, _u32(V.UINT64) + _u64(2**61))]), "truncated")
    _refused(tmp_path, _file([_kv("k", V.ARRAY, _u32(V.STRING) + _u64(2**62))]), "truncated")
    huge = b"GGUF" + _u32(3) + _u64(0) + _u64(2**63)
    _refused(tmp_path, huge, r"9223372036854775808 metadata keys .* truncated")
    deep = _u32(V.ARRAY) + _u64(1)
    _refused(tmp_path, _file([_kv("k", V.ARRAY, deep * 9 + _u32(V.UINT8) + _u64(0))]),
             "nested more than 8 deep")
    assert read_gguf(_written(tmp_path, _file([_kv("k", V.ARRAY, deep * 7 + _u32(V.UINT8)
                                                    + _u64(0))]))).metadata == {
        "k": [[[[[[[[]]]]]]]]}
    for kind, value in [(V.UINT32, _u32(48)), (V.UINT32, _u32(0)), (V.UINT64, _u64(32))]:
        _refused(tmp_path, _file([_kv("general.alignment", kind, value)]),
                 "general.alignment is .* not a power of two as a UINT32")


def _written(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "written.gguf"
    path.write_bytes(data)
    return path


def test_damaged_tensor_infos_are_refused(tmp_path):
    data = np.arange(8, dtype=np.float32).tobytes()
    f32 = _info("w", [8], Q.F32, 0)
    assert read_gguf(_written(tmp_path, _file([], [f32], data))).tensors[0].shape == (8,)
    _refused(tmp_path, _file([], [_info("w", [8], 99, 0)], data), "'w' has type 99, not a GGML")
    _refused(tmp_path, _file([], [f32, f32], data + data), "tensor 'w' appears twice")
    _refused(tmp_path, _file([], [_info("w", [8], Q.F32, 4)], data),
             r"'w' \(F32, shape \(8,\)\) takes bytes 68 to 100, the file ends at byte 96: the "
             "file is truncated")
    _refused(tmp_path, _file([], [_info("w", [2**40, 2**40], Q.F32, 0)], data), "truncated")
    _refused(tmp_path, _file([], [_info("w", [8], Q.F32, 2**64 - 1)], data), "truncated")
    _refused(tmp_path, _file([], [_info("w", [31], Q.Q4_1, 0)], data),
             r"'w' is Q4_1 of shape \(31,\): its rows are not a whole number of 32-value blocks")
    _refused(tmp_path, _file([], [_info("w", [], Q.Q4_1, 0)], data), "not a whole number")
    _refused(tmp_path, _file([], [_str("w") + _u32(2**31)], data), "2147483648 dimensions")
    # An empty tensor's other dimension may be any u64: none numpy cannot index passes.
    _refused(tmp_path, _file([], [_info("w", [2**63, 0], Q.F32, 0)], data),
             r"'w' \(F32\) has shape \(0, 9223372036854775808\)")


# -- dequantization ------------------------------------------------------------------------------


@st.composite
def _blocks(draw: st.DrawFn, kind: Q) -> np.ndarray:
    """Any bytes (NaN and infinite scales among them) as rows of ``kind``'s blocks."""
    rows, blocks = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    size = gguf.GGML_QUANT_SIZES[kind][1] * blocks
    raw = draw(st.binary(min_size=rows * size, max_size=rows * size))
    return np.frombuffer(raw, np.uint8).reshape(rows, size)


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0])
@given(data=st.data())
def test_q4_1_and_q8_0_dequantize_as_gguf_does_bit_for_bit(kind, data):
    raw = data.draw(_blocks(kind))
    with np.errstate(all="ignore"):
        expected = gguf.quants.dequantize(raw, kind)
        got = dequantize(raw, kind)
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
    assert got.view(np.uint32).tolist() == expected.view(np.uint32).tolist()


def test_other_types_are_left_to_gguf():
    weights = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    for kind in (Q.F16, Q.Q4_0, Q.Q5_1, Q.BF16):
        packed = quantize(weights, kind)
        assert dequantize(packed, kind).tobytes() == gguf.quants.dequantize(packed,
                                                                             kind).tobytes()
    with pytest.raises(NotImplementedError):
        dequantize(np.zeros(4, np.float64), Q.F64)
    with pytest.raises(ValueError, match="whole number of 20-byte blocks"):
        dequantize(np.zeros((2, 30), np.uint8), Q.Q4_1)
