"""Training data: files tokenized once into a cached, memory-mapped token file (with a loss
mask and the examples' boundaries beside it), then cut into training and validation batches.

Each file's format is detected on its own (data_formats): plain text (the file is one
document), records of documents ({"text"}), of prompt/completion pairs, of chats ({"messages"},
rendered with the checkpoint's chat template), of ShareGPT conversations ({"conversations"} of
{"from", "value"}: a chat) or of Alpaca records ({"instruction", "input", "output"}, rendered as a
two-turn chat), the records from JSONL, Parquet or Arrow files (records.py: a table read a batch
of rows at a time, its columns renamed by --data-columns), or token ids already (.npy, or a flat
.bin of uint16 ids, uint32 for vocabularies above 65,536). A document is framed by BOS (when the tokenizer has
one distinct from EOS) and EOS, and every token of it is trained on; a prompt, a user turn or a
system prompt is context only (loss on the completion and the assistant turns), unless the run
trains on everything.

Data that is all documents is one token stream cut into windows (Windows). Data with masked
examples is packed (PackedWindows): whole examples side by side in rows of seq_len tokens, each
restarting at position 0, so attention never crosses from one into another.

The cache file is keyed by the files' paths, sizes, mtimes and content hashes, the tokenizer's
identity and the chat template, so changed data or a different tokenizer re-tokenizes.
Training batches are drawn from a generator seeded by (seed, step, micro-batch): the batch of
any step is known without replaying earlier ones, which is what makes --resume exact. A mixture
(--data a.parquet:0.7 b.jsonl:0.3) tokenizes each source on its own and draws each row's source
by weight with that same generator (MixedWindows, training_data).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..core.atomic import atomic_open, write_json
from ..core.errors import ChatTemplateError, CheckpointError
from ..core.files import read_json_model, regular_file
from .records import (
    DataError,
    data_sources,
    is_table,
    records,
    saved_dataset_files,
    split_weight,
    uniform_records,
)

CACHE_FORMAT = 2  # bump when the token file layout or document framing changes
_HASH_CHUNK = 1 << 20


# --- files ------------------------------------------------------------------------------


def list_text_files(paths: list[str | os.PathLike]) -> list[Path]:
    """The files named, and the files inside the folders named (recursively, sorted,
    hidden files and folders skipped). Every path must exist and the result be non-empty.
    A folder `datasets.save_to_disk` wrote gives its Arrow files (a DatasetDict's, its train
    split's); a folder holding Parquet or Arrow files (a folder of shards) gives those alone, its
    other files (a dataset card, metadata) left out. A mixture weight (PATH:WEIGHT) is set aside."""
    if not paths:
        raise DataError("no training data given: pass --data FILE_OR_FOLDER")
    files: list[Path] = []
    for p in (Path(split_weight(p)[0]) for p in paths):
        if p.exists() and not p.is_dir():
            files.append(regular_file(p, "data file"))  # a FIFO or a device is refused by name: reading it could block
        elif p.is_dir():
            saved = saved_dataset_files(p)
            if saved is not None:
                files.extend(saved)
                continue
            found = sorted(
                f for f in p.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise DataError(f"data folder {p}: contains no files")
            tables = [f for f in found if is_table(f)]
            files.extend(tables or found)
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


# --- formats -------------------------------------------------------------------------

IGNORE = -100  # a target that carries no loss (native CrossEntropy::ignore_index)

# JSONL record shapes, by their keys; a file's records all have the first record's shape.
RECORD_SHAPES = {
    "text": ({"text"}, set()),
    "prompt/completion": ({"prompt", "completion"}, set()),
    "chat": ({"messages"}, set()),
    "alpaca": ({"instruction", "output"}, {"input"}),
    "sharegpt": ({"conversations"}, {"system"}),
}
# ShareGPT's speakers ("from") as the roles of a chat.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
TOKEN_FILE_SUFFIXES = (".npy", ".bin")


def _record_shape(record, where: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    keys = set(record)
    for name, (required, optional) in RECORD_SHAPES.items():
        if required <= keys <= required | optional:
            return name
    known = "; ".join("{" + ", ".join(sorted(r | o)) + "}" for r, o in RECORD_SHAPES.values())
    raise DataError(f"{where}: a record with keys {sorted(keys)} is none of the known shapes ({known})")


def _string_field(record: dict, key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: \"{key}\" must be a string, got {type(value).__name__}")
    return value


def _messages(record: dict, shape: str, where: str) -> list[dict]:
    """The chat of a chat or Alpaca record: a list of {"role", "content"} (roles are checked by
    the chat template, which knows which it renders)."""
    if shape == "alpaca":
        prompt = _string_field(record, "instruction", where)
        extra = _string_field(record, "input", where) if record.get("input") is not None else ""
        if extra:
            prompt += "\n\n" + extra
        return [{"role": "user", "content": prompt},
                {"role": "assistant", "content": _string_field(record, "output", where)}]
    if shape == "sharegpt":
        return _messages({"messages": sharegpt_messages(record, where)}, "chat", where)
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: messages[{i}] must be an object with string \"role\" and \"content\"")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message is {messages[-1]['role']!r}: a chat to train on ends with "
                        "the assistant's turn")
    return messages


def sharegpt_messages(record: dict, where: str) -> list[dict]:
    """A ShareGPT record's conversation ({"from": "human" | "gpt" | "system", "value"}, and an
    optional "system" field) as chat messages ({"role", "content"})."""
    turns = record["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: \"conversations\" must be a non-empty list of {{\"from\", \"value\"}} objects")
    messages = []
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise DataError(f"{where}: \"system\" must be a string, got {type(system).__name__}")
    if system:
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            raise DataError(f"{where}: conversations[{i}] must be an object with string \"from\" and \"value\"")
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise DataError(f"{where}: conversations[{i}] is from {turn['from']!r}; ShareGPT's speakers are "
                            f"{', '.join(SHAREGPT_ROLES)}")
        messages.append({"role": role, "content": turn["value"]})
    return messages


class _Encoder:
    """Turns a file's contents into examples: (token ids, trained) pairs, where trained[i] says
    whether token i is a target that carries loss."""

    def __init__(self, tokenizer, chat_template):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        eos, bos = tokenizer.eos_id, tokenizer.bos_id
        if eos is None:
            raise DataError("the tokenizer has no EOS token to end documents with")
        self.before = [bos] if bos is not None and bos != eos else []
        self.after = [eos]

    def document(self, text: str) -> tuple[list[int], list[bool]]:
        ids = self.before + list(self.tokenizer.encode(text)) + self.after
        return ids, [True] * len(ids)

    def prompt_completion(self, prompt: str, completion: str) -> tuple[list[int], list[bool]]:
        ids, trained = self._encode_pieces([(prompt, False), (completion, True)])
        return self.before + ids + self.after, [False] * len(self.before) + trained + [True] * len(self.after)

    def _encode_pieces(self, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
        """The ids of the pieces' text, encoded as one text (pieces encoded one by one would change
        the tokens at their seams: SentencePiece's word-start marks, BPE merges across them), each
        flagged as the piece it comes from: the ids a piece's end encodes to are its and the
        pieces' before it; a token across a seam goes to the later piece."""
        text = "".join(piece for piece, _ in pieces)
        ids = list(self.tokenizer.encode(text))
        trained: list[bool] = []
        end = 0
        for piece, flag in pieces:
            end += len(piece)
            upto = ids if end == len(text) else list(self.tokenizer.encode(text[:end]))
            n = next((i for i, (a, b) in enumerate(zip(upto, ids)) if a != b), min(len(upto), len(ids)))
            trained += [flag] * max(n - len(trained), 0)
        return ids, trained + [pieces[-1][1]] * (len(ids) - len(trained))

    def chat(self, messages: list[dict], where: str) -> tuple[list[int], list[bool]]:
        if self.chat_template is None:
            raise DataError(f"{where}: a chat needs a chat template, and none was given")
        try:
            segments = self.chat_template.segments(messages)
        except ChatTemplateError as e:
            raise DataError(f"{where}: {e}") from None
        return self._encode_pieces(segments)


