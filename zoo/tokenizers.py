"""Tokenizers of Hugging Face checkpoint folders, and zoo's own byte-level tokenizer.

Kinds read (the first one found in a folder wins):
  zoo_tokenizer.json        zoo's byte-level tokenizer (ids 0..255 are bytes, then specials)
  tokenizer.json            byte-level BPE (GPT-2, Llama-3 style), through tiktoken, with the
                            pre-tokenizer regex the file gives
  tokenizer.model           SentencePiece (Llama-2 style), through sentencepiece
  vocab.json + merges.txt   GPT-2 byte-level BPE, through tiktoken with GPT-2's regex

tiktoken merges by the rank of a pair's concatenation; the ranks built here put the 256 bytes
first and then the merges in file order, which makes that the same as Hugging Face's
merge-order BPE for vocabularies trained by BPE. Special (added) tokens are matched in the text
first, as transformers does, and each stretch between them is encoded on its own.

bos/eos come from the checkpoint's own files, first found wins: tokenizer_config.json,
special_tokens_map.json, generation_config.json, config.json, then the tokenizer itself.
encode() adds no BOS unless asked: callers frame documents and prompts themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import unicodedata
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from .atomic import write_bytes
from .errors import CheckpointError

ZOO_FILE = "zoo_tokenizer.json"
# Files that make up a tokenizer: copied along when a checkpoint is saved.
TOKENIZER_FILES = ("zoo_tokenizer.json", "tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
# Files that only say which ids are bos/eos.
_ID_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json")

# GPT-2's pre-tokenizer regex (also what tokenizers' ByteLevel(use_regex=True) uses).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# GPT-2's regex run on the pieces left by Digits(individual_digits=True), as one regex: every digit
# stands alone, and whitespace before a digit ends its piece, so it is taken whole.
GPT2_DIGITS_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other bytes
    for the characters from U+0100 on, in byte order (so every token is printable text)."""
    printable = (set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
                 | set(range(ord("®"), ord("ÿ") + 1)))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_OF_CHAR = {ch: b for b, ch in bytes_to_unicode().items()}


