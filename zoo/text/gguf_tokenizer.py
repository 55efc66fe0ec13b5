"""Tokenizers in and out of GGUF metadata (tokenizer.ggml.*).

In: the vocabulary a GGUF file carries becomes files that zoo's tokenizer reader (tokenizers.py)
loads, and transformers too:
  tokenizer.ggml.model "gpt2"   byte-level BPE: tokens, token types, merges and the pre-tokenizer
                                named by tokenizer.ggml.pre (gpt-2, llama-bpe, smollm) -> tokenizer.json
  tokenizer.ggml.model "llama"  SentencePiece: tokens, scores, token types -> tokenizer.model, a
                                SentencePiece BPE model (what llama.cpp's "llama" tokenizer computes:
                                merges by piece score, byte fallback, a space prefix as
                                tokenizer.ggml.add_space_prefix says)
plus tokenizer_config.json with the bos/eos/unk/pad tokens, add_bos_token/add_eos_token and
the chat template. tokenizer.model is protobuf; the few fields written are encoded here (the
protobuf package is no dependency of zoo), and sentencepiece itself reads the result back
before it is used.

Out: a folder's tokenizer becomes the same keys, as llama.cpp's converter writes them: the
vocabulary padded with UNUSED "[PAD<id>]" tokens up to the model's vocab_size, special tokens
typed CONTROL. zoo's own byte-level tokenizer (ids 0-255 are bytes) is written as a byte-level
BPE whose tokens 0-255 are the bytes; llama.cpp needs a merges list and gguf's writer refuses an
empty one, so it gets one merge that valid UTF-8 never reaches (bytes C0 C0).
"""

from __future__ import annotations

import json
import struct
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from gguf.constants import GGUFValueType as T
from gguf.constants import Keys

from ..core.errors import CheckpointError
from ..core.files import read_text
from .tokenizers import GPT2_DIGITS_PATTERN, GPT2_PATTERN, Tokenizer, _byte_level_pattern, bytes_to_unicode

# Token types (gguf.constants.TokenType; SentencePiece's piece types use the same numbers).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Llama 3's pre-tokenizer regex, as its tokenizer.json gives it.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


# llama.cpp's names for byte-level BPE pre-tokenizers (tokenizer.ggml.pre) that zoo computes,
# with the tokenizer.json pre-tokenizer and the regex zoo's reader derives from it.
PRE_TOKENIZERS = {
    "gpt-2": (_byte_level(True), GPT2_PATTERN),
    "llama-bpe": ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        _byte_level(False)]}, LLAMA3_PATTERN),
    "smollm": ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                      _byte_level(True)]}, GPT2_DIGITS_PATTERN),
}
# The special ids llama.cpp's tokenizer keys name, and tokenizer_config.json's names for them.
_SPECIAL_IDS = {"bos": (Keys.Tokenizer.BOS_ID, "bos_token"), "eos": (Keys.Tokenizer.EOS_ID, "eos_token"),
                "unk": (Keys.Tokenizer.UNK_ID, "unk_token"), "pad": (Keys.Tokenizer.PAD_ID, "pad_token")}


# --- GGUF -> tokenizer files --------------------------------------------------------------


def tokenizer_from_gguf(f, vocab_size: int) -> Optional[Tokenizer]:
    """The tokenizer that a GGUFFile's metadata describes (None when it carries none), loaded by
    zoo's own reader from the files made here; errors name the GGUF file and key."""
    files = tokenizer_files(f, vocab_size)
    if files is None:
        return None
    with tempfile.TemporaryDirectory(prefix="zoo-gguf-tokenizer-") as tmp:
        for name, content in files.items():
            (Path(tmp) / name).write_bytes(content)
        try:
            return Tokenizer.from_pretrained(tmp)
        except CheckpointError as e:  # the files are made from the metadata: the metadata is at fault
            where = f"{e.path}: {e.key!r}: " if e.key is not None else f"{e.path}: "
            key = "tokenizer.ggml.merges" if e.key in ("merges", "model.merges") else "tokenizer.ggml.tokens"
            raise CheckpointError(f.path, f"the tokenizer it describes does not load: {str(e).removeprefix(where)}",
                                  key=key) from None


# The tokenizer kinds of GGUF's tokenizer.ggml.model (a vocabulary's format, named after the
# architectures that introduced them; any architecture may carry either).
BYTE_LEVEL_BPE = "gpt2"
SENTENCEPIECE = "llama"