def _record_examples(path: Path, encoder: _Encoder, columns: Optional[dict] = None):
    """Yields (shape, (ids, trained)) per record of a JSONL, Parquet or Arrow file; the file's
    shape is its first record's (a table's: its columns')."""
    def noun(shape: str, plural: bool) -> str:
        return f"{shape} records" if plural else f"a {shape} record"

    for where, record, shape in uniform_records(path, records(path, RECORD_SHAPES, columns), _record_shape, noun):
        if shape == "text":
            yield shape, encoder.document(_string_field(record, "text", where))
        elif shape == "prompt/completion":
            yield shape, encoder.prompt_completion(_string_field(record, "prompt", where),
                                                   _string_field(record, "completion", where))
        else:
            yield shape, encoder.chat(_messages(record, shape, where), where)


def _token_file_ids(path: Path, vocab_size: int) -> np.ndarray:
    """Token ids stored as such: a 1-D integer .npy, or a flat .bin of uint16 ids (uint32 for
    vocabularies above 65,536), checked against the vocabulary."""
    if path.suffix == ".npy":
        try:
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"data file {path}: not a NumPy .npy file ({e})") from None
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise DataError(f"data file {path}: token ids must be a 1-D integer array, got {ids.ndim}-D {ids.dtype}")
    else:
        dtype = token_dtype(vocab_size)
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise DataError(f"data file {path}: {size} bytes is not a whole number of {dtype.name} token ids")
        ids = np.fromfile(path, dtype=dtype)
    if ids.size == 0:
        raise DataError(f"data file {path}: empty (no token ids)")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        at = int(np.flatnonzero(ids == bad)[0])
        raise DataError(f"data file {path}: token id {bad} at index {at} is outside the vocabulary [0, {vocab_size})")
    return ids


