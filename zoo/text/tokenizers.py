"""Tokenizers of Hugging Face checkpoint folders, and zoo's own byte-level tokenizer.

Kinds read (the first one found in a folder wins):
  zoo_tokenizer.json        zoo's byte-level tokenizer (ids 0..255 are bytes, then specials)
  tokenizer.json            byte-level BPE (GPT-2, Llama-3 style), through tiktoken, with the
                            pre-tokenizer regex the file gives
  tokenizer.model           SentencePiece (Llama-2 style), through sentencepiece
  vocab.json + merges.txt   GPT-2 byte-level BPE, through tiktoken with GPT-2's regex
  tokenizer.json            SentencePiece-style BPE (byte fallback, spaces as "▁": Mistral,
                            Gemma, Phi-3) where no tokenizer.model is beside it, through tiktoken
                            (_SpaceBPE says how)

tiktoken merges by the rank of a pair's concatenation; the ranks built here put the 256 bytes
first and then the merges in file order, which makes that the same as Hugging Face's
merge-order BPE for vocabularies trained by BPE. Special (added) tokens are matched in the text
first, as the tokenizers library does, and each stretch between them is encoded on its own;
their flags are kept (lstrip/rstrip take the whitespace beside them; normalized ones are matched
in the normalized stretch). A tokenizer.json zoo cannot encode exactly is refused, the error
naming the file and the field.

bos/eos come from the checkpoint's own files, first found wins: tokenizer_config.json,
special_tokens_map.json, generation_config.json, config.json, then the tokenizer itself.
encode() adds no BOS unless asked: callers frame documents and prompts themselves, with BOS
first when the tokenizer has one distinct from EOS (`Tokenizer.adds_bos`).

Hand-over (save): a saved folder also carries what transformers needs to encode as zoo does
(`Tokenizer.handover_files`): tokenizer_config.json and special_tokens_map.json where the
source had none, and a tokenizer.json for zoo's byte-level tokenizer and for SentencePiece BPE
models (Llama-2's kind) that lack one. Files the source had are written back unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import unicodedata
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, NamedTuple, Optional, Union

import numpy as np
import sentencepiece as spm
import tiktoken
from pydantic import BaseModel, ConfigDict, Field

from ..core.atomic import write_bytes
from ..core.errors import CheckpointError
from ..core.files import parse_model, read_json, read_text, regular_file, show_value

ZOO_FILE = "zoo_tokenizer.json"
# Files that make up a tokenizer: copied along when a checkpoint is saved. chat_template.jinja
# is where recent transformers versions save the chat template (it wins over tokenizer_config.json's).
TOKENIZER_FILES = ("zoo_tokenizer.json", "tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
# The files one of which makes a folder hold a tokenizer (the others only describe one).
_MAIN_FILES = ("zoo_tokenizer.json", "tokenizer.json", "tokenizer.model", "vocab.json")
# Files that only say which ids are bos/eos.
ID_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json")


# --- the fields zoo reads from each file, typed (errors name the file and the field) ---------


class _Fields(BaseModel):
    """Typed view of a tokenizer-side JSON file: the fields zoo reads have their JSON types checked
    (strictly: "5" is not an id, true is not an integer); fields zoo does not read pass as they are."""

    model_config = ConfigDict(strict=True, extra="allow")


TokenId = Annotated[int, Field(ge=0)]


class AddedToken(_Fields):
    """A special token as tokenizer files write it: {"content": "<s>", ...}. lstrip/rstrip: the
    token also takes the whitespace on its left/right; normalized: it is matched in the normalized
    text (by its normalized content), not in the text as given; single_word: it is matched only as
    a whole word (zoo refuses that one)."""
    content: str
    lstrip: Optional[bool] = None
    rstrip: Optional[bool] = None
    normalized: Optional[bool] = None
    single_word: Optional[bool] = None
    special: Optional[bool] = None


class _AddedTokenEntry(AddedToken):  # tokenizer.json's added_tokens entries also carry the id
    id: TokenId


_TokenText = Union[str, AddedToken, None]


class TokenizerConfig(_Fields):
    """tokenizer_config.json and special_tokens_map.json."""
    bos_token: _TokenText = None
    eos_token: _TokenText = None
    unk_token: _TokenText = None
    pad_token: _TokenText = None
    additional_special_tokens: Optional[list[Union[str, AddedToken]]] = None
    added_tokens_decoder: Optional[dict[str, AddedToken]] = None
    add_prefix_space: Optional[bool] = None


class IdsConfig(_Fields):
    """generation_config.json and config.json, as far as the tokenizer reads them."""
    bos_token_id: Union[TokenId, list[TokenId], None] = None
    eos_token_id: Union[TokenId, list[TokenId], None] = None
    vocab_size: Optional[int] = None


class TokenizerJson(_Fields):
    """tokenizer.json (Hugging Face tokenizers): the parts zoo reads. The pre-tokenizer and
    post-processor are trees of several shapes, walked with their own checks below."""
    model: dict[str, Any]
    normalizer: Optional[dict[str, Any]] = None
    pre_tokenizer: Optional[dict[str, Any]] = None
    post_processor: Optional[dict[str, Any]] = None
    added_tokens: Optional[list[_AddedTokenEntry]] = None


class BPEModel(_Fields):
    """tokenizer.json's "model" when its type is BPE (merges are checked pair by pair)."""
    type: str
    vocab: dict[str, TokenId]
    merges: list[Any] = []


class _BPETokenizerJson(TokenizerJson):  # validated whole, so that errors say model.vocab, not vocab
    model: BPEModel


class ZooTokenizerFile(_Fields):
    """zoo_tokenizer.json."""
    zoo_tokenizer: str
    version: int
    special_tokens: dict[str, Annotated[int, Field(ge=256)]]
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None


