"""Training data: text files tokenized once into a cached, memory-mapped token file, then
cut into random training windows and fixed validation windows.

The token stream is every document (one file = one document) encoded with the model's
tokenizer, each preceded by BOS (when the tokenizer has one distinct from EOS) and followed
by EOS. The cache file is keyed by the files' paths, sizes, mtimes and content hashes and
by the tokenizer's identity, so changed data or a different tokenizer re-tokenizes.

Training windows are drawn from a generator seeded by (seed, step, micro-batch): the batch
of any step is known without replaying earlier ones, which is what makes --resume exact.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from .atomic import atomic_open, write_json
from .errors import CheckpointError
from .files import read_json_model, regular_file

CACHE_FORMAT = 1  # bump when the token file layout or document framing changes
_HASH_CHUNK = 1 << 20


class DataError(ValueError):
    """Training data that cannot be used: the message names the file at fault."""


# --- files ------------------------------------------------------------------------------


def list_text_files(paths: list[str | os.PathLike]) -> list[Path]:
    """The files named, and the files inside the folders named (recursively, sorted,
    hidden files and folders skipped). Every path must exist and the result be non-empty."""
    if not paths:
        raise DataError("no training data given: pass --data FILE_OR_FOLDER")
    files: list[Path] = []
    for p in map(Path, paths):
        if p.exists() and not p.is_dir():
            files.append(regular_file(p, "data file"))  # a FIFO or a device is refused by name: reading it could block
        elif p.is_dir():
            found = sorted(
                f for f in p.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise DataError(f"data folder {p}: contains no files")
            files.extend(found)
        else:
            raise DataError(f"data path {p}: no such file or folder")
    return files


def read_text(path: Path) -> str:
    """A file's text; not UTF-8 or empty is an error naming the file (and the byte offset)."""
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is not text
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"data file {path}: not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at byte offset {e.start})"
        ) from None
    if not text.strip():
        raise DataError(f"data file {path}: empty (no text to train on)")
    return text


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_identity(tokenizer) -> str:
    """A string that changes whenever the tokenizer would encode differently.

    Uses the tokenizer's own fingerprint where it has one; otherwise the ids it gives a
    probe text covering many scripts and whitespace, plus its vocabulary size and specials.
    """
    own = getattr(tokenizer, "fingerprint", None)
    if own is not None:
        return str(own() if callable(own) else own)
    probe = ("The quick brown fox, 1234567890!\n\n  Ünïcödé — 日本語 テキスト, русский, العربية 🙂\t"
             "it's won't I'm you'll   spaces\r\n<|endoftext|><s></s>")
    ids = list(tokenizer.encode(probe))
    payload = [type(tokenizer).__name__, tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, ids]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def default_cache_dir() -> Path:
    env = os.environ.get("ZOO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "zoo"


# --- tokenize once, cache -------------------------------------------------------------


@dataclass
class TokenFile:
    tokens: np.ndarray  # read-only memory map, uint16 or uint32
    path: Path
    key: str  # cache key: identifies the data and the tokenizer
    files: list[Path]
    reused: bool  # True when the cache was hit


def tokenize_files(paths: list[str | os.PathLike], tokenizer, cache_dir: str | os.PathLike | None = None) -> TokenFile:
    """Tokenize the data into a cached token file (or reuse the cache) and memory-map it."""
    files = list_text_files(paths)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = _cache_key(files, tokenizer)
    tok_path = cache / f"tokens-{key[:24]}.bin"
    meta_path = tok_path.with_suffix(".json")
    dtype = token_dtype(tokenizer.vocab_size)

    meta = _read_meta(meta_path)
    if meta is not None and meta.key == key and tok_path.is_file() \
            and tok_path.stat().st_size == meta.n_tokens * dtype.itemsize:
        return TokenFile(_map(tok_path, dtype), tok_path, key, files, reused=True)

    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"token cache folder {cache}: cannot create it ({e.strerror or e})") from None
    n_tokens = _write_tokens(files, tokenizer, tok_path, dtype)
    try:  # written after the tokens: a meta file always describes a complete token file
        write_json(meta_path, {
            "key": key, "format": CACHE_FORMAT, "n_tokens": n_tokens, "dtype": dtype.name,
            "files": [str(f.resolve()) for f in files],
        })
    except OSError as e:
        raise DataError(f"token cache file {meta_path}: cannot write it ({e.strerror or e})") from None
    return TokenFile(_map(tok_path, dtype), tok_path, key, files, reused=False)