def all_token_ids(paths: list[str | os.PathLike]) -> bool:
    """Whether every data file holds token ids already (the run then needs no tokenizer)."""
    return all(data_format(f) == "token ids" for f in list_text_files(paths))


def data_format(path: Path) -> str:
    """How a file is read, from its name: "jsonl" (records: JSONL, Parquet, Arrow), "token ids" or
    "text"."""
    if path.suffix == ".jsonl" or is_table(path):
        return "jsonl"
    if path.suffix in TOKEN_FILE_SUFFIXES:
        return "token ids"
    return "text"


# --- tokenize once, cache -------------------------------------------------------------


@dataclass
class TokenFile:
    tokens: np.ndarray  # read-only memory map, uint16 or uint32
    trained: np.ndarray  # uint8 per token: 1 where the token is a target that carries loss
    starts: np.ndarray  # int64: where each example starts, then the end of the last one
    path: Path
    key: str  # cache key: identifies the data, the tokenizer and the chat template
    files: list[Path]
    formats: list[str]  # per file: "text", "token ids", or the JSONL record shape
    reused: bool  # True when the cache was hit

    @property
    def masked(self) -> bool:
        """Whether some tokens carry no loss (prompts, user turns): the data is then packed."""
        return bool(len(self.trained)) and not bool(self.trained.all())

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_trained(self) -> int:
        return int(self.trained.sum())

    @property
    def streams(self) -> list[np.ndarray]:
        """The token arrays (one; a mixture's, one a source)."""
        return [self.tokens]


@dataclass
class MixtureFile:
    """The sources of a mixture (--data a.parquet:0.7 b.jsonl:0.3), each tokenized into a TokenFile
    of its own, and their weights (summing to 1)."""

    parts: list[TokenFile]
    weights: list[float]
    sources: list[str]

    @property
    def key(self) -> str:
        payload = json.dumps([[p.key, w] for p, w in zip(self.parts, self.weights)])
        return "mixture-" + hashlib.sha256(payload.encode()).hexdigest()

    @property
    def files(self) -> list[Path]:
        return [f for p in self.parts for f in p.files]

    @property
    def formats(self) -> list[str]:
        return [k for p in self.parts for k in p.formats]

    @property
    def masked(self) -> bool:
        return any(p.masked for p in self.parts)

    @property
    def reused(self) -> bool:
        return all(p.reused for p in self.parts)

    @property
    def n_tokens(self) -> int:
        return sum(p.n_tokens for p in self.parts)

    @property
    def n_trained(self) -> int:
        return sum(p.n_trained for p in self.parts)

    @property
    def streams(self) -> list[np.ndarray]:
        return [p.tokens for p in self.parts]