def _token_bytes(token: str) -> bytes:
    """The bytes a byte-level BPE token stands for (a token outside the alphabet stands for its UTF-8)."""
    try:
        return bytes(_BYTE_OF_CHAR[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


# --- backends: encode text without specials, decode ids that are not specials -------------


class _ByteBPE:
    """Byte-level BPE through tiktoken. Ranks are zoo's (bytes, then merges); ids are the file's."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], pattern: str, source: Path,
                 add_prefix_space: bool = False, nfc: bool = False):
        import tiktoken

        ranks: dict[bytes, int] = {}
        rank_to_id: list[int] = []
        for b, ch in bytes_to_unicode().items():
            ranks[bytes([b])] = len(rank_to_id)
            rank_to_id.append(vocab.get(ch, -1))  # -1: a byte the vocabulary lacks is dropped, as HF does
        for i, (a, b) in enumerate(merges):
            merged = a + b
            if merged not in vocab:
                raise CheckpointError(source, f"merge {i + 1} ({a!r} {b!r}) makes {merged!r}, which is not in the "
                                              "vocabulary", key="merges")
            piece = _token_bytes(a) + _token_bytes(b)
            if piece not in ranks:
                ranks[piece] = len(rank_to_id)
                rank_to_id.append(vocab[merged])
        try:
            self.encoding = tiktoken.Encoding(f"zoo:{source}", pat_str=pattern, mergeable_ranks=ranks,
                                              special_tokens={})
        except ValueError as e:  # how tiktoken reports a regex it cannot compile
            raise CheckpointError(source, f"pre-tokenizer pattern rejected by tiktoken: {e}",
                                  key="pre_tokenizer") from None
        self.rank_to_id = np.asarray(rank_to_id, dtype=np.int64)
        self.id_to_bytes = {i: _token_bytes(tok) for tok, i in vocab.items()}
        self.add_prefix_space = add_prefix_space
        self.nfc = nfc
        self.size = max(vocab.values(), default=-1) + 1

    def encode(self, text: str) -> list[int]:
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        if self.add_prefix_space and not text.startswith(" "):
            text = " " + text
        ids = self.rank_to_id[np.asarray(self.encoding.encode_ordinary(text), dtype=np.int64)]
        return ids[ids >= 0].tolist()

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.id_to_bytes.get(i, b"") for i in ids).decode("utf-8", errors="replace")


class _SentencePiece:
    def __init__(self, model_bytes: bytes, source: Path):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model_bytes)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError on a bad proto
            raise CheckpointError(source, f"not a SentencePiece model: {e}") from None
        self.size = self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if 0 <= i < self.size])

    def piece_id(self, piece: str) -> Optional[int]:
        i = self.sp.piece_to_id(piece)
        return i if self.sp.id_to_piece(i) == piece else None

    def builtin_specials(self) -> dict[str, int]:
        """Control pieces (<s>, </s>) and the unknown piece, which transformers matches in text."""
        out = {self.sp.id_to_piece(i): i for i in range(self.size) if self.sp.is_control(i)}
        if self.sp.unk_id() >= 0:
            out[self.sp.id_to_piece(self.sp.unk_id())] = self.sp.unk_id()
        return out


class _Bytes:
    size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# --- the tokenizer -------------------------------------------------------------------------


class Tokenizer:
    """encode/decode text, with the checkpoint's special tokens and bos/eos ids."""

    def __init__(self, backend, *, kind: str, specials: dict[str, int], bos_id: Optional[int],
                 eos_ids: list[int], vocab_size: int, files: dict[str, bytes]):
        self._backend = backend
        self.kind = kind
        self.special_tokens = dict(specials)  # text -> id, matched in encode's input
        self._special_text = {i: s for s, i in specials.items()}
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)  # every id that ends generation (eos first)
        self.eos_id = eos_ids[0] if eos_ids else None
        self.vocab_size = vocab_size
        self.files = dict(files)  # file name -> content, written back by save()
        # Longest first, so a special that contains another wins.
        alternatives = sorted(specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"{len(self.special_tokens)} special tokens)")

    # --- encode / decode ---

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False, special: bool = True) -> list[int]:
        """Token ids of `text`. special=True: special-token text (e.g. "<|endoftext|>") becomes its id;
        special=False: it is encoded as plain text."""
        ids: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise ValueError("this tokenizer has no BOS token")
            ids.append(self.bos_id)
        at = 0
        if special and self._special_re is not None:
            for m in self._special_re.finditer(text):
                if m.start() > at:
                    ids += self._backend.encode(text[at:m.start()])
                ids.append(self.special_tokens[m.group()])
                at = m.end()
        if at < len(text):
            ids += self._backend.encode(text[at:])
        if add_eos:
            if self.eos_id is None:
                raise ValueError("this tokenizer has no EOS token")
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; special tokens are written as their text unless skip_special."""
        parts: list[str] = []
        run: list[int] = []
        for i in (int(t) for t in ids):
            if i in self._special_text:
                if run:
                    parts.append(self._backend.decode(run))
                    run = []
                if not skip_special:
                    parts.append(self._special_text[i])
            else:
                run.append(i)
        if run:
            parts.append(self._backend.decode(run))
        return "".join(parts)

    # --- identity and saving ---

    def fingerprint(self) -> str:
        """Changes whenever the files (so the encoding) change."""
        h = hashlib.sha256(self.kind.encode())
        for name in sorted(self.files):
            h.update(f"\0{name}\0{len(self.files[name])}\0".encode())
            h.update(self.files[name])
        return h.hexdigest()

    def save(self, folder: str | os.PathLike) -> list[Path]:
        """Write the tokenizer's files into `folder` (each atomically)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name, content in self.files.items():
            write_bytes(folder / name, content)
            written.append(folder / name)
        return written

    # --- constructors ---

    @classmethod
    def byte_level(cls) -> "Tokenizer":
        """zoo's tokenizer for the tiny presets: ids 0..255 are the UTF-8 bytes, 256 is <|eos|>,
        257 is <|bos|> (258 ids, within the tiny presets' vocab_size of 320)."""
        spec = {"zoo_tokenizer": "byte-level", "version": 1, "special_tokens": {"<|eos|>": 256, "<|bos|>": 257},
                "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
        content = (json.dumps(spec, indent=2) + "\n").encode()
        return _from_zoo_file(content, Path(ZOO_FILE), {})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        """The tokenizer of a checkpoint folder, or of one tokenizer file (tokenizer.json,
        a SentencePiece .model file, zoo_tokenizer.json)."""
        path = Path(path)
        if path.is_file():
            return _load_file(path, _read_id_files(path.parent))
        if not path.is_dir():
            raise CheckpointError(path, "no such tokenizer file or folder")
        side = _read_id_files(path)
        if (path / ZOO_FILE).is_file():
            return _load_file(path / ZOO_FILE, side)
        tokenizer_json = path / "tokenizer.json"
        if tokenizer_json.is_file() and _is_byte_level(_read_json(tokenizer_json)):
            return _load_file(tokenizer_json, side)
        if (path / "tokenizer.model").is_file():
            return _load_file(path / "tokenizer.model", side)
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return _from_vocab_merges(path, side)
        if tokenizer_json.is_file():
            return _load_file(tokenizer_json, side)  # raises, saying why this tokenizer.json is not read
        raise CheckpointError(path, "no tokenizer here (looked for zoo_tokenizer.json, tokenizer.json, "
                                    "tokenizer.model, vocab.json + merges.txt)")


# --- loading -------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(path, f"cannot read: {e}") from None
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        raise CheckpointError(path, f"not valid JSON ({e})") from None


def _read_id_files(folder: Path) -> dict[str, tuple[Path, dict]]:
    """The JSON files beside a tokenizer that name special tokens and ids."""
    out = {}
    for name in _ID_FILES + ("added_tokens.json",):
        p = folder / name
        if p.is_file():
            data = _read_json(p)
            if not isinstance(data, dict):
                raise CheckpointError(p, "not a JSON object")
            out[name] = (p, data)
    return out


def _tokenizer_files(folder: Path, main: Path) -> dict[str, bytes]:
    """Contents of the tokenizer's files, to write back on save. `main` is saved under its
    canonical name (a SentencePiece model may be called anything.model)."""
    files = {}
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            files[name] = (folder / name).read_bytes()
    canonical = "tokenizer.model" if main.suffix == ".model" else main.name
    files[canonical] = main.read_bytes()
    return files


def _load_file(path: Path, side: dict) -> "Tokenizer":
    if path.suffix == ".model":
        return _from_sentencepiece(path, side)
    data = _read_json(path)
    if isinstance(data, dict) and "zoo_tokenizer" in data:
        return _from_zoo_file(path.read_bytes(), path, side)
    return _from_tokenizer_json(path, data, side)


def _from_zoo_file(content: bytes, source: Path, side: dict) -> Tokenizer:
    try:
        spec = json.loads(content)
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        raise CheckpointError(source, f"not valid JSON ({e})") from None
    if spec.get("zoo_tokenizer") != "byte-level" or spec.get("version") != 1:
        raise CheckpointError(source, f"unknown zoo tokenizer {spec.get('zoo_tokenizer')!r} version "
                                      f"{spec.get('version')!r} (this zoo reads byte-level version 1)",
                              key="zoo_tokenizer")
    specials = spec.get("special_tokens")
    if (not isinstance(specials, dict)
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 256 for i in specials.values())):
        raise CheckpointError(source, "must map token text to ids >= 256", key="special_tokens")
    own = {"bos": specials.get(spec.get("bos_token")), "eos": specials.get(spec.get("eos_token"))}
    return _assemble(_Bytes(), "byte-level", specials, own, side, {ZOO_FILE: content}, source)