# Which typed view each side file is read into.
_SIDE_MODELS = {"tokenizer_config.json": TokenizerConfig, "special_tokens_map.json": TokenizerConfig,
                "generation_config.json": IdsConfig, "config.json": IdsConfig}

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
        self.settings = {"pattern": pattern, "add_prefix_space": add_prefix_space, "nfc": nfc}

    def normalize(self, text: str) -> str:
        return unicodedata.normalize("NFC", text) if self.nfc else text

    def encode_normalized(self, text: str, first: bool = True) -> list[int]:
        if self.add_prefix_space and not text.startswith(" "):
            text = " " + text
        ids = self.rank_to_id[np.asarray(self.encoding.encode_ordinary(text), dtype=np.int64)]
        return ids[ids >= 0].tolist()

    def encode(self, text: str) -> list[int]:
        return self.encode_normalized(self.normalize(text))

    def decode(self, ids: list[int], first: bool = True) -> str:
        return b"".join(self.id_to_bytes.get(i, b"") for i in ids).decode("utf-8", errors="replace")


SPACE = "\u2581"  # "▁", SentencePiece's mark for a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")


class _SpaceBPE:
    """SentencePiece's BPE as tokenizer.json writes it (Llama-2, Mistral, Gemma, Phi-3): spaces
    become "▁", the BPE runs over characters, and a character the vocabulary lacks becomes its
    UTF-8 bytes as <0xNN> tokens (byte fallback). Computed by tiktoken over UTF-8 bytes with ranks
    made so that it does the same: every byte, then the pieces of each character the vocabulary
    has (so characters are put together before any merge, and characters it lacks stay bytes),
    then the merges in file order; a rank stands for one id, or for the <0xNN> ids of its bytes.

    prepend: where "▁" is put in front of a stretch of text. "legacy": before every stretch
    between added tokens (a Prepend normalizer, Llama-2's kind); "always": before every stretch
    that does not start with "▁" (Metaspace); "first": the same, for the stretch at the start of
    the text only (Metaspace prepend_scheme first); "never" (Gemma). replace_in_normalizer: spaces
    become "▁" in the normalizer (Replace), so added tokens marked normalized are matched on that
    text; otherwise in the pre-tokenizer (Metaspace). split: Metaspace(split=true), each "▁"
    starts a new word. Without it the whole stretch is one word; it is still cut before each run
    of "▁" that follows another character when no token of the vocabulary holds such a pair (then
    no merge can cross the cut and the ids are the same), which keeps tiktoken's pieces short."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], source: Path, *, prepend: str,
                 replace_in_normalizer: bool, split: bool):
        byte_ids = {}
        for b in range(256):
            i = vocab.get(f"<0x{b:02X}>")
            if i is None:
                raise CheckpointError(source, f"byte fallback needs the 256 byte tokens <0x00> ... <0xFF>; "
                                              f"<0x{b:02X}> is not in the vocabulary", key="model.vocab")
            byte_ids[b] = i
        chars = {t for t in vocab if len(t) == 1}

        def reachable(token: str) -> bool:  # made of characters the vocabulary has (else BPE never reaches it)
            return all(c in chars for c in token)

        ranks: dict[bytes, int] = {}
        rank_ids: list[list[int]] = []

        def add(piece: bytes, ids: list[int]) -> None:
            if piece not in ranks:
                ranks[piece] = len(rank_ids)
                rank_ids.append(ids)

        for b in range(256):
            ch = chr(b)
            add(bytes([b]), [vocab[ch]] if b < 0x80 and ch in chars else [byte_ids[b]])
        for ch in sorted(chars):
            data = ch.encode("utf-8")
            for n in range(2, len(data)):  # a character's first bytes: its byte tokens, until it is whole
                add(data[:n], [byte_ids[x] for x in data[:n]])
            add(data, [vocab[ch]])
        for i, (a, b) in enumerate(merges):
            merged = a + b
            if merged not in vocab:
                raise CheckpointError(source, f"merge {i + 1} ({a!r} {b!r}) makes {merged!r}, which is not in the "
                                              "vocabulary", key="model.merges")
            if reachable(merged):
                add(merged.encode("utf-8"), [vocab[merged]])
        if split:
            pattern = f"{SPACE}[^{SPACE}]*|[^{SPACE}]+"
        elif any(reachable(t) and re.search(f"[^{SPACE}]{SPACE}", t) for t in vocab):
            pattern = r"[\s\S]+"  # a token crosses into a run of "▁": the stretch is one piece
        else:
            pattern = f"{SPACE}*[^{SPACE}]+|{SPACE}+"
        try:
            self.encoding = tiktoken.Encoding(f"zoo:{source}", pat_str=pattern, mergeable_ranks=ranks,
                                              special_tokens={})
        except ValueError as e:
            raise CheckpointError(source, f"tiktoken refused this vocabulary: {e}", key="model") from None
        self.rank_ids = rank_ids
        self.prepend = prepend
        self.replace_in_normalizer = replace_in_normalizer
        self.id_to_bytes = {i: _space_piece_bytes(t) for t, i in vocab.items()}
        self.size = max(vocab.values(), default=-1) + 1
        self.settings = {"prepend": prepend, "replace_in_normalizer": replace_in_normalizer, "split": split}

    def normalize(self, text: str) -> str:
        if not self.replace_in_normalizer:
            return text
        text = text.replace(" ", SPACE)
        return SPACE + text if self.prepend == "legacy" and text else text

    def encode_normalized(self, text: str, first: bool = True) -> list[int]:
        if not self.replace_in_normalizer:  # Metaspace, in the pre-tokenizer
            text = text.replace(" ", SPACE)
            if (self.prepend == "always" or (self.prepend == "first" and first)) and not text.startswith(SPACE):
                text = SPACE + text
        ids = []
        for rank in self.encoding.encode_ordinary(text):
            ids += self.rank_ids[rank]
        return ids

    def encode(self, text: str) -> list[int]:
        return self.encode_normalized(self.normalize(text))

    def decode(self, ids: list[int], first: bool = True) -> str:
        text = b"".join(self.id_to_bytes.get(i, b"") for i in ids).decode("utf-8", errors="replace")
        # The "▁" put in front of a stretch is no text of its own (the decoders' Strip / Metaspace).
        strip = self.prepend in ("legacy", "always") or (self.prepend == "first" and first)
        return text[1:] if strip and text.startswith(" ") else text


def _space_piece_bytes(token: str) -> bytes:
    """The bytes a SentencePiece-style token stands for: <0xNN> is byte NN, "▁" is a space."""
    m = _BYTE_PIECE.fullmatch(token)
    return bytes([int(m.group(1), 16)]) if m else token.replace(SPACE, " ").encode("utf-8")


class _SentencePiece:
    def __init__(self, model_bytes: bytes, source: Path):
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model_bytes)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError on a bad proto
            raise CheckpointError(source, f"not a SentencePiece model: {e}") from None
        self.size = self.sp.get_piece_size()

    def normalize(self, text: str) -> str:
        return text  # sentencepiece normalizes inside encode

    def encode_normalized(self, text: str, first: bool = True) -> list[int]:
        return self.sp.encode(text)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int], first: bool = True) -> str:
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

    def normalize(self, text: str) -> str:
        return text

    def encode_normalized(self, text: str, first: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], first: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# --- added tokens: how they are found in the text --------------------------------------------


class TokenFlags(NamedTuple):
    """How an added token is matched, as tokenizer.json's added_tokens say: lstrip/rstrip (it takes
    the whitespace on its left/right), normalized (matched in the normalized text), special
    (encode(special=False) spells out the special ones only)."""
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False
    special: bool = True


# What Rust's char::is_whitespace calls whitespace (the tokenizers library's lstrip/rstrip).
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_LEFT_SPACE = re.compile(f"[{_WHITESPACE}]*$")
_RIGHT_SPACE = re.compile(f"[{_WHITESPACE}]*")


class _Matcher:
    """Finds added tokens in text: leftmost, the longest at a place, then widened over the
    whitespace an lstrip/rstrip token takes."""

    def __init__(self, tokens: dict[str, tuple[int, TokenFlags]]):
        self.tokens = tokens
        # Longest first, so a token that contains another wins.
        alternatives = sorted(tokens, key=len, reverse=True)
        self.regex = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        plain = [t for t in alternatives if not tokens[t][1].special]
        self.plain_regex = re.compile("|".join(map(re.escape, plain))) if plain else None

    def split(self, text: str, special: bool = True) -> list[tuple[int, int, Optional[int]]]:
        """(start, end, id) for each token found, (start, end, None) for the text between them."""
        regex = self.regex if special else self.plain_regex
        out: list[tuple[int, int, Optional[int]]] = []
        at = 0
        if regex is not None:
            for m in regex.finditer(text):
                start, end = m.span()
                if start < at:  # inside the whitespace an rstrip token took
                    continue
                i, flags = self.tokens[m.group()]
                if flags.lstrip:
                    start = _LEFT_SPACE.search(text, at, start).start()
                if flags.rstrip:
                    end = _RIGHT_SPACE.match(text, end).end()
                if start > at:
                    out.append((at, start, None))
                out.append((start, end, i))
                at = end
        if at < len(text):
            out.append((at, len(text), None))
        return out


# --- the tokenizer -------------------------------------------------------------------------


class Tokenizer:
    """encode/decode text, with the checkpoint's special tokens and bos/eos ids."""

    def __init__(self, backend, *, kind: str, specials: dict[str, int], bos_id: Optional[int],
                 eos_ids: list[int], vocab_size: int, files: dict[str, bytes], main: tuple[str, ...],
                 special_flags: Optional[dict[str, "TokenFlags"]] = None):
        self._backend = backend
        self.kind = kind
        self._main = main  # the names in `files` that hold the vocabulary (the rest describe it)
        self.special_tokens = dict(specials)  # text -> id, matched in encode's input
        self._special_text = {i: s for s, i in specials.items()}
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)  # every id that ends generation (eos first)
        self.eos_id = eos_ids[0] if eos_ids else None
        self.vocab_size = vocab_size
        self.files = dict(files)  # file name -> content, written back by save()
        self._handover: Optional[dict[str, bytes]] = None  # made once: every checkpoint save writes them
        # How each special is matched (the file's added-token flags; plain where it says nothing).
        self.special_flags = {text: (special_flags or {}).get(text, TokenFlags()) for text in specials}
        # Those marked normalized are looked for, normalized, in the normalized text (as the library does).
        self._raw_matcher = _Matcher({t: (i, self.special_flags[t]) for t, i in specials.items()
                                      if not self.special_flags[t].normalized})
        normalized = {backend.normalize(t): (i, self.special_flags[t]) for t, i in specials.items()
                      if self.special_flags[t].normalized}
        normalized.pop("", None)
        self._normalized_matcher = _Matcher(normalized) if normalized else None

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"{len(self.special_tokens)} special tokens)")

    @property
    def adds_bos(self) -> bool:
        """Whether zoo starts documents and prompts with BOS: when the tokenizer has one distinct
        from EOS (GPT-2's <|endoftext|> is both, and only ends documents). Saved folders tell
        transformers the same (add_bos_token), so its encode() adds BOS exactly when zoo does."""
        return self.bos_id is not None and self.bos_id != self.eos_id

    @property
    def bos_token(self) -> Optional[str]:
        """The text of the BOS token (as tokenizer_config.json and chat templates name it), or None."""
        return self._special_text.get(self.bos_id)

    @property
    def eos_token(self) -> Optional[str]:
        """The text of the EOS token, or None."""
        return self._special_text.get(self.eos_id)

    # --- encode / decode ---

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False, special: bool = True) -> list[int]:
        """Token ids of `text`. special=True: special-token text (e.g. "<|endoftext|>") becomes its id;
        special=False: it is encoded as plain text."""
        ids: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise ValueError("this tokenizer has no BOS token")
            ids.append(self.bos_id)
        # As the tokenizers library does: added tokens matched in the text as given, each stretch
        # between them normalized, added tokens marked normalized matched in that, the rest encoded.
        for start, end, i in self._raw_matcher.split(text, special):
            if i is not None:
                ids.append(i)
                continue
            stretch = self._backend.normalize(text[start:end])
            if self._normalized_matcher is None:
                ids += self._backend.encode_normalized(stretch, first=start == 0)
                continue
            for s, e, j in self._normalized_matcher.split(stretch, special):
                ids += [j] if j is not None else self._backend.encode_normalized(stretch[s:e], first=start + s == 0)
        if add_eos:
            if self.eos_id is None:
                raise ValueError("this tokenizer has no EOS token")
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; special tokens are written as their text unless skip_special."""
        parts: list[str] = []
        run: list[int] = []
        first = True  # no special token before the run (where a "first" prefix space was put)
        as_text = getattr(self._backend, "id_to_bytes", {})
        for i in (int(t) for t in ids):
            text = self._special_text.get(i)
            # Added tokens that are not special decode with the text around them, as the library's decoder has them.
            if text is not None and (self.special_flags[text].special or i not in as_text):
                if run:
                    parts.append(self._backend.decode(run, first=first))
                    run = []
                first = False
                if not skip_special:
                    parts.append(self._special_text[i])
            else:
                run.append(i)
        if run:
            parts.append(self._backend.decode(run, first=first))
        return "".join(parts)

    # --- identity and saving ---

    def fingerprint(self) -> str:
        """Changes whenever the encoding changes: the vocabulary file(s), the backend's settings,
        the special tokens and the bos/eos ids. Not the files that only restate them (a folder
        saved with its hand-over files has the fingerprint of the tokenizer it was saved from)."""
        h = hashlib.sha256(self.kind.encode())
        for name in self._main:
            h.update(f"\0{name}\0{len(self.files[name])}\0".encode())
            h.update(self.files[name])
        rest = {"specials": sorted(self.special_tokens.items()), "bos": self.bos_id, "eos": list(self.eos_ids),
                "backend": getattr(self._backend, "settings", {})}
        h.update(json.dumps(rest, sort_keys=True).encode())
        return h.hexdigest()

    def save(self, folder: str | os.PathLike) -> list[Path]:
        """Write the tokenizer's files into `folder` (each atomically): the files it was read
        from, unchanged, and the hand-over files it lacks (handover_files)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name, content in {**self.files, **self.handover_files()}.items():
            write_bytes(folder / name, content)
            written.append(folder / name)
        return written

    def handover_files(self) -> dict[str, bytes]:
        """The files transformers needs to encode as zoo does that this tokenizer's own files
        lack: name -> content. tokenizer.json for zoo's byte-level tokenizer (bytes in GPT-2's
        alphabet, no merges, no regex split) and for a SentencePiece BPE model that has none;
        tokenizer_config.json (bos/eos, add_bos_token = adds_bos, the class to load) and
        special_tokens_map.json where the source had none."""
        if self._handover is None:
            self._handover = self._make_handover_files()
        return dict(self._handover)

    def _make_handover_files(self) -> dict[str, bytes]:
        out: dict[str, dict] = {}
        if "tokenizer.json" not in self.files:
            if self.kind == "byte-level":
                out["tokenizer.json"] = _byte_level_json(self)
            elif self.kind == "sentencepiece":
                spec = _sentencepiece_json(self, self._backend, self.files["tokenizer.model"])
                if spec is not None:
                    out["tokenizer.json"] = spec
        fast = "tokenizer.json" in self.files or "tokenizer.json" in out
        texts = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        if self.kind == "sentencepiece" and self._backend.sp.unk_id() >= 0:
            texts["unk_token"] = self._special_text.get(self._backend.sp.unk_id())
        texts = {key: text for key, text in texts.items() if text is not None}
        if "tokenizer_config.json" not in self.files:
            config: dict[str, Any] = {
                # PreTrainedTokenizerFast reads tokenizer.json as it is; a model's own class (LlamaTokenizer
                # in transformers 5) would rebuild its pre-tokenizer and encode differently.
                "tokenizer_class": "PreTrainedTokenizerFast" if fast else
                                   "GPT2Tokenizer" if self.kind == "byte-level-bpe" else "LlamaTokenizer",
                **texts, "pad_token": None, "add_bos_token": self.adds_bos, "add_eos_token": False,
                "clean_up_tokenization_spaces": False}
            if self.kind == "byte-level-bpe" and not fast:
                config["add_prefix_space"] = self._backend.add_prefix_space
            if self.kind == "sentencepiece" and not fast:
                config["legacy"] = True  # each stretch between special tokens gets the "▁" prefix, as sentencepiece
            out["tokenizer_config.json"] = config
        if "special_tokens_map.json" not in self.files:
            out["special_tokens_map.json"] = texts
        return {name: (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode() for name, value in out.items()}

    # --- constructors ---

    @classmethod
    def byte_level(cls) -> "Tokenizer":
        """zoo's tokenizer for the tiny presets: ids 0..255 are the UTF-8 bytes, 256 is <|eos|>,
        257 is <|bos|> (258 ids, within the tiny presets' vocab_size of 320)."""
        spec = {"zoo_tokenizer": "byte-level", "version": 1, "special_tokens": {"<|eos|>": 256, "<|bos|>": 257},
                "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
        content = (json.dumps(spec, indent=2) + "\n").encode()
        return _from_zoo_file(content, Path(ZOO_FILE), {}, {ZOO_FILE: content})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        """The tokenizer of a checkpoint folder, or of one tokenizer file (tokenizer.json,
        a SentencePiece .model file, zoo_tokenizer.json)."""
        # exists(), not is_file(): a FIFO or folder in a tokenizer file's place is refused by name.
        path = Path(path)
        if not path.exists():
            raise CheckpointError(path, "no such tokenizer file or folder")
        if not path.is_dir():
            return _load_file(path, _read_id_files(path.parent))
        side = _read_id_files(path)
        if (path / ZOO_FILE).exists():
            return _load_file(path / ZOO_FILE, side)
        tokenizer_json = path / "tokenizer.json"
        if tokenizer_json.exists() and _is_byte_level(_read_json(tokenizer_json)):
            return _load_file(tokenizer_json, side)
        if (path / "tokenizer.model").exists():
            return _load_file(path / "tokenizer.model", side)
        if (path / "vocab.json").exists() and (path / "merges.txt").exists():
            return _from_vocab_merges(path, side)
        if tokenizer_json.exists():
            return _load_file(tokenizer_json, side)  # raises, saying why this tokenizer.json is not read
        raise CheckpointError(path, "no tokenizer here (looked for zoo_tokenizer.json, tokenizer.json, "
                                    "tokenizer.model, vocab.json + merges.txt)")


# --- hand-over: tokenizer.json as the tokenizers library reads it ---------------------------


def _added_tokens(specials: dict[str, int]) -> list[dict]:
    """tokenizer.json's added_tokens: zoo's specials, matched whole in the text before anything else."""
    return [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True} for text, i in sorted(specials.items(), key=lambda item: item[1])]


def _bos_processor(tok: Tokenizer) -> Optional[dict]:
    """A post-processor that puts BOS first when zoo does (adds_bos), else none."""
    bos = tok.bos_token
    if not tok.adds_bos or bos is None:  # (a BOS id with no token text cannot be named here)
        return None
    first = {"SpecialToken": {"id": bos, "type_id": 0}}
    return {"type": "TemplateProcessing",
            "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [first, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": bos, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tok.bos_id], "tokens": [bos]}}}


