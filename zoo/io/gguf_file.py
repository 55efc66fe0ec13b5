"""GGUF files (llama.cpp's format) read: the header and the tensors, dequantized to float32.

The header (magic, version, metadata key/values, the tensor table) is parsed here over a memory
map, every count, length and offset checked against the bytes that are left before anything
is allocated or looped over: a truncated or corrupt file is an error naming the file and the
key or tensor where it breaks, never a hang (gguf-py's GGUFReader loops over an array's stated
length even past the end of the file) or an IndexError. The values are llama.cpp's own: the
value and tensor type codes, block sizes and the dequantizers come from its `gguf` package
(gguf.constants, gguf.quants), the reference that llama.cpp's converters are tested against.

Layout of a GGUF file (version 2 and 3, little-endian): "GGUF", u32 version, u64 tensor count,
u64 metadata count; the metadata as (string key, u32 value type, value); the tensor table as
(string name, u32 n_dims, u64 dims[n_dims] innermost first, u32 tensor type, u64 offset); then,
aligned to general.alignment (32 by default), the tensor data, each tensor at its offset.
Strings are a u64 byte length and UTF-8 bytes.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from ..core.errors import CheckpointError
from ..core.files import MappedFile

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays of ... (llama.cpp writes none nested; a bound keeps recursion finite)
# A tensor of more elements than this is no model tensor zoo could hold (2^36 floats, native/executor/limits.hpp).
MAX_TENSOR_ELEMENTS = 1 << 36

# Tensor types zoo dequantizes (gguf.quants has a reference dequantizer for each, llama.cpp's own
# algorithm in numpy). Other types (the IQ* and TQ* families, MXFP4, integer tensors) are refused
# by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")

# Bytes and struct formats of the scalar value types.
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
          GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
          GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
          GGUFValueType.FLOAT64: "<f8"}
# The fewest bytes one array element of each type takes (strings: their u64 length; arrays: type
# and length): an array whose stated length needs more than the bytes left is refused at once.
_MIN_ELEMENT_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALARS.items()},
                      GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): a (out, in) matrix is stored with rows of `in`
    type: int  # a GGMLQuantizationType value
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.type)


def type_name(code: int) -> str:
    try:
        return GGMLQuantizationType(code).name
    except ValueError:
        return f"type {code} (unknown)"


class _Truncated(Exception):
    """The header runs past the end of the file (caught and named where the read began)."""


class _Cursor:
    """Reads the header's little-endian fields from the map, never past its end."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.at = buf, size, 0

    def left(self) -> int:
        return self.size - self.at

    def take(self, n: int) -> int:
        """The offset of the next n bytes, which are then consumed."""
        if n > self.left():
            raise _Truncated
        start = self.at
        self.at += n
        return start

    def scalar(self, fmt: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        n = self.scalar("<Q")
        return bytes(self.buf[self.take(n):self.at])


class GGUFFile(MappedFile):
    """One GGUF file: `metadata` (key -> value: int, float, bool, str or list) and `tensors`
    (name -> GGUFTensor), the header checked whole when the file opens; `read(name)` gives a
    tensor as float32."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path, "GGUF", min_size=24)

    # --- the header ---

    def _parse(self) -> None:
        cur = _Cursor(self._map, self.size)
        if bytes(self._map[:4]) != MAGIC:
            raise CheckpointError(self.path, f"not a GGUF file (starts with {bytes(self._map[:4])!r}, not b'GGUF')")
        cur.take(4)
        version = cur.scalar("<I")
        if version & 0xFFFF == 0 and version != 0:
            raise CheckpointError(self.path, "a big-endian GGUF file; zoo reads little-endian ones (what llama.cpp "
                                             "writes by default)")
        if version not in VERSIONS:
            raise CheckpointError(self.path, f"GGUF version {version} is not supported (zoo reads versions "
                                             f"{', '.join(map(str, VERSIONS))})")
        self.version = version
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        # Every entry takes some bytes: a count beyond what is left is corrupt, not a loop to run.
        if n_kv * 12 > cur.left():
            raise self._truncated(f"the {n_kv:,} metadata entries the header announces")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = self._read_key(cur, i)
            try:
                kind = cur.scalar("<I")
                self.metadata[key] = self._read_value(cur, kind, key, 0)
            except _Truncated:
                raise self._truncated("this metadata value", key) from None
        if n_tensors * 24 > cur.left():
            raise self._truncated(f"the table of {n_tensors:,} tensors the header announces")
        infos = [self._read_tensor_info(cur, i) for i in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 \
                or alignment & (alignment - 1):
            raise CheckpointError(self.path, f"alignment {alignment!r} is not a power of two", key="general.alignment")
        data_start = -(-cur.at // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, code, offset in infos:
            self.tensors[name] = self._check_tensor(name, shape, code, offset, data_start, alignment)

    def _truncated(self, where: str, key: str | None = None) -> CheckpointError:
        return CheckpointError(self.path, f"truncated or corrupt: {where} would run past the end of the file "
                                          f"({self.size:,} bytes)", key=key)

    def _read_key(self, cur: _Cursor, i: int) -> str:
        try:
            raw = cur.string()
        except _Truncated:
            raise self._truncated(f"metadata entry {i + 1}") from None
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(self.path, f"metadata key {i + 1} is not UTF-8 text ({raw[:40]!r})") from None
        if key in self.metadata:
            raise CheckpointError(self.path, "metadata key appears twice", key=key)
        return key

    def _read_value(self, cur: _Cursor, kind: int, key: str, depth: int):
        if kind == GGUFValueType.FLOAT32:  # the shortest decimal that is this float32: 1e-05, not 9.99999974e-06
            return float(str(np.float32(cur.scalar("<f"))))
        if kind in _SCALARS:
            return cur.scalar(_SCALARS[GGUFValueType(kind)])
        if kind == GGUFValueType.STRING:
            raw = cur.string()
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CheckpointError(self.path, f"a string that is not UTF-8 (byte {e.start})", key=key) from None
        if kind != GGUFValueType.ARRAY:
            raise CheckpointError(self.path, f"unknown metadata value type {kind}", key=key)
        if depth >= MAX_NESTING:
            raise CheckpointError(self.path, f"arrays nested deeper than {MAX_NESTING}", key=key)
        item, n = cur.scalar("<I"), cur.scalar("<Q")
        if item not in _MIN_ELEMENT_BYTES:
            raise CheckpointError(self.path, f"array of unknown value type {item}", key=key)
        if n * _MIN_ELEMENT_BYTES[item] > cur.left():
            raise _Truncated
        if item in _NUMPY:  # numbers in one read (a 128K-entry score list)
            arr = np.frombuffer(self._map, dtype=_NUMPY[item], count=n, offset=cur.take(n * np.dtype(_NUMPY[item]).itemsize))
            return arr.tolist()
        if item == GGUFValueType.BOOL:
            return [bool(b) for b in bytes(self._map[cur.take(n):cur.at])]
        return [self._read_value(cur, item, key, depth + 1) for _ in range(n)]

    def _read_tensor_info(self, cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
        name = f"tensor {i + 1}"
        try:
            raw = cur.string()
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise CheckpointError(self.path, f"the name of tensor {i + 1} is not UTF-8 ({raw[:40]!r})") from None
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise CheckpointError(self.path, f"{n_dims} dimensions (GGUF tensors have 1 to {MAX_DIMS})", key=name)
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            code, offset = cur.scalar("<I"), cur.scalar("<Q")
        except _Truncated:
            raise self._truncated("this tensor's entry in the tensor table", key=name) from None
        return name, tuple(reversed(dims)), code, offset

    def _check_tensor(self, name: str, shape: tuple[int, ...], code: int, offset: int, data_start: int,
                      alignment: int) -> GGUFTensor:
        if name in self.tensors:
            raise CheckpointError(self.path, "tensor appears twice in the tensor table", key=name)
        if any(d <= 0 for d in shape) or math.prod(shape) > MAX_TENSOR_ELEMENTS:
            raise CheckpointError(self.path, f"shape {list(shape)} is not a tensor zoo can hold", key=name)
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(code)]
        except (ValueError, KeyError):
            raise CheckpointError(self.path, f"unknown tensor type {code}", key=name) from None
        if shape[-1] % block:
            raise CheckpointError(self.path, f"rows of {shape[-1]} values do not divide into {type_name(code)} "
                                             f"blocks of {block}", key=name)
        nbytes = math.prod(shape) // block * block_bytes
        if offset % alignment:
            raise CheckpointError(self.path, f"data offset {offset} is not a multiple of the alignment {alignment}",
                                  key=name)
        begin = data_start + offset
        if begin + nbytes > self.size:
            raise CheckpointError(self.path, f"truncated: the tensor's data ends at byte {begin + nbytes:,}, the file "
                                             f"has {self.size:,} bytes", key=name)
        return GGUFTensor(name, shape, code, begin, nbytes)

    # --- metadata, typed ---

    def architecture(self) -> str:
        return self.value("general.architecture", str)

    def value(self, key: str, kind: type, default: Any = ..., why: str = ""):
        """metadata[key] as `kind` (int, float, bool, str or list); a missing key gives `default`,
        or an error naming the key (and `why` it is needed) when there is none."""
        if key not in self.metadata:
            if default is ...:
                raise CheckpointError(self.path, f"required metadata key is missing{why}", key=key)
            return default
        value = self.metadata[key]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise CheckpointError(self.path, f"expected {'a list' if kind is list else kind.__name__}, "
                                             f"got {type(value).__name__} {_shown(value)}", key=key)
        return value

    # --- tensors ---

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(self.path, "tensor missing from the file", key=name) from None

    def check_type(self, name: str) -> None:
        t = self.tensor(name)
        if t.type_name not in SUPPORTED_TYPES:
            raise CheckpointError(self.path, f"tensor type {t.type_name} is not supported (zoo reads "
                                             f"{', '.join(SUPPORTED_TYPES)})", key=name)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor (a read-only view of the map), one row of blocks per row."""
        t = self.tensor(name)
        data = np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return data.reshape(*t.shape[:-1], -1)

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32, in its numpy shape (a new array)."""
        self.check_type(name)
        t = self.tensor(name)
        out = dequantize(self.raw(name), GGMLQuantizationType(t.type))  # F32: a read-only view of the map
        return out if out.flags.writeable and out.dtype == np.float32 else np.array(out, dtype=np.float32)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