def _from_sentencepiece(path: Path, side: dict) -> Tokenizer:
    backend = _SentencePiece(path.read_bytes(), path)
    specials = backend.builtin_specials()
    specials.update(_configured_specials(side, backend.piece_id))
    sp = backend.sp
    own = {"bos": sp.bos_id() if sp.bos_id() >= 0 else None, "eos": sp.eos_id() if sp.eos_id() >= 0 else None}
    return _assemble(backend, "sentencepiece", specials, own, side, _tokenizer_files(path.parent, path), path,
                     lookup=backend.piece_id)


def _is_byte_level(data) -> bool:
    pre = data.get("pre_tokenizer") if isinstance(data, dict) else None
    steps = (pre.get("pretokenizers") or []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    return any(isinstance(s, dict) and s.get("type") == "ByteLevel" for s in steps)


def _from_tokenizer_json(path: Path, data, side: dict) -> Tokenizer:
    if not isinstance(data, dict):
        raise CheckpointError(path, "not a JSON object")
    model = data.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise CheckpointError(path, f"model type {kind!r} is not supported (zoo reads byte-level BPE tokenizer.json; "
                                    "SentencePiece tokenizers from tokenizer.model)", key="model.type")
    for key, ok in (("byte_fallback", (False, None)), ("dropout", (None,)), ("continuing_subword_prefix", (None, "")),
                    ("end_of_word_suffix", (None, ""))):
        if model.get(key) not in ok:
            raise CheckpointError(path, f"value {model.get(key)!r} is not supported", key=f"model.{key}")
    pattern, add_prefix_space = _byte_level_pattern(path, data.get("pre_tokenizer"))
    normalizer = data.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise CheckpointError(path, f"normalizer {normalizer.get('type')!r} is not supported (zoo reads none or NFC)",
                              key="normalizer")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
        raise CheckpointError(path, "must be an object of token -> integer id", key="model.vocab")
    merges = _parse_merges(model.get("merges"), path)
    backend = _ByteBPE(vocab, merges, pattern, path, add_prefix_space, nfc=normalizer is not None)
    specials: dict[str, int] = {}
    for entry in data.get("added_tokens") or []:
        if not (isinstance(entry, dict) and isinstance(entry.get("content"), str)
                and isinstance(entry.get("id"), int)):
            raise CheckpointError(path, f"entry {entry!r} needs content and id", key="added_tokens")
        specials[entry["content"]] = entry["id"]
        backend.id_to_bytes[entry["id"]] = entry["content"].encode("utf-8")
    specials.update(_configured_specials(side, lambda s: vocab.get(s)))
    own = {"bos": _template_bos(data.get("post_processor"), specials), "eos": None}
    return _assemble(backend, "byte-level-bpe", specials, own, side, _tokenizer_files(path.parent, path), path,
                     lookup=vocab.get)


def _byte_level_pattern(path: Path, pre) -> tuple[str, bool]:
    """The regex and add_prefix_space of a byte-level pre-tokenizer: ByteLevel(use_regex=True)
    means GPT-2's regex; Sequence[Split(regex, Isolated), ByteLevel(use_regex=False)] gives its own;
    Sequence[Digits(individual_digits), ByteLevel(use_regex=True)] is GPT-2's with lone digits."""
    def unsupported(why: str) -> CheckpointError:
        return CheckpointError(path, f"{why}; zoo reads ByteLevel, Split(Regex) then ByteLevel, or Digits then "
                                     "ByteLevel", key="pre_tokenizer")

    if not isinstance(pre, dict):
        raise unsupported(f"pre_tokenizer {pre!r} is not byte-level")
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) for s in steps):
        raise unsupported("empty or malformed Sequence")
    *splits, last = steps
    if last.get("type") != "ByteLevel":
        raise unsupported(f"the last step is {last.get('type')!r}, not ByteLevel")
    add_prefix_space = bool(last.get("add_prefix_space", False))
    if last.get("use_regex", True):
        if not splits:
            return GPT2_PATTERN, add_prefix_space
        if len(splits) == 1 and splits[0].get("type") == "Digits" and splits[0].get("individual_digits"):
            return GPT2_DIGITS_PATTERN, add_prefix_space  # SmolLM's tokenizer
        raise unsupported("a step before a ByteLevel that also splits (other than Digits(individual_digits))")
    if len(splits) != 1 or splits[0].get("type") != "Split":
        raise unsupported("ByteLevel(use_regex=false) needs exactly one Split before it")
    split = splits[0]
    regex = (split.get("pattern") or {}).get("Regex")
    if not isinstance(regex, str) or split.get("behavior") != "Isolated" or split.get("invert"):
        raise unsupported("the Split must be a Regex pattern, behavior Isolated, not inverted")
    return regex, add_prefix_space