def _bpe_model(vocab: dict[str, int], merges: list[tuple[str, str]], **settings) -> dict:
    # Merges as "a b" strings (read by every tokenizers version) unless a piece holds a space.
    plain = not any(" " in a or " " in b for a, b in merges)
    return {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            **settings, "vocab": vocab, "merges": [f"{a} {b}" if plain else [a, b] for a, b in merges]}


def _byte_level_json(tok: Tokenizer) -> dict:
    """zoo's byte-level tokenizer as tokenizers' BPE: the 256 bytes in GPT-2's alphabet with their
    byte values as ids and no merges, so every byte is one token; no regex split (zoo splits
    nothing); the specials as added tokens."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": _added_tokens(tok.special_tokens),
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": _bos_processor(tok),
            "decoder": byte_level, "model": _bpe_model(vocab, [])}


def _proto_fields(data: bytes) -> dict[int, list]:
    """The fields of one protocol-buffer message: number -> values (ints for varints, bytes for
    the rest). Enough to read the few settings of a SentencePiece model that sentencepiece's
    Python API does not show (without a protobuf dependency). ValueError on malformed bytes."""
    def varint(at: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            if at >= len(data) or shift > 63:
                raise ValueError("truncated varint")
            byte = data[at]
            value |= (byte & 0x7F) << shift
            at, shift = at + 1, shift + 7
            if byte < 0x80:
                return value, at

    fields: dict[int, list] = {}
    at = 0
    while at < len(data):
        key, at = varint(at)
        wire = key & 7
        if wire == 0:
            value, at = varint(at)
        elif wire == 2:
            size, at = varint(at)
            value, at = data[at:at + size], at + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, at = data[at:at + size], at + size
        else:
            raise ValueError(f"wire type {wire}")
        if at > len(data):
            raise ValueError("truncated field")
        fields.setdefault(key >> 3, []).append(value)
    return fields


def _sentencepiece_json(tok: Tokenizer, backend: _SentencePiece, model: bytes) -> Optional[dict]:
    """A SentencePiece BPE model as tokenizers' BPE, the way Llama-2's own tokenizer.json is made:
    "▁" put before each stretch of text and for every space, merges ranked by the score of the
    piece they make, bytes that no piece covers as <0xNN> pieces. Only for models where that is
    exact: BPE with byte fallback, no normalization rule, add_dummy_prefix, spaces kept as they
    are, no user-defined pieces. None otherwise (transformers then converts tokenizer.model itself)."""
    try:
        top = _proto_fields(model)
        trainer = _proto_fields(top.get(2, [b""])[-1])
        normalizer = _proto_fields(top.get(3, [b""])[-1])
    except ValueError:
        return None
    # Field numbers and defaults of sentencepiece_model.proto (TrainerSpec, NormalizerSpec).
    bpe = trainer.get(3, [1])[-1] == 2
    byte_fallback = bool(trainer.get(35, [0])[-1])
    suffix = bool(trainer.get(24, [0])[-1])
    identity = normalizer.get(1, [b""])[-1] in (b"identity", b"") and not normalizer.get(2, [b""])[-1]
    dummy_prefix = bool(normalizer.get(3, [1])[-1])
    squeeze = bool(normalizer.get(4, [1])[-1])
    escape = bool(normalizer.get(5, [1])[-1])
    try:  # ModelProto.pieces: SentencePiece messages; type 4 is USER_DEFINED (matched whole, like added tokens)
        user_defined = any(_proto_fields(piece).get(3, [1])[-1] == 4 for piece in top.get(1, []))
    except ValueError:
        return None
    sp = backend.sp
    size = sp.get_piece_size()
    if not (bpe and byte_fallback and identity and dummy_prefix and escape and not squeeze and not suffix) \
            or user_defined or sp.unk_id() < 0:
        return None
    vocab = {sp.id_to_piece(i): i for i in range(size)}
    normal = {p: i for p, i in vocab.items() if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)
                                                     or sp.is_unused(i))}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-sp.get_score(i), i, normal[left], normal[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    space = "\u2581"
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": _added_tokens(tok.special_tokens),
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": space},
            {"type": "Replace", "pattern": {"String": " "}, "content": space}]},
        "pre_tokenizer": None, "post_processor": _bos_processor(tok),
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": space}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": _bpe_model(vocab, merges, unk_token=sp.id_to_piece(sp.unk_id()), fuse_unk=True, byte_fallback=True),
    }


# --- loading -------------------------------------------------------------------------------


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether a folder holds a tokenizer's vocabulary (not only files that describe one)."""
    folder = Path(folder)
    return any((folder / name).exists() for name in _MAIN_FILES)