def tokenizer_files(f, vocab_size: int) -> Optional[dict[str, bytes]]:
    """File name -> content of the tokenizer a GGUFFile describes, or None without one."""
    kind = f.value("tokenizer.ggml.model", str, None)
    if kind is None or kind == "none":
        return None
    if kind not in (BYTE_LEVEL_BPE, SENTENCEPIECE):
        raise CheckpointError(f.path, f"tokenizer model {kind!r} is not supported (zoo reads 'gpt2', byte-level BPE, "
                                      "and 'llama', SentencePiece)", key="tokenizer.ggml.model")
    tokens = _strings(f, "tokenizer.ggml.tokens")
    if len(tokens) > vocab_size:
        raise CheckpointError(f.path, f"{len(tokens)} tokens, more than the {vocab_size} rows of token_embd.weight",
                              key="tokenizer.ggml.tokens")
    types = _numbers(f, "tokenizer.ggml.token_type", len(tokens), int, NORMAL)
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in seen:
            raise CheckpointError(f.path, f"token {t!r} appears twice (ids {seen[t]} and {i})",
                                  key="tokenizer.ggml.tokens")
        seen[t] = i
    special = {}
    for which, (key, _) in _SPECIAL_IDS.items():
        i = f.value(key, int, None)
        if i is not None and not 0 <= i < len(tokens):
            raise CheckpointError(f.path, f"id {i} is not a token (there are {len(tokens)})", key=key)
        special[which] = i
    if kind == BYTE_LEVEL_BPE:
        files = {"tokenizer.json": _tokenizer_json(f, tokens, types, special)}
        default_bos = False
    else:
        files = {"tokenizer.model": _sentencepiece_model(f, tokens, types, special)}
        default_bos = True  # llama.cpp's default for a SentencePiece vocabulary
    config = {"tokenizer_class": "PreTrainedTokenizerFast" if kind == BYTE_LEVEL_BPE else "LlamaTokenizer"}
    for which, (_, name) in _SPECIAL_IDS.items():
        if special[which] is not None:
            config[name] = tokens[special[which]]
    config["add_bos_token"] = f.value("tokenizer.ggml.add_bos_token", bool, default_bos)
    config["add_eos_token"] = f.value("tokenizer.ggml.add_eos_token", bool, False)
    template = f.value("tokenizer.chat_template", str, None)
    if template is not None:
        config["chat_template"] = template
    files["tokenizer_config.json"] = _json_bytes(config)
    return files


def _strings(f, key: str) -> list[str]:
    values = f.value(key, list, why=" (a tokenizer needs its token list)")
    if not all(isinstance(v, str) for v in values):
        raise CheckpointError(f.path, "expected a list of strings", key=key)
    return values


def _numbers(f, key: str, n: int, kind: type, default) -> list:
    values = f.value(key, list, None)
    if values is None:
        return [default] * n
    if len(values) != n or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise CheckpointError(f.path, f"expected {n} numbers, one per token", key=key)
    return [kind(v) for v in values]


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _tokenizer_json(f, tokens: list[str], types: list[int], special: dict) -> bytes:
    """Byte-level BPE as a Hugging Face tokenizer.json (tokenizers' own layout)."""
    pre_name = f.value("tokenizer.ggml.pre", str, "default")
    if pre_name not in PRE_TOKENIZERS:
        raise CheckpointError(f.path, f"pre-tokenizer {pre_name!r} is not supported (zoo reads "
                                      f"{', '.join(PRE_TOKENIZERS)})", key="tokenizer.ggml.pre")
    merges = _strings(f, "tokenizer.ggml.merges") if "tokenizer.ggml.merges" in f.metadata else []
    for i, m in enumerate(merges):
        if len(m.split(" ")) != 2:
            raise CheckpointError(f.path, f"merge {i + 1} ({m!r}) is not two tokens separated by a space",
                                  key="tokenizer.ggml.merges")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": types[i] != CONTROL, "special": types[i] == CONTROL}
             for i, t in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED)]
    post = None
    bos = special["bos"]
    if bos is not None and f.value("tokenizer.ggml.add_bos_token", bool, False):
        first = {"SpecialToken": {"id": tokens[bos], "type_id": 0}}
        post = {"type": "TemplateProcessing",
                "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [first, {"Sequence": {"id": "A", "type_id": 0}}, first, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}}
    data = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre_name][0], "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  # UNUSED tokens (llama.cpp's "[PAD<id>]" padding) are no text: their ids decode to nothing
                  "vocab": {t: i for i, t in enumerate(tokens) if types[i] != UNUSED}, "merges": merges},
    }
    return _json_bytes(data)