def _template_bos(post, specials: dict[str, int]) -> Optional[int]:
    """The special token a TemplateProcessing post-processor puts first (Llama-3's BOS)."""
    if not isinstance(post, dict):
        return None
    steps = post.get("processors") if post.get("type") == "Sequence" else [post]
    for step in steps or []:
        if isinstance(step, dict) and step.get("type") == "TemplateProcessing":
            single = step.get("single") or []
            first = single[0] if single else {}
            token = (first.get("SpecialToken") or {}).get("id") if isinstance(first, dict) else None
            return specials.get(token)
    return None


def _parse_merges(raw, path: Path) -> list[tuple[str, str]]:
    if not isinstance(raw, list):
        raise CheckpointError(path, "must be a list", key="model.merges")
    merges = []
    for i, m in enumerate(raw):
        pair = m.split(" ") if isinstance(m, str) else m
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
            raise CheckpointError(path, f"merge {i + 1} ({m!r}) is not a pair of tokens", key="model.merges")
        merges.append((pair[0], pair[1]))
    return merges


def _from_vocab_merges(folder: Path, side: dict) -> Tokenizer:
    vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
    vocab = _read_json(vocab_path)
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise CheckpointError(vocab_path, "must be a JSON object of token -> id")
    merges = []
    try:
        lines = merges_path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(merges_path, f"cannot read: {e}") from None
    for n, line in enumerate(lines, start=1):
        if not line or (n == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise CheckpointError(merges_path, f"line {n} ({line!r}) is not two tokens separated by a space")
        merges.append((pair[0], pair[1]))
    config = side.get("tokenizer_config.json", (None, {}))[1]
    backend = _ByteBPE(vocab, merges, GPT2_PATTERN, merges_path, bool(config.get("add_prefix_space", False)))
    specials = _configured_specials(side, vocab.get)
    # GPT2Tokenizer's defaults when no config names them: bos = eos = unk = <|endoftext|>.
    endoftext = vocab.get("<|endoftext|>")
    if endoftext is not None:
        specials.setdefault("<|endoftext|>", endoftext)
    own = {"bos": endoftext, "eos": endoftext}
    return _assemble(backend, "byte-level-bpe", specials, own, side, _tokenizer_files(folder, merges_path),
                     merges_path, lookup=vocab.get)


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _configured_specials(side: dict, lookup: Callable[[str], Optional[int]]) -> dict[str, int]:
    """Special and added tokens that tokenizer_config.json, special_tokens_map.json and
    added_tokens.json declare (text -> id)."""
    specials: dict[str, int] = {}
    if "added_tokens.json" in side:
        path, data = side["added_tokens.json"]
        for text, i in data.items():
            if not isinstance(i, int):
                raise CheckpointError(path, f"id {i!r} is not an integer", key=text)
            specials[text] = i
    if "tokenizer_config.json" in side:
        path, data = side["tokenizer_config.json"]
        decoder = data.get("added_tokens_decoder") or {}
        for i, entry in decoder.items():
            text = _token_text(entry)
            if text is None or not str(i).isdigit():
                raise CheckpointError(path, f"entry {i!r} needs an integer id and content", key="added_tokens_decoder")
            specials[text] = int(i)
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if name not in side:
            continue
        _, data = side[name]
        named = [data.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
        named += list(data.get("additional_special_tokens") or [])
        for value in named:
            text = _token_text(value)
            if text is not None and text not in specials and lookup(text) is not None:
                specials[text] = lookup(text)
    return specials


def _assemble(backend, kind: str, specials: dict[str, int], own: dict, side: dict, files: dict[str, bytes],
              source: Path, lookup: Optional[Callable[[str], Optional[int]]] = None) -> Tokenizer:
    """Resolve bos/eos from the checkpoint's files and check every id against config.json's vocab_size."""
    def resolve(which: str) -> list[int]:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if name in side:
                path, data = side[name]
                text = _token_text(data.get(f"{which}_token"))
                if text is not None:
                    i = specials.get(text, lookup(text) if lookup else None)
                    if i is None:
                        raise CheckpointError(path, f"token {text!r} is not in the tokenizer", key=f"{which}_token")
                    return [i]
        for name in ("generation_config.json", "config.json"):
            if name in side:
                path, data = side[name]
                value = data.get(f"{which}_token_id")
                values = value if isinstance(value, list) else [value]
                if value is not None:
                    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values) or not values:
                        raise CheckpointError(path, f"expected an id or a list of ids, got {value!r}",
                                              key=f"{which}_token_id")
                    return list(values)
        return [own[which]] if own.get(which) is not None else []

    bos = resolve("bos")
    eos_ids = resolve("eos")
    # generation_config.json may list more stop ids (Llama-3 instruct) than the tokenizer's eos.
    if "generation_config.json" in side:
        extra = side["generation_config.json"][1].get("eos_token_id")
        for i in extra if isinstance(extra, list) else [extra]:
            if isinstance(i, int) and i not in eos_ids:
                eos_ids.append(i)
    size = max([backend.size - 1, *specials.values(), *bos, *eos_ids]) + 1
    vocab_size = size
    if "config.json" in side:
        path, data = side["config.json"]
        declared = data.get("vocab_size")
        if isinstance(declared, int) and not isinstance(declared, bool):
            if declared < size:
                raise CheckpointError(path, f"the model has {declared} embeddings but the tokenizer ({source.name}) "
                                            f"uses ids up to {size - 1}", key="vocab_size")
            vocab_size = declared
    return Tokenizer(backend, kind=kind, specials=specials, bos_id=bos[0] if bos else None, eos_ids=eos_ids,
                     vocab_size=vocab_size, files=files)