def _read_json(path: Path) -> Any:
    return read_json(path, path.name)


def _read_object(path: Path) -> dict:
    data = _read_json(path)
    if not isinstance(data, dict):
        raise CheckpointError(path, f"not a JSON object (a {type(data).__name__}): {path.name} is {{...}}")
    return data


def _read_id_files(folder: Path) -> dict[str, tuple[Path, Any]]:
    """The JSON files beside a tokenizer that name special tokens and ids: name -> (path, typed
    view; for added_tokens.json, a dict of text -> id)."""
    out = {}
    for name in ID_FILES + ("added_tokens.json",):
        p = folder / name
        if not p.exists():
            continue
        data = _read_object(p)
        if name == "added_tokens.json":
            for text, i in data.items():
                if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                    raise CheckpointError(p, f"id {show_value(i)} is not a non-negative integer", key=text)
            out[name] = (p, data)
        else:
            out[name] = (p, parse_model(p, _SIDE_MODELS[name], data, name))
    return out


def _tokenizer_files(folder: Path, main: Path, canonical: str) -> dict[str, bytes]:
    """Contents of the tokenizer's files, to write back on save. `main` is saved under its
    canonical name (a SentencePiece model may be called anything.model, tokenizer.json
    anything.json)."""
    files = {}
    for name in TOKENIZER_FILES:
        if (folder / name).exists():
            files[name] = _read_bytes(folder / name)
    files[canonical] = _read_bytes(main)
    return files