def _sentencepiece_model(f, tokens: list[str], types: list[int], special: dict) -> bytes:
    """A SentencePiece BPE ModelProto with the GGUF vocabulary (sentencepiece_model.proto's
    field numbers)."""
    scores = _numbers(f, "tokenizer.ggml.scores", len(tokens), float, 0.0)
    bad = next((i for i, t in enumerate(types) if t not in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE)), None)
    if bad is not None:
        raise CheckpointError(f.path, f"token {bad} has type {types[bad]}, not a SentencePiece piece type (1-6)",
                              key="tokenizer.ggml.token_type")
    if UNKNOWN not in types:
        raise CheckpointError(f.path, "no token of type UNKNOWN (2): a SentencePiece vocabulary needs one",
                              key="tokenizer.ggml.token_type")
    pieces = b"".join(_pb_bytes(1, _pb_bytes(1, t.encode("utf-8")) + _pb_float(2, s)
                                + (_pb_int(3, ty) if ty != NORMAL else b""))
                      for t, s, ty in zip(tokens, scores, types))
    trainer = _pb_int(3, 2) + _pb_int(4, len(tokens)) + _pb_int(35, int(BYTE in types))  # model_type BPE
    unk = types.index(UNKNOWN)
    ids = {**special, "unk": unk}
    for number, which in ((40, "unk"), (41, "bos"), (42, "eos"), (43, "pad")):  # *_id: -1 when absent
        trainer += _pb_int(number, -1 if ids[which] is None else ids[which])
    for number, which in ((45, "unk"), (46, "bos"), (47, "eos"), (48, "pad")):  # *_piece
        if ids[which] is not None:
            trainer += _pb_bytes(number, tokens[ids[which]].encode("utf-8"))
    normalizer = (_pb_bytes(1, b"identity") + _pb_int(3, f.value("tokenizer.ggml.add_space_prefix", bool, True))
                  + _pb_int(4, f.value("tokenizer.ggml.remove_extra_whitespaces", bool, False)) + _pb_int(5, 1))
    return pieces + _pb_bytes(2, trainer) + _pb_bytes(3, normalizer)


# --- protobuf, the few wire types a SentencePiece model uses --------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int32 is written as its 64-bit two's complement, as protobuf does
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pb_int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(int(value))


def _pb_float(number: int, value: float) -> bytes:
    return _varint(number << 3 | 5) + struct.pack("<f", value)