def tokenize_files(paths: list[str | os.PathLike], tokenizer, cache_dir: str | os.PathLike | None = None,
                   chat_template=None, vocab_size: Optional[int] = None, columns: Optional[dict] = None) -> TokenFile:
    """Tokenize the data into a cached token file (or reuse the cache) and memory-map it.
    chat_template renders chat, ShareGPT and Alpaca records (zoo.text.chat_template.ChatTemplate);
    tokenizer may be None where every file holds token ids; vocab_size (the model's; default the
    tokenizer's) bounds the ids of such files and sizes the cache's ids; columns: the records'
    column mapping (--data-columns, records.parse_columns)."""
    files = list_text_files(paths)
    if vocab_size is None:
        if tokenizer is None:
            raise ValueError("tokenize_files: give a tokenizer or vocab_size")
        vocab_size = tokenizer.vocab_size
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = _cache_key(files, tokenizer, chat_template, vocab_size, columns)
    tok_path = cache / f"tokens-{key[:24]}.bin"
    meta_path = tok_path.with_suffix(".json")
    trained_path, starts_path = tok_path.with_suffix(".trained"), tok_path.with_suffix(".starts")
    dtype = token_dtype(vocab_size)

    meta = _read_meta(meta_path)
    if meta is not None and meta.key == key and meta.format == CACHE_FORMAT and _sizes_match(meta, tok_path, dtype):
        return TokenFile(_map(tok_path, dtype), _map(trained_path, np.dtype(np.uint8)),
                         _map(starts_path, np.dtype(np.int64)), tok_path, key, files, meta.formats, reused=True)

    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"token cache folder {cache}: cannot create it ({e.strerror or e})") from None
    n_tokens, n_examples, formats = _write_tokens(files, tokenizer, chat_template, vocab_size, tok_path, dtype,
                                                  columns)
    try:  # written after the tokens: a meta file always describes complete token files
        write_json(meta_path, {
            "key": key, "format": CACHE_FORMAT, "n_tokens": n_tokens, "n_examples": n_examples, "dtype": dtype.name,
            "files": [str(f.resolve()) for f in files], "formats": formats,
        })
    except OSError as e:
        raise DataError(f"token cache file {meta_path}: cannot write it ({e.strerror or e})") from None
    return TokenFile(_map(tok_path, dtype), _map(trained_path, np.dtype(np.uint8)),
                     _map(starts_path, np.dtype(np.int64)), tok_path, key, files, formats, reused=False)


def _sizes_match(meta: "CacheMeta", tok_path: Path, dtype: np.dtype) -> bool:
    """Whether the three cache files are there, complete (a meta file is written last)."""
    expected = {tok_path: meta.n_tokens * dtype.itemsize, tok_path.with_suffix(".trained"): meta.n_tokens,
                tok_path.with_suffix(".starts"): 8 * (meta.n_examples + 1)}
    return all(p.is_file() and p.stat().st_size == size for p, size in expected.items())


def _cache_key(files: list[Path], tokenizer, chat_template, vocab_size: int, columns: Optional[dict] = None) -> str:
    h = hashlib.sha256()
    if columns:  # the mapping changes what is read (no mapping: the key as before it existed)
        h.update(f"columns {json.dumps(sorted(columns.items()))}\n".encode())
    template = getattr(chat_template, "source", "") if chat_template is not None else ""
    identity = tokenizer_identity(tokenizer) if tokenizer is not None else "no tokenizer"
    h.update(f"zoo-tokens-v{CACHE_FORMAT}\n{identity}\n{vocab_size}\n".encode())
    h.update(hashlib.sha256(template.encode()).hexdigest().encode() + b"\n")
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{_file_digest(f)}\n".encode())
    return h.hexdigest()


def _file_examples(path: Path, encoder, vocab_size: int, columns: Optional[dict] = None):
    """(format, iterator of (ids, trained)) for one data file; encoder() gives the _Encoder."""
    kind = data_format(path)
    if kind == "token ids":
        ids = _token_file_ids(path, vocab_size)
        return kind, iter([(ids, None)])
    encoder = encoder(path)
    if kind == "jsonl":
        examples = _record_examples(path, encoder, columns)
        first = next(examples)  # the file's shape, and its errors, before anything is written
        return first[0], (e for _, e in itertools.chain([first], examples))
    return kind, iter([encoder.document(read_text(path))])


