"""Reading and writing safetensors files, single or sharded with an index.

Format (a fact of the safetensors spec): 8 bytes little-endian header length N, N bytes of
JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then
the data; offsets count from the end of the header. We parse the header ourselves, rather
than through the safetensors package, so every offset, dtype and shape is checked before
any byte is read and a bad file gives an error naming the file and tensor. The rules are the
spec's in full: the tensors' byte ranges, sorted, tile the data section exactly (no overlap,
which would alias one tensor to another; no gap; no byte left over).

Reading goes through a memory map: an F32 or F16 tensor is copied straight from the map into
its destination; a BF16 tensor costs one temporary float32 copy of itself.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..core.atomic import atomic_open, fsync_dir, write_json
from ..core.errors import CheckpointError
from ..core.files import MappedFile, read_json_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

# Little-endian numpy dtypes of the safetensors dtypes. BF16 has no numpy dtype: read as uint16.
_NUMPY_DTYPE = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
    "F8_E4M3": "u1", "F8_E5M2": "u1",
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# What users type -> safetensors dtype code.
DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_MAX_HEADER_BYTES = 100 * 1024**2  # the spec's own limit; guards against a huge bogus length
_MIN_HEADER_BYTES = 2  # "{}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile(MappedFile):
    """One .safetensors file, header parsed and validated, data memory-mapped."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path, "safetensors", min_size=8)

    def _parse(self) -> None:
        n = int.from_bytes(self._map[:8], "little")
        if n < _MIN_HEADER_BYTES:
            raise CheckpointError(self.path, f"header length {n} is too short for a JSON header "
                                             "(not a safetensors file, or corrupt)")
        if n > self.size - 8:
            raise CheckpointError(self.path, f"header length {n} runs past the end of the {self.size}-byte file "
                                             "(truncated?)")
        if n > _MAX_HEADER_BYTES:
            raise CheckpointError(self.path, f"header length {n} exceeds the {_MAX_HEADER_BYTES}-byte limit")
        self._data_start = 8 + n
        self.metadata, self.tensors = _parse_header(self.path, self._map[8:8 + n], self.size - self._data_start)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(self.path, "tensor not in this file", key=name) from None

    def _raw(self, info: TensorInfo) -> np.ndarray:
        """A read-only view of the stored tensor (BF16 as uint16), no copy."""
        dtype = np.dtype(_NUMPY_DTYPE[info.dtype])
        count = math.prod(info.shape)
        arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + info.begin)
        return arr.reshape(info.shape)

    def read(self, name: str) -> np.ndarray:
        """A new float32 array holding the tensor."""
        info = self.info(name)
        out = np.empty(info.shape, dtype=np.float32)
        self.copy_into(name, out)
        return out

    def copy_into(self, name: str, out: np.ndarray, transpose: bool = False) -> None:
        """Convert the tensor to float32 into `out` (e.g. a view into the parameter arena).
        transpose=True: the stored tensor is the transpose of `out` (GPT-2 Conv1D weights)."""
        info = self.info(name)
        expected = tuple(reversed(out.shape)) if transpose else tuple(out.shape)
        if info.shape != expected:
            raise CheckpointError(self.path, f"shape {list(info.shape)}, expected {list(expected)}", key=name)
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(self.path, f"dtype {info.dtype} is not a floating-point weight "
                                             f"(supported: {', '.join(FLOAT_DTYPES)})", key=name)
        src = self._raw(info)
        if info.dtype == "BF16":
            # bfloat16 is the top half of a float32: widen, shift, reinterpret (one copy).
            widened = src.astype(np.uint32)
            widened <<= 16  # in place: this is the one copy
            src = widened.view(np.float32)
        out[...] = src.T if transpose else src  # F16/F64 cast during assignment, no full copy
        del src

    def read_flat(self, name: str, begin: int, end: int) -> np.ndarray:
        """Values [begin, end) of the tensor, flattened, as float32: a view of the map for F32
        (no copy), converted otherwise. For reading a 1-D tensor piece by piece."""
        info = self.info(name)
        count = math.prod(info.shape)
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(self.path, f"dtype {info.dtype} is not a floating-point tensor", key=name)
        if not 0 <= begin <= end <= count:
            raise CheckpointError(self.path, f"has {count} values; [{begin}, {end}) is not within them", key=name)
        src = self._raw(info).reshape(-1)[begin:end]
        if info.dtype == "BF16":
            return (src.astype(np.uint32) << 16).view(np.float32)
        return src.astype(np.float32, copy=False)

    def count_nonfinite(self, name: str) -> int:
        """NaN and Inf values of the tensor as loading would see them (converted to float32, so an
        F64 value beyond float32's range counts as Inf), read chunk by chunk from the map (its
        pages released as it goes: scanning a tensor leaves none of it resident)."""
        info = self.info(name)
        raw = self._raw(info).reshape(-1)
        count = 0
        released = 0
        for start in range(0, raw.size, SCAN_CHUNK):
            chunk = raw[start:start + SCAN_CHUNK]
            if info.dtype == "BF16":
                chunk = (chunk.astype(np.uint32) << 16).view(np.float32)
            with np.errstate(over="ignore"):
                count += count_nonfinite(chunk.astype(np.float32, copy=False))
            if start + SCAN_CHUNK - released >= _RELEASE_VALUES:
                self.release(name, released, start + SCAN_CHUNK)
                released = start + SCAN_CHUNK
        self.release(name, released)
        return count

    def data_offset(self, name: str) -> int:
        """Where the tensor's first byte is in the file."""
        return self._data_start + self.info(name).begin

    def release(self, name: str, begin: int = 0, end: Optional[int] = None) -> None:
        """Values [begin, end) of the tensor (flattened; end None: to its end) read: their pages
        leave this process's memory (the system's file cache keeps them; reading them again maps
        them again). A pass over a large checkpoint releases what it has read, so that its
        pages never all count in the process's resident memory at once."""
        info = self.info(name)
        itemsize = np.dtype(_NUMPY_DTYPE[info.dtype]).itemsize
        count = math.prod(info.shape)
        end = count if end is None else min(end, count)
        first = self._data_start + info.begin + itemsize * begin
        last = self._data_start + info.begin + itemsize * end
        first -= first % mmap.PAGESIZE  # madvise takes whole pages; a neighbour's part is read again if needed
        if last > first and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)