def _pb_bytes(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _pb_fields(data: bytes) -> Iterator[tuple[int, object]]:
    """(field number, value) of a protobuf message: ints, bytes (length-delimited) or 4/8 raw bytes."""
    at = 0

    def varint() -> int:
        nonlocal at
        value = shift = 0
        while True:
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while at < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, varint()
        elif wire == 2:
            n = varint()
            yield number, data[at:at + n]
            at += n
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            yield number, data[at:at + width]
            at += width
        else:
            raise ValueError(f"protobuf wire type {wire}")


# --- tokenizer -> GGUF metadata -----------------------------------------------------------


def gguf_tokenizer_metadata(tokenizer: Tokenizer, vocab_size: int, settings: dict, source) -> dict[str, tuple]:
    """key -> (value, GGUFValueType) for the tokenizer.ggml.* keys of `tokenizer`, its vocabulary
    padded to vocab_size. settings: chat_template, add_bos_token, add_eos_token, unk_token and
    pad_token, tokenizer_config.json's where the folder has one. source names the tokenizer's
    folder in errors."""
    if tokenizer.vocab_size > vocab_size:
        raise CheckpointError(source, f"the tokenizer has {tokenizer.vocab_size} ids, more than the model's "
                                      f"vocab_size {vocab_size}")
    if tokenizer.kind == "sentencepiece":
        vocab = _sentencepiece_vocab(tokenizer, vocab_size)
    elif tokenizer.kind == "byte-level-bpe":
        vocab = _bpe_vocab(tokenizer, vocab_size, source)
    elif tokenizer.kind == "byte-level":
        vocab = _zoo_bytes_vocab(tokenizer, vocab_size, source)
    else:
        raise CheckpointError(source, f"a {tokenizer.kind} tokenizer cannot be written to GGUF")
    keys = {"tokenizer.ggml.model": (vocab.model, T.STRING), "tokenizer.ggml.tokens": (vocab.tokens, T.ARRAY),
            "tokenizer.ggml.token_type": (vocab.types, T.ARRAY), **vocab.keys}
    lookup = {t: i for i, t in enumerate(vocab.tokens)}
    ids = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id,
           "unk": lookup.get(settings.get("unk_token")), "pad": lookup.get(settings.get("pad_token"))}
    if ids["unk"] is None and UNKNOWN in vocab.types:
        ids["unk"] = vocab.types.index(UNKNOWN)
    for which, i in ids.items():
        if i is not None:
            keys[_SPECIAL_IDS[which][0]] = (i, T.UINT32)
    add_bos = settings.get("add_bos_token")
    if add_bos is None:  # as transformers decides: LlamaTokenizer adds it, a tokenizer.json says so in its template
        add_bos = vocab.model == SENTENCEPIECE or vocab.template_bos
    keys["tokenizer.ggml.add_bos_token"] = (bool(add_bos) and tokenizer.bos_id is not None, T.BOOL)
    keys["tokenizer.ggml.add_eos_token"] = (bool(settings.get("add_eos_token")), T.BOOL)
    if settings.get("chat_template"):
        keys["tokenizer.chat_template"] = (settings["chat_template"], T.STRING)
    return keys


def tokenizer_settings(tokenizer: Tokenizer, folder: Optional[Path]) -> dict:
    """What tokenizer_config.json says beyond the vocabulary (chat_template, add_bos_token,
    add_eos_token, unk_token, pad_token), and a folder's chat_template.jinja (where newer
    transformers saves the template) when the config has none."""
    config = json.loads(tokenizer.files.get("tokenizer_config.json", b"{}"))
    out = {}
    for key in ("add_bos_token", "add_eos_token"):
        if isinstance(config.get(key), bool):
            out[key] = config[key]
    for key in ("unk_token", "pad_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one (llama.cpp's key holds one template)
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is None and folder is not None and (folder / "chat_template.jinja").is_file():
        template = read_text(folder / "chat_template.jinja", "chat template")
    if isinstance(template, str):
        out["chat_template"] = template
    return out


@dataclass
class _Vocab:
    model: str  # tokenizer.ggml.model
    tokens: list[str]
    types: list[int]
    keys: dict[str, tuple]  # the model's own keys (scores, merges, pre-tokenizer ...)
    template_bos: bool = False  # a tokenizer.json whose post-processor puts BOS first


def _padded(tokens: dict[int, str], types: dict[int, int], vocab_size: int) -> tuple[list[str], list[int]]:
    """Lists over 0..vocab_size-1; ids without a token get "[PAD<id>]", UNUSED (llama.cpp's padding)."""
    return ([tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)],
            [types.get(i, UNUSED) for i in range(vocab_size)])


def _sentencepiece_vocab(tokenizer: Tokenizer, vocab_size: int) -> _Vocab:
    tokens, types, scores = {}, {}, {}
    trainer, normalizer = {}, {}
    for number, value in _pb_fields(tokenizer.files["tokenizer.model"]):  # read by sentencepiece already
        if number == 1:
            piece = dict(_pb_fields(value))
            i = len(tokens)
            tokens[i] = piece.get(1, b"").decode("utf-8")
            scores[i] = struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0
            types[i] = piece.get(3, NORMAL)
        elif number == 2:
            trainer = dict(_pb_fields(value))
        elif number == 3:
            normalizer = dict(_pb_fields(value))
    if trainer.get(3, 1) != 2:  # model_type: 1 unigram (protobuf's default), 2 BPE
        warnings.warn("tokenizer.model is a SentencePiece unigram model; llama.cpp's 'llama' tokenizer merges by "
                      "score as SentencePiece BPE does, so it may split some words differently", stacklevel=3)
    if normalizer.get(2):
        warnings.warn("tokenizer.model normalizes text (a precompiled character map); llama.cpp does not, so text "
                      "that normalization would change may tokenize differently", stacklevel=3)
    for text, i in tokenizer.special_tokens.items():  # added tokens beyond the model's pieces
        if i not in tokens:
            tokens[i], types[i], scores[i] = text, CONTROL, 0.0
    token_list, type_list = _padded(tokens, types, vocab_size)
    keys = {"tokenizer.ggml.scores": ([scores.get(i, 0.0) for i in range(vocab_size)], T.ARRAY),
            "tokenizer.ggml.add_space_prefix": (bool(normalizer.get(3, 1)), T.BOOL),  # protobuf defaults: true
            "tokenizer.ggml.remove_extra_whitespaces": (bool(normalizer.get(4, 1)), T.BOOL)}
    return _Vocab(SENTENCEPIECE, token_list, type_list, keys)