def _write_tokens(files: list[Path], tokenizer, chat_template, vocab_size: int, tok_path: Path,
                  dtype: np.dtype, columns: Optional[dict] = None) -> tuple[int, int, list[str]]:
    """Encode every file, one at a time, into the cache files (atomically: all or nothing):
    the ids, a trained flag per id, and where each example starts."""
    made: list[_Encoder] = []

    def encoder(path: Path) -> _Encoder:  # text needs a tokenizer; token ids do not
        if tokenizer is None:
            raise DataError(f"data file {path}: text needs a tokenizer, and the checkpoint has none; give "
                            "--tokenizer, or token ids (.npy, .bin)")
        if not made:
            made.append(_Encoder(tokenizer, chat_template))
        return made[0]

    limit = np.iinfo(dtype).max
    n = 0
    starts = [0]
    formats = []
    try:
        with atomic_open(tok_path) as out, atomic_open(tok_path.with_suffix(".trained")) as mask:
            for f in files:
                kind, examples = _file_examples(f, encoder, vocab_size, columns)
                formats.append(kind)
                for ids, trained in examples:
                    ids = np.asarray(ids, dtype=np.int64)
                    if ids.size and (ids.min() < 0 or ids.max() > limit):
                        raise DataError(f"data file {f}: tokenizer produced id {ids.max()} outside {dtype.name}")
                    out.write(ids.astype(dtype).tobytes())
                    flags = np.ones(ids.size, np.uint8) if trained is None else np.asarray(trained, np.uint8)
                    mask.write(flags.tobytes())
                    n += ids.size
                    starts.append(n)
            with atomic_open(tok_path.with_suffix(".starts")) as s:
                s.write(np.asarray(starts, np.int64).tobytes())
    except OSError as e:
        raise DataError(f"token cache file {tok_path}: cannot write it ({e.strerror or e})") from None
    return n, len(starts) - 1, formats


class CacheMeta(BaseModel):
    """The JSON file beside a cached token file, describing it."""

    model_config = ConfigDict(strict=True, extra="allow")
    key: str
    format: int
    n_tokens: int
    n_examples: int
    dtype: str
    files: list[str]
    formats: list[str]


def _read_meta(path: Path, model: type[BaseModel] = CacheMeta) -> Optional[BaseModel]:
    """The cache's description of a token file (model: its fields, CacheMeta or a pair file's);
    None when it is missing or unusable (not a regular file, not JSON, wrong fields): the cache
    is rebuilt, replacing it."""
    if not path.exists():
        return None
    try:
        return read_json_model(path, model, "token cache file")
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
    the gradient of the whole batch (where every sequence holds seq_len targets a mean over
    rows is the mean of equal-sized parts' means; packed rows, whose targets that carry loss
    differ in number, scale each slice by its share of them instead: the trainer's _step)."""

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


class Batch(NamedTuple):
    """Inputs and targets (B, T); positions (B, T) where rows pack several examples, else None."""

    x: np.ndarray
    y: np.ndarray
    positions: Optional[np.ndarray] = None

    def rows(self, lo: int, hi: int) -> "Batch":
        """Rows lo..hi-1 (of C-ordered arrays: still contiguous)."""
        return Batch(self.x[lo:hi], self.y[lo:hi], None if self.positions is None else self.positions[lo:hi])

    def targets(self) -> int:
        """How many targets carry loss."""
        return int(np.count_nonzero(self.y != IGNORE))


def batches_for(token_file: TokenFile, batch_size: int, seq_len: int, val_fraction: float, eval_batches: int,
                seed: int, source: str, train_on_everything: bool = False):
    """Windows over a stream of documents, or PackedWindows where some tokens carry no loss."""
    if token_file.masked and not train_on_everything:
        return PackedWindows(token_file, batch_size, seq_len, val_fraction, eval_batches, seed, source)
    return Windows(token_file.tokens, batch_size, seq_len, val_fraction, eval_batches, seed, source)


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

    def describe(self) -> str:
        return f"{self.n_train:,} train tokens, {self.n_val:,} val"

    def train_batch(self, step: int, micro: int) -> Batch:
        """The (inputs, targets) of micro-batch `micro` of optimizer step `step`."""
        return self.sample(np.random.default_rng((self.seed, step, micro)), self.batch_size)

    def sample(self, rng: np.random.Generator, n: int) -> Batch:
        """n training windows drawn with rng."""
        starts = rng.integers(0, self.n_train - self.seq_len, size=n)  # last start: n_train - need
        return self._gather(starts)

    def val_batches(self):
        """The fixed validation batches (none when there is no validation split)."""
        if self._val_starts is None:
            return
        for i in range(0, len(self._val_starts), self.batch_size):
            yield self._gather(self._val_starts[i:i + self.batch_size])

    def all_batches(self):
        """The whole stream in consecutive windows (a last one shorter than seq_len is left out)."""
        starts = np.arange(0, len(self.tokens) - self.seq_len, self.seq_len, dtype=np.int64)
        for i in range(0, len(starts), self.batch_size):
            yield self._gather(starts[i:i + self.batch_size])

    def _gather(self, starts: np.ndarray) -> Batch:
        w = self.tokens[starts[:, None] + self._span].astype(np.int32)
        return Batch(np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:]))