def _read_bytes(path: Path) -> bytes:
    """A tokenizer file's bytes: a regular file (reading a FIFO would block)."""
    path = regular_file(path, "tokenizer file")
    try:
        return path.read_bytes()
    except OSError as e:
        raise CheckpointError(path, f"cannot read this tokenizer file ({e.strerror or e})") from None


def _load_file(path: Path, side: dict) -> "Tokenizer":
    if path.suffix == ".model":
        return _from_sentencepiece(path, side)
    data = _read_json(path)
    if isinstance(data, dict) and "zoo_tokenizer" in data:
        files = _tokenizer_files(path.parent, path, ZOO_FILE)
        return _from_zoo_file(files[ZOO_FILE], path, side, files)
    return _from_tokenizer_json(path, data, side)


def _from_zoo_file(content: bytes, source: Path, side: dict, files: dict[str, bytes]) -> Tokenizer:
    """zoo's byte-level tokenizer from the content of its file (already known to be JSON)."""
    spec = parse_model(source, ZooTokenizerFile, json.loads(content), ZOO_FILE)
    if spec.zoo_tokenizer != "byte-level" or spec.version != 1:
        raise CheckpointError(source, f"unknown zoo tokenizer {spec.zoo_tokenizer!r} version {spec.version!r} "
                                      "(this zoo reads byte-level version 1)", key="zoo_tokenizer")
    specials = spec.special_tokens
    own = {"bos": specials.get(spec.bos_token), "eos": specials.get(spec.eos_token)}
    return _assemble(_Bytes(), "byte-level", specials, own, side, files, (ZOO_FILE,), source)


