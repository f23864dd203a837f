"""GGUF files as pdlife reads them: the header, the metadata and each tensor's bytes.

Theory of operation. A GGUF file (versions 2 and 3; little-endian) is a header, the metadata
key/values, the tensor infos and, from the next multiple of ``general.alignment`` (32 unless
the metadata says otherwise), the tensors' data::

    magic "GGUF"  version u32  tensor count u64  key/value count u64
    per key:      key (string)  value type u32  value
    per tensor:   name (string)  dimension count u32  dimensions u64 ...  type u32  offset u64

A string is its byte count (u64) and its UTF-8 bytes; an array is its item type (u32), its item
count (u64) and the items. The file is memory-mapped: the metadata is parsed with ``struct``
and ``np.frombuffer`` as it is walked, once, and a tensor's ``data`` is a read-only numpy view
of its bytes, read only when the caller reads it. ``gguf.GGUFReader`` reads the same files but
builds a numpy view for every part of every field (the ~100,000 strings of a tokenizer's tokens
and merges each get two), which took ~85% of the time pdlife took to load SmolLM2.

The ``gguf`` package keeps the type constants, and its ``gguf.quants.dequantize`` takes a
tensor's ``data`` as it takes ``GGUFReader``'s: the float and integer types as arrays of their
own dtype in the tensor's shape, the quantized ones (BF16 among them) as bytes, one row of
blocks per row. Where this reader differs from ``GGUFReader``: the metadata holds the file's
keys only (not ``GGUF.version`` and the counts), an array of arrays keeps its nesting (the
reader flattens it) and is refused deeper than eight arrays (a damaged count could nest without
end), and big-endian files are refused (pdlife has never met one).

Every way a file can be damaged ends in :class:`GGUFFileError`, naming what was being read and
where: a bad magic, an unsupported version, a count, string or array that runs past the end
of the file, an unknown value or tensor type, a string that is not UTF-8, a duplicated key or
tensor name, a tensor whose data runs past the end of the file.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from typing import Any

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: Arrays of arrays deeper than this are refused (a damaged file could nest without end).
_MAX_NESTING = 8

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
#: Each scalar value type: its ``struct`` format (one value) and numpy dtype (arrays of them).
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, np.dtype[Any]]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<?"), np.dtype("<u1")),  # any byte but 0 is true
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
#: The fewest bytes an item of an array can take: a string's length, an array's type and count.
_MIN_ITEM_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
#: The tensor types whose data is an array of their own dtype; every other type's is bytes.
_ELEMENT_DTYPES: dict[GGMLQuantizationType, np.dtype[Any]] = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}
_BYTES: np.dtype[Any] = np.dtype(np.uint8)
#: The fewest bytes of a key/value (an empty key, a type, a one-byte value) and of a tensor info
#: (an empty name, no dimensions, a type, an offset): damaged counts are refused before looping.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


class GGUFFileError(ValueError):
    """A file that is not a GGUF file this reader reads; the message says what and where."""


@attrs.frozen(eq=False)
class GGUFTensor:
    """One tensor of a GGUF file: ``shape`` row-major (slowest dimension first, as numpy and
    torch index it; the file lists it the other way), ``data`` its bytes as a read-only view of
    the file, in the layout ``gguf.quants.dequantize(data, tensor_type)`` takes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray[Any, Any] = attrs.field(repr=False)


@attrs.frozen(eq=False)
class GGUFFile:
    """A GGUF file read: its version, metadata (the file's keys in its order: strings decoded,
    arrays as lists, numbers and bools as Python values) and tensors (in the file's order)."""

    version: int
    metadata: dict[str, Any] = attrs.field(repr=False)
    tensors: tuple[GGUFTensor, ...] = attrs.field(repr=False)
    alignment: int
    data_offset: int  # where the tensors' data starts; each tensor's offset counts from here


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The GGUF file at ``path``, memory-mapped; :class:`GGUFFileError` where it is not one
    (``OSError`` where it cannot be opened)."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            raise GGUFFileError("the file is empty")
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    return _Parser(buffer, size).file()