class PackedWindows:
    """Training and validation batches of whole examples packed into rows of seq_len tokens.

    An example of n tokens gives n - 1 (input, target) pairs; the targets of tokens that carry
    no loss are IGNORE. Examples go into rows in order, each where the current row still has
    room, else into a new row (the rest of a row is padding: IGNORE targets). Positions restart
    at 0 with each example, so attention stays within it (Model.forward_backward's positions).
    An example longer than a row is cut where it is all trained (a document: its pieces follow
    each other), and kept to its first seq_len + 1 tokens otherwise (a prompt and its answer:
    counted in `truncated`; left out, and counted in `dropped`, where no token that carries loss
    is left). The last val_fraction of the examples is the validation split.
    """

    def __init__(self, token_file: TokenFile, batch_size: int, seq_len: int, val_fraction: float,
                 eval_batches: int, seed: int, source: str = "the data"):
        self.tokens, self.trained = token_file.tokens, token_file.trained
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        starts = np.asarray(token_file.starts, dtype=np.int64)
        n_examples = len(starts) - 1
        n_val = int(round(n_examples * val_fraction)) if val_fraction > 0 else 0
        if val_fraction > 0 and n_examples > 1:
            n_val = max(n_val, 1)
        n_val = min(n_val, n_examples - 1)
        self.truncated = self.dropped = 0
        self.train_rows = self._pack(starts[: n_examples - n_val + 1])
        self.val_rows = self._pack(starts[n_examples - n_val:]) if n_val else []
        if not self.train_rows:
            raise DataError(f"{source}: no example of two tokens or more to train on")
        self.n_examples, self.n_val_examples = n_examples, n_val
        self.n_train, self.n_val = len(self.train_rows) * seq_len, len(self.val_rows) * seq_len
        picks = min(eval_batches * batch_size, len(self.val_rows))
        self._val_picks = np.linspace(0, len(self.val_rows) - 1, picks).round().astype(np.int64) if picks else None

    def _pack(self, starts: np.ndarray) -> list[list[tuple[int, int]]]:
        """Rows of pieces (start, n): inputs tokens[start:start+n], targets the next n."""
        T = self.seq_len
        rows: list[list[tuple[int, int]]] = []
        row: list[tuple[int, int]] = []
        room = 0
        for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
            n = b - a - 1  # (input, target) pairs
            if n < 1:
                continue
            if n > T:
                if self.trained[a + 1:b].all():
                    pieces = [(s, min(T, b - 1 - s)) for s in range(a, b - 1, T)]
                elif self.trained[a + 1:a + 1 + T].any():
                    pieces = [(a, T)]
                    self.truncated += 1
                else:
                    self.dropped += 1
                    continue
            else:
                pieces = [(a, n)]
            for piece in pieces:
                if piece[1] > room:
                    row = []
                    rows.append(row)
                    room = T
                row.append(piece)
                room -= piece[1]
        return rows

    def describe(self) -> str:
        cut = f", {self.truncated:,} longer than a row cut to it" if self.truncated else ""
        if self.dropped:
            cut += f", {self.dropped:,} left out (nothing that carries loss within a row)"
        return (f"{self.n_examples - self.n_val_examples:,} train examples in {len(self.train_rows):,} packed rows, "
                f"{self.n_val_examples:,} val in {len(self.val_rows):,}{cut}")

    def train_batch(self, step: int, micro: int) -> Batch:
        return self.sample(np.random.default_rng((self.seed, step, micro)), self.batch_size)

    def sample(self, rng: np.random.Generator, n: int) -> Batch:
        """n training rows drawn with rng."""
        return self._gather([self.train_rows[i] for i in rng.integers(0, len(self.train_rows), n)])

    def val_batches(self):
        if self._val_picks is None:
            return
        for i in range(0, len(self._val_picks), self.batch_size):
            yield self._gather([self.val_rows[j] for j in self._val_picks[i:i + self.batch_size]])

    def all_batches(self):
        """Every row, training and validation, in order."""
        rows = self.train_rows + self.val_rows
        for i in range(0, len(rows), self.batch_size):
            yield self._gather(rows[i:i + self.batch_size])

    def _gather(self, rows: list[list[tuple[int, int]]]) -> Batch:
        T = self.seq_len
        x = np.zeros((len(rows), T), np.int32)
        y = np.full((len(rows), T), IGNORE, np.int32)
        positions = np.zeros((len(rows), T), np.int32)
        for r, pieces in enumerate(rows):
            at = 0
            for start, n in pieces:
                x[r, at:at + n] = self.tokens[start:start + n]
                targets = self.tokens[start + 1:start + 1 + n].astype(np.int32)
                y[r, at:at + n] = np.where(self.trained[start + 1:start + 1 + n] != 0, targets, IGNORE)
                positions[r, at:at + n] = np.arange(n)
                at += n
            positions[r, at:] = np.arange(T - at)  # padding: a segment of its own, no loss
        return Batch(x, y, positions)