SCAN_CHUNK = 1 << 16  # values tested at a time: a small temporary (64 KB), whatever the tensor's size
_RELEASE_VALUES = 1 << 22  # values scanned between releases of their pages


def count_nonfinite(arr: np.ndarray) -> int:
    """How many NaN or Inf values a floating-point array holds, in chunks (np.isfinite on a whole
    500M-value tensor would allocate 500 MB of booleans). arr should be contiguous (a parameter
    view is), so that ravel() is a view, not a copy."""
    flat = np.ravel(arr)
    count = 0
    for start in range(0, flat.size, SCAN_CHUNK):
        chunk = flat[start:start + SCAN_CHUNK]
        count += chunk.size - int(np.count_nonzero(np.isfinite(chunk)))
    return count


def _parse_header(path: Path, header_bytes: bytes, data_len: int) -> tuple[dict, dict[str, TensorInfo]]:
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(path, f"header is not valid JSON ({e}); not a safetensors file, or corrupt") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(path, "__metadata__ is not a JSON object", key="__metadata__")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _parse_entry(path, name, entry, data_len)
    _check_ranges(path, list(tensors.values()), data_len)
    return metadata, tensors


def _check_ranges(path: Path, infos: list[TensorInfo], data_len: int) -> None:
    """The safetensors rule: the tensors' byte ranges, in order, tile the data section exactly,
    with no overlap (one tensor would alias another), no gap and no byte left over."""
    at, previous = 0, None  # where the next tensor must begin; the tensor that ended there
    for info in sorted(infos, key=lambda i: (i.begin, i.end)):
        if info.begin < at:
            raise CheckpointError(path, f"data_offsets [{info.begin}, {info.end}] overlap those of {previous.name!r} "
                                        f"[{previous.begin}, {previous.end}] (two tensors sharing bytes)",
                                  key=info.name)
        if info.begin > at:
            after = f"the end of {previous.name!r}" if previous is not None else "the start of the data"
            raise CheckpointError(path, f"data_offsets [{info.begin}, {info.end}] leave a gap of {info.begin - at} "
                                        f"bytes after {after} (byte {at})", key=info.name)
        at, previous = info.end, info
    if at != data_len:
        raise CheckpointError(path, f"the data section holds {data_len} bytes but the tensors cover {at}: "
                                    f"{data_len - at} bytes after the last tensor belong to none (corrupt, or "
                                    "written by a broken tool)", key=previous.name if previous is not None else None)