class _Parser:
    """A cursor over the file's bytes; ``where`` names what is being read, for the errors."""

    def __init__(self, buffer: mmap.mmap, size: int) -> None:
        self.buffer = buffer
        self.size = size
        self.offset = 0
        self.where = "the header"
        self.types: dict[str, GGUFValueType] = {}  # each metadata key's value type

    def file(self) -> GGUFFile:
        start = self._advance(4)
        magic = self.buffer[start:start + 4]
        if magic != _MAGIC:
            raise GGUFFileError(f"the file starts with {magic!r}, not GGUF's magic {_MAGIC!r}")
        version = self._u32()
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            endian = (" (a big-endian file? pdlife reads little-endian ones)"
                      if swapped in SUPPORTED_VERSIONS else "")
            raise GGUFFileError(f"GGUF version {version}{endian} is not supported "
                                f"(versions {' and '.join(map(str, SUPPORTED_VERSIONS))} are)")
        tensor_count, kv_count = self._u64(), self._u64()
        metadata = self._metadata(kv_count)
        infos = self._tensor_infos(tensor_count)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (self.types.get("general.alignment", GGUFValueType.UINT32) != GGUFValueType.UINT32
                or alignment <= 0 or alignment & (alignment - 1)):
            raise GGUFFileError(f"metadata general.alignment is {alignment!r}, not a power of "
                                "two as a UINT32")
        data_offset = -(-self.offset // alignment) * alignment
        tensors = tuple(self._tensor(data_offset, *info) for info in infos)
        return GGUFFile(version=version, metadata=metadata, tensors=tensors,
                        alignment=alignment, data_offset=data_offset)

    def _metadata(self, count: int) -> dict[str, Any]:
        self._check_count(count, _MIN_KV_BYTES, "metadata keys")
        metadata: dict[str, Any] = {}
        for index in range(count):
            self.where = f"metadata key #{index}"
            key = self._string()
            if key in metadata:
                raise GGUFFileError(f"metadata {key} appears twice (at byte {self.offset})")
            self.where = f"metadata {key}"
            kind = self._value_type(self._u32())
            metadata[key] = self._value(kind, 0)
            self.types[key] = kind
        return metadata

    def _tensor_infos(self, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
        """Each tensor's name, dimensions (as the file lists them), type and data offset."""
        self._check_count(count, _MIN_TENSOR_INFO_BYTES, "tensor infos")
        infos = []
        names: set[str] = set()
        for index in range(count):
            self.where = f"tensor info #{index}"
            name = self._string()
            if name in names:
                raise GGUFFileError(f"tensor {name!r} appears twice (at byte {self.offset})")
            names.add(name)
            self.where = f"tensor info {name!r}"
            dims_count = self._u32()
            self._check_count(dims_count, 8, "dimensions")
            start = self._advance(8 * dims_count)
            dims = tuple(np.frombuffer(self.buffer, "<u8", dims_count, start).tolist())
            infos.append((name, dims, self._u32(), self._u64()))
        return infos

    def _tensor(self, data_offset: int, name: str, dims: tuple[int, ...], raw_type: int,
                offset: int) -> GGUFTensor:
        try:
            kind = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise GGUFFileError(f"tensor {name!r} has type {raw_type}, not a GGML tensor "
                                "type") from None
        shape = tuple(reversed(dims))
        elements = math.prod(shape)
        dtype = _ELEMENT_DTYPES.get(kind, _BYTES)
        if kind in _ELEMENT_DTYPES:
            layout, count = shape, elements
        else:  # blocks of bytes: each row a whole number of blocks
            if not shape or shape[-1] % block_size:
                raise GGUFFileError(f"tensor {name!r} is {kind.name} of shape {shape}: its rows "
                                    f"are not a whole number of {block_size}-value blocks")
            count = elements // block_size * type_size
            layout = (*shape[:-1], shape[-1] // block_size * type_size)
        start = data_offset + offset
        end = start + count * dtype.itemsize
        if end > self.size:
            raise GGUFFileError(f"tensor {name!r} ({kind.name}, shape {shape}) takes bytes "
                                f"{start} to {end}, the file ends at byte {self.size}: the file "
                                "is truncated")
        try:
            data = np.frombuffer(self.buffer, dtype, count, start).reshape(layout)
        except ValueError as exc:  # a dimension numpy cannot index (an empty tensor's others)
            raise GGUFFileError(f"tensor {name!r} ({kind.name}) has shape {shape}: {exc}") from None
        return GGUFTensor(name=name, tensor_type=kind, shape=shape, data=data)

    def _value(self, kind: GGUFValueType, depth: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        scalar = _SCALARS.get(kind)
        if scalar is not None:
            form = scalar[0]
            return form.unpack_from(self.buffer, self._advance(form.size))[0]
        # An array (the only other value type): its items' type, their count, the items.
        if depth == _MAX_NESTING:
            raise GGUFFileError(f"{self.where}: arrays nested more than {_MAX_NESTING} deep "
                                f"(at byte {self.offset})")
        item = self._value_type(self._u32())
        count = self._u64()
        if item == GGUFValueType.STRING:
            return self._strings(count)
        if item == GGUFValueType.ARRAY:
            self._check_count(count, _MIN_ITEM_BYTES[item], "array items")
            return [self._value(item, depth + 1) for _ in range(count)]
        dtype = _SCALARS[item][1]
        self._check_count(count, dtype.itemsize, "array items")
        values = np.frombuffer(self.buffer, dtype, count, self._advance(count * dtype.itemsize))
        return (values != 0).tolist() if item == GGUFValueType.BOOL else values.tolist()

    def _strings(self, count: int) -> list[str]:
        """``count`` strings: the loop over a tokenizer's ~50,000 tokens, kept tight."""
        self._check_count(count, _MIN_ITEM_BYTES[GGUFValueType.STRING], "array items")
        buffer, size, offset = self.buffer, self.size, self.offset
        unpack = _U64.unpack_from
        strings: list[str] = []
        append = strings.append
        try:
            for _ in range(count):
                if offset + 8 > size:
                    break
                end = offset + 8 + unpack(buffer, offset)[0]
                if end > size:
                    break
                append(str(buffer[offset + 8:end], "utf-8"))
                offset = end
        except UnicodeDecodeError as exc:
            raise GGUFFileError(f"{self.where}: item {len(strings)} (at byte {offset}) is not "
                                f"UTF-8 ({exc.reason})") from None
        self.offset = offset
        if len(strings) < count:
            raise self._cut_short(f"item {len(strings)} of {count}")
        return strings

    def _string(self) -> str:
        length = self._u64()
        start = self._advance(length)
        try:
            return str(self.buffer[start:self.offset], "utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFileError(f"{self.where}: a string (at byte {start}) that is not UTF-8 "
                                f"({exc.reason})") from None

    def _value_type(self, raw: int) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFFileError(f"{self.where}: value type {raw} (at byte {self.offset - 4}) is "
                                "not a GGUF value type") from None

    def _u32(self) -> int:
        return int(_U32.unpack_from(self.buffer, self._advance(4))[0])

    def _u64(self) -> int:
        return int(_U64.unpack_from(self.buffer, self._advance(8))[0])

    def _advance(self, length: int) -> int:
        """The offset of the next ``length`` bytes, which the cursor moves past."""
        start = self.offset
        if start + length > self.size:
            raise self._cut_short(f"{length} bytes")
        self.offset = start + length
        return start

    def _check_count(self, count: int, least: int, what: str) -> None:
        """Refuse a count of items that cannot fit in the rest of the file at ``least`` bytes
        each, before looping over them."""
        if count * least > self.size - self.offset:
            raise self._cut_short(f"{count} {what}")

    def _cut_short(self, wanted: str) -> GGUFFileError:
        return GGUFFileError(f"{self.where}: {wanted} from byte {self.offset} run past the end "
                             f"of the file ({self.size} bytes): the file is truncated")


def dequantize(data: np.ndarray[Any, Any], tensor_type: GGMLQuantizationType
               ) -> np.ndarray[Any, Any]:
    """``gguf.quants.dequantize(data, tensor_type)``, bit for bit: float32 in the tensor's shape.

    Q4_1 and Q8_0 (SmolLM2's types) are computed here over the whole tensor in a few numpy
    operations, the same float32 operations in the same order as ``gguf``'s (which runs them
    16 rows at a time and took ~80% of the time to load SmolLM2 once the file was read); every
    other type goes to ``gguf`` (``NotImplementedError`` where it has no dequantization)."""
    if tensor_type == GGMLQuantizationType.Q4_1:
        return _dequantize_q4_1(data)
    if tensor_type == GGMLQuantizationType.Q8_0:
        return _dequantize_q8_0(data)
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(data, tensor_type)


def _blocks(data: np.ndarray[Any, Any], tensor_type: GGMLQuantizationType
            ) -> tuple[np.ndarray[Any, Any], tuple[int, ...]]:
    """``data``'s blocks (one a row) and the shape of its values."""
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    raw = data.view(np.uint8)
    if not raw.ndim or raw.shape[-1] % type_size:
        raise ValueError(f"{tensor_type.name} data of shape {raw.shape}: its rows are not a "
                         f"whole number of {type_size}-byte blocks")
    shape = (*raw.shape[:-1], raw.shape[-1] // type_size * block_size)
    return raw.reshape(-1, type_size), shape


def _scales(blocks: np.ndarray[Any, Any], start: int) -> np.ndarray[Any, Any]:
    """The float16 at byte ``start`` of every block, as a float32 column."""
    return blocks[:, start:start + 2].view(np.float16).astype(np.float32)


def _dequantize_q4_1(data: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # A block: scale d and minimum m (float16), then 16 bytes of 4-bit values q, the first 16
    # in the low nibbles, the last 16 in the high ones; each value is d * q + m.
    blocks, shape = _blocks(data, GGMLQuantizationType.Q4_1)
    nibbles = blocks[:, 4:]
    values = np.empty((len(blocks), 32), np.float32)
    values[:, :16] = nibbles & np.uint8(0x0F)
    values[:, 16:] = nibbles >> np.uint8(4)
    values *= _scales(blocks, 0)
    values += _scales(blocks, 2)
    return values.reshape(shape)


def _dequantize_q8_0(data: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # A block: scale d (float16), then 32 signed bytes q; each value is q * d.
    blocks, shape = _blocks(data, GGMLQuantizationType.Q8_0)
    values = blocks[:, 2:].view(np.int8).astype(np.float32)
    values *= _scales(blocks, 0)
    return values.reshape(shape)