class MixedWindows:
    """Training and validation batches of a mixture: each row of a training batch comes from a
    source drawn by its weight, and is drawn from that source's batches (Windows or PackedWindows),
    all with the generator seeded by (seed, step, micro-batch): the batch of any step is known
    without replaying earlier ones, so --resume stays exact. Where some source is packed, every
    row has positions (a window of a stream: 0..T-1). Validation: each source's own batches."""

    def __init__(self, parts: list, weights: list[float], sources: list[str], batch_size: int, seq_len: int,
                 seed: int):
        self.parts, self.weights, self.sources = parts, np.asarray(weights, np.float64), sources
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.packed = any(isinstance(p, PackedWindows) for p in parts)
        self.n_train = sum(p.n_train for p in parts)
        self.n_val = sum(p.n_val for p in parts)

    def describe(self) -> str:
        return "; ".join(f"{source} ({w:.0%} of the rows): {p.describe()}"
                         for source, w, p in zip(self.sources, self.weights, self.parts))

    def train_batch(self, step: int, micro: int) -> Batch:
        rng = np.random.default_rng((self.seed, step, micro))
        which = rng.choice(len(self.parts), size=self.batch_size, p=self.weights)
        x = np.zeros((self.batch_size, self.seq_len), np.int32)
        y = np.zeros_like(x)
        positions = np.zeros_like(x) if self.packed else None
        for k, part in enumerate(self.parts):
            rows = np.flatnonzero(which == k)
            if not len(rows):
                continue
            b = self._positioned(part.sample(rng, len(rows)))
            x[rows], y[rows] = b.x, b.y
            if positions is not None:
                positions[rows] = b.positions
        return Batch(x, y, positions)

    def _positioned(self, b: Batch) -> Batch:
        if self.packed and b.positions is None:
            return Batch(b.x, b.y, np.ascontiguousarray(np.broadcast_to(np.arange(b.x.shape[1], dtype=np.int32),
                                                                        b.x.shape)))
        return b

    def val_batches(self):
        for part in self.parts:
            for b in part.val_batches():
                yield self._positioned(b)

    def all_batches(self):
        for part in self.parts:
            for b in part.all_batches():
                yield self._positioned(b)


def training_data(data: list[str], tokenizer, cache_dir, chat_template, vocab_size: int, batch_size: int,
                  seq_len: int, val_fraction: float, eval_batches: int, seed: int,
                  train_on_everything: bool = False, columns: Optional[dict] = None):
    """(token file, batches) of a run's --data: one TokenFile over every file, or a MixtureFile
    and its MixedWindows where the sources carry weights (PATH:WEIGHT)."""
    paths, weights = data_sources(data)
    if weights is None:
        tf = tokenize_files(paths, tokenizer, cache_dir, chat_template, vocab_size=vocab_size, columns=columns)
        return tf, batches_for(tf, batch_size, seq_len, val_fraction, eval_batches, seed,
                               f"data {', '.join(paths)}", train_on_everything)
    parts, windows = [], []
    for path in paths:
        tf = tokenize_files([path], tokenizer, cache_dir, chat_template, vocab_size=vocab_size, columns=columns)
        parts.append(tf)
        windows.append(batches_for(tf, batch_size, seq_len, val_fraction, eval_batches, seed, f"data {path}",
                                   train_on_everything))
    return (MixtureFile(parts, weights, paths),
            MixedWindows(windows, weights, paths, batch_size, seq_len, seed))