def _parse_entry(path: Path, name: str, entry, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(path, "header entry is not a JSON object", key=name)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _NUMPY_DTYPE:
        raise CheckpointError(path, f"unknown dtype {dtype!r}", key=name)
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise CheckpointError(path, f"shape {shape!r} is not a list of non-negative integers", key=name)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise CheckpointError(path, f"data_offsets {offsets!r} is not a pair of integers", key=name)
    begin, end = offsets
    if not 0 <= begin <= end or end > data_len:
        raise CheckpointError(path, f"data_offsets [{begin}, {end}] point outside the file's {data_len} data bytes "
                                    "(file truncated or header corrupt)", key=name)
    nbytes = math.prod(shape) * np.dtype(_NUMPY_DTYPE[dtype]).itemsize
    if end - begin != nbytes:
        raise CheckpointError(path, f"data_offsets [{begin}, {end}] hold {end - begin} bytes but "
                                    f"{dtype} {shape} needs {nbytes}", key=name)
    return TensorInfo(name, dtype, tuple(shape), begin, end)


class CheckpointReader:
    """The weights of a checkpoint folder: model.safetensors, or shards listed by
    model.safetensors.index.json. Also accepts the path of a single .safetensors file."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        self.files: list[SafetensorsFile] = []
        self._file_of: dict[str, SafetensorsFile] = {}
        # exists(), not is_file(): a FIFO or folder in a weight file's place is refused by name.
        if path.exists() and not path.is_dir():
            self.source = path
            self._open_single(path)
        elif (path / SINGLE_FILE).exists():  # preferred over an index, as transformers does
            self.source = path / SINGLE_FILE
            self._open_single(self.source)
        elif (path / INDEX_FILE).exists():
            self.source = path / INDEX_FILE
            self._open_index(self.source)
        else:
            raise CheckpointError(path, _missing_weights_message(path))

    def _open_single(self, path: Path) -> None:
        f = SafetensorsFile(path)
        self.files.append(f)
        self._file_of = {name: f for name in f.tensors}

    def _open_index(self, index_path: Path) -> None:
        weight_map = read_index(index_path)
        by_shard: dict[str, SafetensorsFile] = {}
        try:
            for name, shard in weight_map.items():
                if shard not in by_shard:
                    shard_path = index_path.parent / shard
                    if not shard_path.exists():
                        raise CheckpointError(index_path, f"names shard file {shard!r}, which does not exist", key=name)
                    by_shard[shard] = SafetensorsFile(shard_path)
                    self.files.append(by_shard[shard])
                f = by_shard[shard]
                if name not in f.tensors:
                    raise CheckpointError(f.path, f"tensor listed in {index_path.name} is not in this shard", key=name)
                self._file_of[name] = f
            # A tensor a shard holds but the index places elsewhere (or nowhere) would be ignored,
            # or be a second copy of one that is loaded: either way the files disagree.
            for shard, f in by_shard.items():
                for name in f.tensors:
                    if name not in weight_map:
                        raise CheckpointError(f.path, f"tensor is in this shard but not in {index_path.name}", key=name)
                    if weight_map[name] != shard:
                        raise CheckpointError(f.path, f"tensor is also in shard {weight_map[name]!r}, where "
                                                      f"{index_path.name} places it (a tensor in two shards)", key=name)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in self.files:
            f.close()

    @property
    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def file_of(self, name: str) -> SafetensorsFile:
        try:
            return self._file_of[name]
        except KeyError:
            raise CheckpointError(self.source, "tensor missing from the checkpoint", key=name) from None

    def info(self, name: str) -> TensorInfo:
        return self.file_of(name).info(name)

    def read(self, name: str) -> np.ndarray:
        return self.file_of(name).read(name)

    def copy_into(self, name: str, out: np.ndarray, transpose: bool = False) -> None:
        self.file_of(name).copy_into(name, out, transpose)


class ShardIndex(BaseModel):
    """model.safetensors.index.json: which shard file holds each tensor."""

    model_config = ConfigDict(strict=True, extra="allow")
    metadata: Optional[dict[str, Any]] = None
    weight_map: dict[str, str]


def read_index(index_path: Path) -> dict[str, str]:
    """The weight_map of a sharded checkpoint's index; shard names must be plain file names in
    the index's own folder (an index must not reach outside it)."""
    index = read_json_model(index_path, ShardIndex, INDEX_FILE)
    for name, shard in index.weight_map.items():
        if Path(shard).name != shard or shard in ("", ".", "..") or "\0" in shard:
            raise CheckpointError(index_path, f"weight_map gives shard {shard!r}, which is not a file name in this "
                                              "folder (an index must not reach outside it)", key=name)
    return index.weight_map


def _missing_weights_message(folder: Path) -> str:
    if not folder.exists():
        return "no such file or folder"
    if not folder.is_dir():
        return "not a .safetensors file or a checkpoint folder"
    pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
    hint = (f"; found {', '.join(sorted(pickles))}: zoo reads safetensors only (pickled weights can run code "
            "on load); convert them with transformers' save_pretrained(safe_serialization=True)") if pickles else ""
    return f"no {SINGLE_FILE} or {INDEX_FILE} in this folder{hint}"


# --- writing -------------------------------------------------------------------------------


_CHUNK = 1 << 20  # elements converted at a time when writing BF16


def _encode(arr: np.ndarray, dtype: str) -> np.ndarray:
    """`arr` as contiguous little-endian bytes of `dtype` (at most one copy of the tensor)."""
    if dtype == "F32":
        return np.ascontiguousarray(arr, dtype="<f4")
    if dtype == "F16":
        return np.ascontiguousarray(arr, dtype="<f2")
    if dtype == "BF16":
        flat = np.ascontiguousarray(arr, dtype="<f4").reshape(-1)
        out = np.empty(flat.size, dtype="<u2")
        for start in range(0, flat.size, _CHUNK):  # chunks keep the uint32 temporaries small
            part = flat[start:start + _CHUNK]
            bits = part.view("<u4")
            # Round to nearest, ties to even, as torch does; NaN must stay NaN (rounding could make it inf).
            rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
            rounded[np.isnan(part)] = 0x7FC0
            out[start:start + _CHUNK] = rounded
        return out.reshape(arr.shape)
    raise ValueError(f"cannot write dtype {dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")


@dataclass(frozen=True)
class Pieces:
    """A tensor written from pieces, never whole in memory: `pieces()` yields its values in
    order, flattened (e.g. a distributed run's moment shards, as they arrive)."""

    shape: tuple[int, ...]
    pieces: Any  # Callable[[], Iterable[np.ndarray]]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def write_file(path: str | os.PathLike, tensors: Iterable[tuple[str, "np.ndarray | Pieces"]], dtype: str = "F32",
               metadata: dict[str, str] | None = None) -> None:
    """Write one .safetensors file atomically. `tensors` is read twice (header, then data),
    so pass a list; arrays may be views (e.g. transposed), converted one at a time, or Pieces."""
    tensors = list(tensors)
    itemsize = np.dtype(_NUMPY_DTYPE[dtype]).itemsize
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, arr in tensors:
        nbytes = arr.size * itemsize
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
    with atomic_open(path) as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for name, arr in tensors:
            if not isinstance(arr, Pieces):
                f.write(memoryview(_encode(arr, dtype)).cast("B"))
                continue
            written = 0
            for piece in arr.pieces():
                f.write(memoryview(_encode(piece, dtype)).cast("B"))
                written += piece.size
            if written != arr.size:  # the header promised arr.size values: never leave such a file
                raise ValueError(f"{path}: tensor {name!r} got {written} values from its pieces, not {arr.size}")