def _from_sentencepiece(path: Path, side: dict) -> Tokenizer:
    backend = _SentencePiece(_read_bytes(path), path)
    specials = backend.builtin_specials()
    specials.update(_configured_specials(side, backend.piece_id))
    sp = backend.sp
    own = {"bos": sp.bos_id() if sp.bos_id() >= 0 else None, "eos": sp.eos_id() if sp.eos_id() >= 0 else None}
    files = _tokenizer_files(path.parent, path, "tokenizer.model")
    return _assemble(backend, "sentencepiece", specials, own, side, files, ("tokenizer.model",), path,
                     lookup=backend.piece_id)


def _is_byte_level(data) -> bool:
    pre = data.get("pre_tokenizer") if isinstance(data, dict) else None
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    return isinstance(steps, list) and any(isinstance(s, dict) and s.get("type") == "ByteLevel" for s in steps)


def _from_tokenizer_json(path: Path, data, side: dict) -> Tokenizer:
    head = parse_model(path, TokenizerJson, data, "tokenizer.json")
    kind = head.model.get("type")
    if kind != "BPE":
        raise CheckpointError(path, f"model type {show_value(kind)} is not supported (zoo reads BPE tokenizer.json, "
                                    "byte-level or SentencePiece-style; other SentencePiece tokenizers from "
                                    "tokenizer.model)", key="model.type")
    tok = parse_model(path, _BPETokenizerJson, data, "tokenizer.json")
    model = tok.model
    for key, ok in (("dropout", (None,)), ("continuing_subword_prefix", (None, "")), ("end_of_word_suffix", (None, ""))):
        value = getattr(model, key, None)
        if value not in ok:
            raise CheckpointError(path, f"value {show_value(value)} is not supported", key=f"model.{key}")
    vocab = model.vocab
    if _is_byte_level(data):
        if getattr(model, "byte_fallback", None) not in (False, None):
            raise CheckpointError(path, f"value {show_value(model.byte_fallback)} is not supported with a byte-level "
                                        "pre-tokenizer (its bytes are tokens already)", key="model.byte_fallback")
        pattern, add_prefix_space = _byte_level_pattern(path, tok.pre_tokenizer)
        normalizer = tok.normalizer
        if normalizer is not None and normalizer.get("type") != "NFC":
            raise CheckpointError(path, f"normalizer {show_value(normalizer.get('type'))} is not supported with a "
                                        "byte-level pre-tokenizer (zoo reads none or NFC)", key="normalizer")
        backend = _ByteBPE(vocab, _parse_merges(model.merges, path), pattern, path, add_prefix_space,
                           nfc=normalizer is not None)
        kind = "byte-level-bpe"
    else:
        settings = _space_settings(path, tok.normalizer, tok.pre_tokenizer)
        if getattr(model, "byte_fallback", None) is not True:
            raise CheckpointError(path, f"value {show_value(getattr(model, 'byte_fallback', None))} is not supported: "
                                        "zoo reads SentencePiece-style BPE (spaces as \u2581) with byte_fallback true",
                                  key="model.byte_fallback")
        backend = _SpaceBPE(vocab, _parse_merges(model.merges, path), path, **settings)
        kind = "sentencepiece-bpe"
    specials: dict[str, int] = {}
    flags: dict[str, TokenFlags] = {}
    for n, entry in enumerate(tok.added_tokens or []):
        if entry.single_word:
            raise CheckpointError(path, f"added token {entry.content!r} is matched as a single word only, which zoo "
                                        "does not do", key=f"added_tokens[{n}].single_word")
        specials[entry.content] = entry.id
        special = entry.special is not False
        flags[entry.content] = TokenFlags(bool(entry.lstrip), bool(entry.rstrip),
                                          entry.normalized if entry.normalized is not None else not special, special)
        # What the token decodes to where it is not written as special text (an added token not special).
        backend.id_to_bytes[entry.id] = (_space_piece_bytes(entry.content) if isinstance(backend, _SpaceBPE)
                                         else entry.content.encode("utf-8"))
    specials.update(_configured_specials(side, lambda s: vocab.get(s)))
    for text, f in _configured_flags(side).items():
        flags.setdefault(text, f)
    own = {"bos": _template_bos(tok.post_processor, specials), "eos": None}
    files = _tokenizer_files(path.parent, path, "tokenizer.json")
    return _assemble(backend, kind, specials, own, side, files, ("tokenizer.json",), path, lookup=vocab.get,
                     flags=flags)