def _cache_key(files: list[Path], tokenizer) -> str:
    h = hashlib.sha256()
    h.update(f"zoo-tokens-v{CACHE_FORMAT}\n{tokenizer_identity(tokenizer)}\n".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{_file_digest(f)}\n".encode())
    return h.hexdigest()


def _document_frame(tokenizer) -> tuple[list[int], list[int]]:
    """Tokens put before and after each document."""
    eos, bos = tokenizer.eos_id, tokenizer.bos_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token to separate documents with")
    before = [bos] if bos is not None and bos != eos else []
    return before, [eos]


def _write_tokens(files: list[Path], tokenizer, tok_path: Path, dtype: np.dtype) -> int:
    """Encode every file, one at a time, into the cache file (atomically: all or nothing)."""
    before, after = _document_frame(tokenizer)
    limit = np.iinfo(dtype).max
    n = 0
    try:
        with atomic_open(tok_path) as out:
            for f in files:
                ids = np.asarray(before + list(tokenizer.encode(read_text(f))) + after, dtype=np.int64)
                if ids.min() < 0 or ids.max() > limit:
                    raise DataError(f"data file {f}: tokenizer produced id {ids.max()} outside {dtype.name}")
                out.write(ids.astype(dtype).tobytes())
                n += ids.size
    except OSError as e:
        raise DataError(f"token cache file {tok_path}: cannot write it ({e.strerror or e})") from None
    return n


class CacheMeta(BaseModel):
    """The JSON file beside a cached token file, describing it."""

    model_config = ConfigDict(strict=True, extra="allow")
    key: str
    format: int
    n_tokens: int
    dtype: str
    files: list[str]


def _read_meta(path: Path) -> CacheMeta | None:
    """The cache's description of a token file; None when it is missing or unusable (not a
    regular file, not JSON, wrong fields): the cache is rebuilt, replacing it."""
    if not path.exists():
        return None
    try:
        return read_json_model(path, CacheMeta, "token cache file")
    except CheckpointError:
        return None


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


# --- a rank's share of a global batch ---------------------------------------------------


@dataclass(frozen=True)
class BatchShare:
    """What one of `ranks` processes computes of every optimizer step's global batch
    (batch_size x grad_accum sequences): rows [rows[0], rows[1]) of each of the micro-batches
    `micros`, each pullback scaled by `scale`, so that the gradients summed over the ranks are
    the gradient of the whole batch (every sequence holds seq_len targets: a mean over rows
    is the mean of equal-sized parts' means)."""

    rows: tuple[int, int]
    micros: range
    scale: float


def batch_share(batch_size: int, grad_accum: int, rank: int = 0, ranks: int = 1) -> BatchShare:
    """A contiguous slice of the rows of every micro-batch where batch_size divides among the
    ranks; else whole micro-batches dealt round robin (rank r: r, r + ranks, ...), where
    grad_accum does. The data order depends on (seed, step, micro-batch) only, never on the
    ranks: any rank count trains on the same batches."""
    if batch_size % ranks == 0:
        part = batch_size // ranks
        return BatchShare((rank * part, (rank + 1) * part), range(grad_accum), 1.0 / (grad_accum * ranks))
    if grad_accum % ranks == 0:
        return BatchShare((0, batch_size), range(rank, grad_accum, ranks), 1.0 / grad_accum)
    raise DataError(f"{ranks} ranks cannot share a global batch of --batch-size {batch_size} x --grad-accum "
                    f"{grad_accum}: one of the two must be a multiple of {ranks} (each rank takes a slice of every "
                    "micro-batch, or whole micro-batches)")


# --- windows --------------------------------------------------------------------------


class Windows:
    """Training and validation batches over one token stream.

    The last `val_fraction` of the stream is the validation split; validation windows are
    fixed (evenly spaced over it), training windows random (seeded per step).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, val_fraction: float,
                 eval_batches: int, seed: int, source: str = "the data"):
        n = len(tokens)
        need = seq_len + 1  # one window: seq_len inputs and the next token of each as target
        if n < need:
            raise DataError(f"{source}: {n} tokens, shorter than one sequence "
                            f"(seq_len {seq_len} + 1); add text or lower --seq-len")
        n_val = int(n * val_fraction) if val_fraction > 0 else 0
        if val_fraction > 0 and n_val < need:
            n_val = need  # the smallest validation split that holds one window
        n_train = n - n_val
        if n_train < need:
            raise DataError(f"{source}: {n} tokens leave {n_train} for training after the "
                            f"validation split ({n_val}), shorter than one sequence (seq_len {seq_len} + 1); "
                            "add text, lower --seq-len or --val-fraction")
        self.tokens = tokens
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.n_train, self.n_val = n_train, n_val
        self._span = np.arange(need, dtype=np.int64)
        self._val_starts = None
        if n_val:
            last = n - need  # windows start in [n_train, n - need]
            self._val_starts = np.linspace(n_train, last, eval_batches * batch_size).round().astype(np.int64)

    def train_batch(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        """The (inputs, targets) of micro-batch `micro` of optimizer step `step`."""
        rng = np.random.default_rng((self.seed, step, micro))
        starts = rng.integers(0, self.n_train - self.seq_len, size=self.batch_size)  # last start: n_train - need
        return self._gather(starts)

    def val_batches(self):
        """The fixed validation batches (none when there is no validation split)."""
        if self._val_starts is None:
            return
        for i in range(0, len(self._val_starts), self.batch_size):
            yield self._gather(self._val_starts[i:i + self.batch_size])

    def _gather(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = self.tokens[starts[:, None] + self._span].astype(np.int32)
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])