def shard_file_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def plan_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Split tensors (in order) into shards of at most max_shard_bytes; a tensor larger than the
    limit gets a shard of its own."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


def write_checkpoint(folder: str | os.PathLike, tensors: list[tuple[str, np.ndarray]], dtype: str = "F32",
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write the weights of a checkpoint folder: model.safetensors, or shards and an index when
    they exceed max_shard_bytes. Each file is written atomically; weight files of an earlier
    save that the new one does not use are removed only after the new files are in place."""
    folder = Path(folder)
    itemsize = np.dtype(_NUMPY_DTYPE[dtype]).itemsize
    shards = plan_shards([arr.size * itemsize for _, arr in tensors], max_shard_bytes)
    written: list[Path] = []
    if len(shards) == 1:
        written.append(folder / SINGLE_FILE)
        write_file(written[0], tensors, dtype)
    else:
        weight_map = {}
        for k, members in enumerate(shards, start=1):
            name = shard_file_name(k, len(shards))
            write_file(folder / name, [tensors[i] for i in members], dtype)
            written.append(folder / name)
            weight_map.update({tensors[i][0]: name for i in members})
        total = sum(arr.size * itemsize for _, arr in tensors)
        write_json(folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        written.append(folder / INDEX_FILE)
    _remove_stale_weights(folder, written)
    return written


def _remove_stale_weights(folder: Path, keep: list[Path]) -> None:
    keep_names = {p.name for p in keep}
    stale = [folder / SINGLE_FILE, folder / INDEX_FILE] + list(folder.glob("model-*-of-*.safetensors"))
    removed = False
    for p in stale:
        if p.name not in keep_names and p.is_file():
            p.unlink()
            removed = True
    if removed:
        fsync_dir(folder)