def _space_settings(path: Path, normalizer, pre) -> dict:
    """How a tokenizer.json that is not byte-level puts "▁" for spaces, as _SpaceBPE takes it:
    normalizer Replace(" ", "▁"), with Prepend("▁") (Llama-2's legacy kind) or without (Gemma),
    and no pre-tokenizer (or a Split on " ", which finds none after that normalizer); or no
    normalizer and a Metaspace pre-tokenizer ("▁", prepend_scheme always/first/never, split)."""
    def refused(key: str, value, why: str) -> CheckpointError:
        return CheckpointError(path, f"{key} {show_value(value)} is not supported: {why}. zoo reads a byte-level "
                                     "pre-tokenizer (ByteLevel, Split(Regex) then ByteLevel, Digits then ByteLevel), "
                                     "or SentencePiece-style BPE: normalizer Replace(' ', '\u2581') with or without "
                                     "Prepend('\u2581') and no pre-tokenizer, or a Metaspace pre-tokenizer", key=key)

    steps = normalizer.get("normalizers") if isinstance(normalizer, dict) and normalizer.get("type") == "Sequence" \
        else [] if normalizer is None else [normalizer]
    replace = prepend = False
    for step in steps if isinstance(steps, list) else [steps]:
        kind = step.get("type") if isinstance(step, dict) else None
        if kind == "Replace" and step.get("pattern") == {"String": " "} and step.get("content") == SPACE \
                and not replace:
            replace = True
        elif kind == "Prepend" and step.get("prepend") == SPACE and not prepend:
            prepend = True
        else:
            raise refused("normalizer", normalizer, f"the step {show_value(step)} is not one zoo computes")
    if prepend and not replace:
        raise refused("normalizer", normalizer, "Prepend('\u2581') without Replace(' ', '\u2581')")
    pre_kind = pre.get("type") if isinstance(pre, dict) else None
    if replace:
        if pre is None or (pre_kind == "Split" and pre.get("pattern") == {"String": " "} and not pre.get("invert")):
            return {"prepend": "legacy" if prepend else "never", "replace_in_normalizer": True, "split": False}
        raise refused("pre_tokenizer", pre, "after a normalizer that puts \u2581 for spaces zoo reads no "
                                            "pre-tokenizer, or a Split on ' ' (which then finds none)")
    if pre_kind == "Metaspace" and pre.get("replacement") == SPACE:
        scheme = pre.get("prepend_scheme")
        if scheme is None:  # files written before prepend_scheme: add_prefix_space
            scheme = "always" if pre.get("add_prefix_space", True) else "never"
        if scheme not in ("always", "first", "never"):
            raise refused("pre_tokenizer", pre, f"prepend_scheme {show_value(scheme)} is not always, first or never")
        return {"prepend": scheme, "replace_in_normalizer": False, "split": pre.get("split", True) is not False}
    raise refused("pre_tokenizer", pre, "neither byte-level nor SentencePiece-style (Metaspace)")


def _byte_level_pattern(path: Path, pre) -> tuple[str, bool]:
    """The regex and add_prefix_space of a byte-level pre-tokenizer: ByteLevel(use_regex=True)
    means GPT-2's regex; Sequence[Split(regex, Isolated), ByteLevel(use_regex=False)] gives its own;
    Sequence[Digits(individual_digits), ByteLevel(use_regex=True)] is GPT-2's with lone digits;
    ByteLevel(use_regex=False) alone splits nothing."""
    def unsupported(why: str) -> CheckpointError:
        return CheckpointError(path, f"{why}; zoo reads ByteLevel, Split(Regex) then ByteLevel, or Digits then "
                                     "ByteLevel", key="pre_tokenizer")

    if not isinstance(pre, dict):
        raise unsupported(f"pre_tokenizer {show_value(pre)} is not byte-level")
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) for s in steps):
        raise unsupported("empty or malformed Sequence")
    *splits, last = steps
    if last.get("type") != "ByteLevel":
        raise unsupported(f"the last step is {show_value(last.get('type'))}, not ByteLevel")
    add_prefix_space = bool(last.get("add_prefix_space", False))
    if last.get("use_regex", True):
        if not splits:
            return GPT2_PATTERN, add_prefix_space
        if len(splits) == 1 and splits[0].get("type") == "Digits" and splits[0].get("individual_digits"):
            return GPT2_DIGITS_PATTERN, add_prefix_space  # SmolLM's tokenizer
        raise unsupported("a step before a ByteLevel that also splits (other than Digits(individual_digits))")
    if not splits:
        return r"[\s\S]+", add_prefix_space  # nothing splits the text (zoo's byte-level tokenizer.json)
    if len(splits) != 1 or splits[0].get("type") != "Split":
        raise unsupported("ByteLevel(use_regex=false) takes one Split before it, or nothing")
    split = splits[0]
    pattern = split.get("pattern")
    regex = pattern.get("Regex") if isinstance(pattern, dict) else None
    if not isinstance(regex, str) or split.get("behavior") != "Isolated" or split.get("invert"):
        raise unsupported("the Split must be a Regex pattern, behavior Isolated, not inverted")
    return regex, add_prefix_space


def _template_bos(post, specials: dict[str, int]) -> Optional[int]:
    """The special token a TemplateProcessing post-processor puts first (Llama-3's BOS)."""
    if not isinstance(post, dict):
        return None
    steps = post.get("processors") if post.get("type") == "Sequence" else [post]
    if not isinstance(steps, list):
        return None
    for step in steps:
        if isinstance(step, dict) and step.get("type") == "TemplateProcessing":
            single = step.get("single")
            first = single[0] if isinstance(single, list) and single else None
            special = first.get("SpecialToken") if isinstance(first, dict) else None
            token = special.get("id") if isinstance(special, dict) else None
            return specials.get(token) if isinstance(token, str) else None
    return None