def _bpe_vocab(tokenizer: Tokenizer, vocab_size: int, source) -> _Vocab:
    files = tokenizer.files
    template_bos = False
    if "tokenizer.json" in files:  # the reader's choice too when both kinds are there
        data = json.loads(files["tokenizer.json"])
        pattern, prefix_space = _byte_level_pattern(Path(source) / "tokenizer.json", data.get("pre_tokenizer"))
        vocab = data["model"]["vocab"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
        added = {e["id"]: e for e in data.get("added_tokens") or []}
        post = data.get("post_processor") or {}
        steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
        template_bos = any(isinstance(s, dict) and s.get("type") == "TemplateProcessing" and s.get("single")
                           and "SpecialToken" in s["single"][0] for s in steps)
    else:
        vocab = json.loads(files["vocab.json"])
        lines = files["merges.txt"].decode("utf-8").splitlines()
        merges = [ln for n, ln in enumerate(lines) if ln and not (n == 0 and ln.startswith("#version"))]
        config = json.loads(files.get("tokenizer_config.json", b"{}"))
        pattern, prefix_space, added = GPT2_PATTERN, bool(config.get("add_prefix_space")), {}
    names = {regex: name for name, (_, regex) in PRE_TOKENIZERS.items()}
    if pattern not in names or prefix_space:
        raise CheckpointError(source, "the tokenizer's pre-tokenizer has no llama.cpp name (zoo writes "
                                      f"{', '.join(PRE_TOKENIZERS)}, without add_prefix_space)", key="pre_tokenizer")
    if not merges:
        raise CheckpointError(source, "a byte-level BPE without merges: llama.cpp needs at least one",
                              key="merges")
    tokens = {i: t for t, i in vocab.items()}
    types = {i: NORMAL for i in tokens}
    for i, entry in added.items():
        tokens[i], types[i] = entry["content"], CONTROL if entry.get("special") else USER_DEFINED
    for text, i in tokenizer.special_tokens.items():
        if tokens.get(i, text) == text:
            tokens[i], types[i] = text, CONTROL
    token_list, type_list = _padded(tokens, types, vocab_size)
    keys = {"tokenizer.ggml.pre": (names[pattern], T.STRING), "tokenizer.ggml.merges": (merges, T.ARRAY)}
    return _Vocab(BYTE_LEVEL_BPE, token_list, type_list, keys, template_bos)


def _zoo_bytes_vocab(tokenizer: Tokenizer, vocab_size: int, source) -> _Vocab:
    chars = bytes_to_unicode()
    tokens = {b: chars[b] for b in range(256)}
    types = {b: NORMAL for b in range(256)}
    for text, i in tokenizer.special_tokens.items():
        tokens[i], types[i] = text, CONTROL
    free = next((i for i in range(256, vocab_size) if i not in tokens), None)
    if free is None:
        raise CheckpointError(source, f"no free id below vocab_size {vocab_size} for the one merge llama.cpp needs",
                              key="vocab_size")
    unreachable = chars[0xC0]  # byte C0 starts no valid UTF-8 sequence: this merge never applies
    tokens[free], types[free] = unreachable * 2, NORMAL
    token_list, type_list = _padded(tokens, types, vocab_size)
    keys = {"tokenizer.ggml.pre": ("gpt-2", T.STRING),
            "tokenizer.ggml.merges": ([f"{unreachable} {unreachable}"], T.ARRAY)}
    return _Vocab(BYTE_LEVEL_BPE, token_list, type_list, keys)