def _parse_merges(raw, path: Path) -> list[tuple[str, str]]:
    if not isinstance(raw, list):
        raise CheckpointError(path, "must be a list", key="model.merges")
    merges = []
    for i, m in enumerate(raw):
        pair = m.split(" ") if isinstance(m, str) else m
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
            raise CheckpointError(path, f"merge {i + 1} ({show_value(m)}) is not a pair of tokens", key="model.merges")
        merges.append((pair[0], pair[1]))
    return merges


def _from_vocab_merges(folder: Path, side: dict) -> Tokenizer:
    vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
    vocab = _read_json(vocab_path)
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                              for i in vocab.values()):
        raise CheckpointError(vocab_path, "must be a JSON object of token -> non-negative integer id")
    merges = []
    lines = read_text(merges_path, "merges.txt").splitlines()
    for n, line in enumerate(lines, start=1):
        if not line or (n == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise CheckpointError(merges_path, f"line {n} ({show_value(line)}) is not two tokens separated by a space")
        merges.append((pair[0], pair[1]))
    config = side.get("tokenizer_config.json", (None, TokenizerConfig()))[1]
    backend = _ByteBPE(vocab, merges, GPT2_PATTERN, merges_path, bool(config.add_prefix_space))
    specials = _configured_specials(side, vocab.get)
    # GPT2Tokenizer's defaults when no config names them: bos = eos = unk = <|endoftext|>.
    endoftext = vocab.get("<|endoftext|>")
    if endoftext is not None:
        specials.setdefault("<|endoftext|>", endoftext)
    own = {"bos": endoftext, "eos": endoftext}
    files = _tokenizer_files(folder, merges_path, "merges.txt")
    return _assemble(backend, "byte-level-bpe", specials, own, side, files, ("vocab.json", "merges.txt"), merges_path,
                     lookup=vocab.get)


def _token_text(value: Union[str, AddedToken, None]) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.content if isinstance(value, AddedToken) else value


def _configured_specials(side: dict, lookup: Callable[[str], Optional[int]]) -> dict[str, int]:
    """Special and added tokens that tokenizer_config.json, special_tokens_map.json and
    added_tokens.json declare (text -> id)."""
    specials: dict[str, int] = {}
    if "added_tokens.json" in side:
        specials.update(side["added_tokens.json"][1])
    if "tokenizer_config.json" in side:
        path, config = side["tokenizer_config.json"]
        for i, entry in (config.added_tokens_decoder or {}).items():
            if not (i.isascii() and i.isdigit()):
                raise CheckpointError(path, f"key {show_value(i)} is not an integer id", key="added_tokens_decoder")
            specials[entry.content] = int(i)
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if name not in side:
            continue
        _, config = side[name]
        named = [config.bos_token, config.eos_token, config.unk_token, config.pad_token]
        named += config.additional_special_tokens or []
        for value in named:
            text = _token_text(value)
            if text is not None and text not in specials and lookup(text) is not None:
                specials[text] = lookup(text)
    return specials


def _configured_flags(side: dict) -> dict[str, TokenFlags]:
    """How tokenizer_config.json's added_tokens_decoder says its tokens are matched (lstrip,
    rstrip, special; in the text as given, as transformers' own matching does)."""
    flags: dict[str, TokenFlags] = {}
    if "tokenizer_config.json" in side:
        path, config = side["tokenizer_config.json"]
        for i, entry in (config.added_tokens_decoder or {}).items():
            if entry.single_word:
                raise CheckpointError(path, f"added token {entry.content!r} is matched as a single word only, which "
                                            "zoo does not do", key=f"added_tokens_decoder.{i}.single_word")
            flags[entry.content] = TokenFlags(bool(entry.lstrip), bool(entry.rstrip), False, entry.special is not False)
    return flags


def _assemble(backend, kind: str, specials: dict[str, int], own: dict, side: dict, files: dict[str, bytes],
              main: tuple[str, ...], source: Path,
              lookup: Optional[Callable[[str], Optional[int]]] = None,
              flags: Optional[dict[str, TokenFlags]] = None) -> Tokenizer:
    """Resolve bos/eos from the checkpoint's files and check every id against config.json's vocab_size."""
    def resolve(which: str) -> list[int]:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if name in side:
                path, config = side[name]
                text = _token_text(getattr(config, f"{which}_token"))
                if text is not None:
                    i = specials.get(text, lookup(text) if lookup else None)
                    if i is None:
                        raise CheckpointError(path, f"token {text!r} is not in the tokenizer", key=f"{which}_token")
                    return [i]
        for name in ("generation_config.json", "config.json"):
            if name in side:
                path, config = side[name]
                value = getattr(config, f"{which}_token_id")
                if value == []:
                    raise CheckpointError(path, "expected an id or a list of ids, got []", key=f"{which}_token_id")
                if value is not None:
                    return list(value) if isinstance(value, list) else [value]
        return [own[which]] if own.get(which) is not None else []

    bos = resolve("bos")
    eos_ids = resolve("eos")
    # generation_config.json may list more stop ids (Llama-3 instruct) than the tokenizer's eos.
    if "generation_config.json" in side:
        extra = side["generation_config.json"][1].eos_token_id
        for i in extra if isinstance(extra, list) else [extra]:
            if i is not None and i not in eos_ids:
                eos_ids.append(i)
    size = max([backend.size - 1, *specials.values(), *bos, *eos_ids]) + 1
    vocab_size = size
    if "config.json" in side:
        path, config = side["config.json"]
        declared = config.vocab_size
        if declared is not None:
            if declared < size:
                raise CheckpointError(path, f"the model has {declared} embeddings but the tokenizer ({source.name}) "
                                            f"uses ids up to {size - 1}", key="vocab_size")
            vocab_size = declared
    if flags is None:
        flags = _configured_flags(side)
    return Tokenizer(backend, kind=kind, specials=specials, bos_id=bos[0] if bos else None, eos_ids=eos_ids,
                     vocab_size=vocab_size, files=files, main=main, special_flags=flags)
