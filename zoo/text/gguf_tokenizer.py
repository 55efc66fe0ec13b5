"""Tokenizers in and out of GGUF metadata (tokenizer.ggml.*), as llama.cpp computes them.

In: the vocabulary a GGUF file carries becomes files that zoo's tokenizer reader (tokenizers.py)
loads, and transformers too, encoding as llama.cpp does:
  tokenizer.ggml.model "gpt2"   byte-level BPE: tokens, token types, merges and the pre-tokenizer
                                named by tokenizer.ggml.pre (PRE_TOKENIZERS) -> tokenizer.json
  tokenizer.ggml.model "llama"  SentencePiece: tokens, scores, token types -> tokenizer.model, a
                                SentencePiece BPE model (what llama.cpp's "llama" tokenizer computes:
                                merges by piece score, byte fallback, a space prefix as
                                tokenizer.ggml.add_space_prefix says)
plus tokenizer_config.json with the bos/eos/unk/pad tokens, add_bos_token/add_eos_token, the
chat template, and the tokens llama.cpp matches before the SentencePiece model sees the text
(user-defined ones, and those that take the whitespace after them: llama_cpp_rstrip). tokenizer.model
is protobuf; the few fields written are encoded here (the protobuf package is no dependency of
zoo), and sentencepiece itself reads the result back before it is used.

Out: a folder's tokenizer becomes the same keys, as llama.cpp's converter writes them: the
vocabulary padded with UNUSED "[PAD<id>]" tokens up to the model's vocab_size, special tokens
typed CONTROL, the other added tokens USER_DEFINED. Kinds written:
  byte-level BPE (tokenizer.json, vocab.json + merges.txt)  "gpt2", the pre-tokenizer named by
        its regex (PRE_TOKENIZERS); a normalizer (NFC: Qwen, GPT-NeoX) is lost, with a warning
  SentencePiece-style BPE tokenizer.json (Mistral, Gemma, Phi-3)  "llama" with scores made from
        the merges (_space_bpe_vocab says when that is exact; otherwise refused)
  SentencePiece tokenizer.model  "llama" with its own scores
  zoo's byte-level tokenizer  a byte-level BPE whose tokens 0-255 are the bytes; llama.cpp needs
        a merges list and gguf's writer refuses an empty one, so it gets one merge that valid
        UTF-8 never reaches (bytes C0 C0)
What llama.cpp would encode differently is refused with a CheckpointError saying why.
"""

from __future__ import annotations

import json
import re
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
from .tokenizers import (
    GPT2_DIGITS_PATTERN,
    GPT2_PATTERN,
    SPACE,
    Tokenizer,
    _byte_level_pattern,
    bytes_to_unicode,
)

# Token types (gguf.constants.TokenType; SentencePiece's piece types use the same numbers).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Llama 3's pre-tokenizer regex (cl100k's), as its tokenizer.json gives it.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's (Qwen2, 2.5, 3): Llama 3's with every digit alone.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split_then_byte_level(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}, _byte_level(False)]}


# llama.cpp's names for byte-level BPE pre-tokenizers (tokenizer.ggml.pre) that zoo computes:
# name -> (the tokenizer.json pre-tokenizer, the regex zoo's reader derives from it, whether
# llama.cpp takes a word that is a token whole (ignore_merges)). Each name's regexes in
# llama.cpp's llama-vocab.cpp split text as the regex here does: gpt-2 (also olmo, mpt: GPT-2's
# regex), smollm (also refact, starcoder: every digit alone, then GPT-2's), qwen2, and Llama 3's
# regex with (llama-bpe) and without (dbrx) ignore_merges.
PRE_TOKENIZERS = {
    "gpt-2": (_byte_level(True), GPT2_PATTERN, False),
    "llama-bpe": (_split_then_byte_level(LLAMA3_PATTERN), LLAMA3_PATTERN, True),
    "dbrx": (_split_then_byte_level(LLAMA3_PATTERN), LLAMA3_PATTERN, False),
    "smollm": ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                      _byte_level(True)]}, GPT2_DIGITS_PATTERN, False),
    "qwen2": (_split_then_byte_level(QWEN2_PATTERN), QWEN2_PATTERN, False),
}
# What general.name makes llama.cpp do to special tokens (llama-vocab.cpp sets these token
# attributes by the model's name, a GGUF having no key for them): a name holding "phi3" or
# "phi-3" makes every CONTROL, USER_DEFINED and UNKNOWN token and </s> take the whitespace after
# it (rstrip), except <unk>, <s> and <|endoftext|>; a model so named without those four tokens
# fails to load.
PHI3_NAMES = ("phi3", "phi-3")
PHI3_RSTRIP_TOO = ("</s>",)
PHI3_NO_RSTRIP = ("<unk>", "<s>", "<|endoftext|>")
# The special ids llama.cpp's tokenizer keys name, and tokenizer_config.json's names for them.
_SPECIAL_IDS = {"bos": (Keys.Tokenizer.BOS_ID, "bos_token"), "eos": (Keys.Tokenizer.EOS_ID, "eos_token"),
                "unk": (Keys.Tokenizer.UNK_ID, "unk_token"), "pad": (Keys.Tokenizer.PAD_ID, "pad_token")}


def llama_cpp_rstrip(tokens: list[str], types: list[int], name: str) -> Optional[set[int]]:
    """The ids of the tokens that llama.cpp lets take the whitespace after them (rstrip) in a file
    whose general.name is `name`; None where llama.cpp fails to load such a file. No token strips
    whitespace on its left in the architectures zoo writes."""
    if not any(n in name.lower() for n in PHI3_NAMES):
        return set()
    ids = {t: i for i, t in enumerate(tokens)}
    if any(t not in ids for t in PHI3_RSTRIP_TOO + PHI3_NO_RSTRIP):
        return None
    out = {i for i, ty in enumerate(types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)}
    out |= {ids[t] for t in PHI3_RSTRIP_TOO}
    return out - {ids[t] for t in PHI3_NO_RSTRIP}


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
    name = f.value("general.name", str, "")
    rstrip = llama_cpp_rstrip(tokens, types, name)
    if rstrip is None:
        raise CheckpointError(f.path, f"llama.cpp does not load this file: its general.name {name!r} makes it set "
                                      f"the whitespace rules of the tokens {', '.join(PHI3_RSTRIP_TOO + PHI3_NO_RSTRIP)}"
                                      ", which are not all in the vocabulary", key="general.name")
    config = {"tokenizer_class": "PreTrainedTokenizerFast" if kind == BYTE_LEVEL_BPE else "LlamaTokenizer"}
    if kind == BYTE_LEVEL_BPE:
        files = {"tokenizer.json": _tokenizer_json(f, tokens, types, special, rstrip)}
        default_bos = f.value("tokenizer.ggml.pre", str, "") == "llama-bpe"  # llama.cpp's defaults
    else:
        files = {"tokenizer.model": _sentencepiece_model(f, tokens, types, special)}
        default_bos = True
        # Matched in the text before SentencePiece sees it, as llama.cpp does (which also puts the
        # space prefix after them): user-defined tokens and those that take the whitespace after them.
        config["added_tokens_decoder"] = {
            str(i): {"content": t, "lstrip": False, "rstrip": i in rstrip, "normalized": False,
                     "single_word": False, "special": types[i] != USER_DEFINED}
            for i, t in enumerate(tokens) if types[i] == USER_DEFINED or i in rstrip}
    for which, (_, key) in _SPECIAL_IDS.items():
        if special[which] is not None:
            config[key] = tokens[special[which]]
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


def _tokenizer_json(f, tokens: list[str], types: list[int], special: dict, rstrip: set[int]) -> bytes:
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
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": i in rstrip,
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
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": PRE_TOKENIZERS[pre_name][2],
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
    # llama.cpp's converter writes user-defined tokens with spaces where the vocabulary has "▁"
    # (llama.cpp matches them in the raw text); a SentencePiece piece holds no space.
    pieces = b"".join(_pb_bytes(1, _pb_bytes(1, (t.replace(" ", SPACE) if ty == USER_DEFINED else t).encode("utf-8"))
                                + _pb_float(2, s) + (_pb_int(3, ty) if ty != NORMAL else b""))
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


def gguf_tokenizer_metadata(tokenizer: Tokenizer, vocab_size: int, settings: dict, source,
                            name: str = "") -> dict[str, tuple]:
    """key -> (value, GGUFValueType) for the tokenizer.ggml.* keys of `tokenizer`, its vocabulary
    padded to vocab_size. settings: chat_template, add_bos_token, add_eos_token, unk_token and
    pad_token, tokenizer_config.json's where the folder has one. source names the tokenizer's
    folder in errors; name is the file's general.name (llama.cpp sets token attributes by it).
    A tokenizer llama.cpp would encode differently is refused (CheckpointError saying why)."""
    if tokenizer.vocab_size > vocab_size:
        raise CheckpointError(source, f"the tokenizer has {tokenizer.vocab_size} ids, more than the model's "
                                      f"vocab_size {vocab_size}")
    if tokenizer.kind == "sentencepiece":
        vocab = _sentencepiece_vocab(tokenizer, vocab_size)
    elif tokenizer.kind == "byte-level-bpe":
        vocab = _bpe_vocab(tokenizer, vocab_size, source)
    elif tokenizer.kind == "sentencepiece-bpe":
        vocab = _space_bpe_vocab(tokenizer, vocab_size, source)
    elif tokenizer.kind == "byte-level":
        vocab = _zoo_bytes_vocab(tokenizer, vocab_size, source)
    else:
        raise CheckpointError(source, f"a {tokenizer.kind} tokenizer cannot be written to GGUF")
    _check_whitespace_rules(tokenizer, vocab, name, source)
    if getattr(tokenizer._backend, "nfc", False):  # exported all the same, as llama.cpp's converter does (Qwen, NeoX)
        warnings.warn(f"{source}: the tokenizer NFC-normalizes text and llama.cpp normalizes nothing: text not in "
                      "NFC (decomposed accents, conjoining Hangul jamo) encodes differently in llama.cpp",
                      RuntimeWarning, stacklevel=3)
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


def _check_whitespace_rules(tokenizer: Tokenizer, vocab: "_Vocab", name: str, source) -> None:
    """Refuses a tokenizer whose added tokens take the whitespace beside them (lstrip/rstrip)
    other than as llama.cpp does for a file of this general.name (a GGUF has no key for it)."""
    lstrip = sorted(t for t, flags in tokenizer.special_flags.items() if flags.lstrip)
    if lstrip:
        raise CheckpointError(source, f"the token {lstrip[0]!r} takes the whitespace before it (lstrip), which "
                                      "llama.cpp does for no model zoo writes: it would encode text differently",
                              key="added_tokens")
    wanted = {tokenizer.special_tokens[t] for t, flags in tokenizer.special_flags.items() if flags.rstrip}
    llama = llama_cpp_rstrip(vocab.tokens, vocab.types, name)
    if llama is None:
        raise CheckpointError(source, f"general.name {name!r} makes llama.cpp set the whitespace rules of the tokens "
                                      f"{', '.join(PHI3_RSTRIP_TOO + PHI3_NO_RSTRIP)}, which are not all in this "
                                      "vocabulary (llama.cpp would not load the file): choose another name",
                              key="general.name")
    if wanted == llama:
        return
    rule = ("llama.cpp lets a token take the whitespace after it (rstrip) only in a model whose general.name holds "
            "'phi3' or 'phi-3' (the file's name), and then every special token but <unk>, <s>, <|endoftext|>")
    i = min(wanted ^ llama)
    does = "takes" if i in wanted else "does not take"
    raise CheckpointError(source, f"the token {vocab.tokens[i]!r} {does} the whitespace after it here, but not in "
                                  f"llama.cpp with general.name {name!r}: {rule}", key="added_tokens")


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
    ignore_merges = False
    if "tokenizer.json" in files:  # the reader's choice too when both kinds are there
        data = json.loads(files["tokenizer.json"])
        pattern, prefix_space = _byte_level_pattern(Path(source) / "tokenizer.json", data.get("pre_tokenizer"))
        vocab = data["model"]["vocab"]
        ignore_merges = bool(data["model"].get("ignore_merges", False))
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
    names = [name for name, (_, regex, _) in PRE_TOKENIZERS.items() if regex == pattern]
    if not names or prefix_space:
        raise CheckpointError(source, "the tokenizer's pre-tokenizer has no llama.cpp name (zoo writes "
                                      f"{', '.join(PRE_TOKENIZERS)}, without add_prefix_space)", key="pre_tokenizer")
    if not merges:
        raise CheckpointError(source, "a byte-level BPE without merges: llama.cpp needs at least one",
                              key="merges")
    # The name whose ignore_merges (a word that is a token taken whole) is the file's; where
    # llama.cpp has none, the file's setting must change no word's ids.
    name = next((n for n in names if PRE_TOKENIZERS[n][2] == ignore_merges), None)
    if name is None:
        name = names[0]
        added_texts = {e["content"] for e in added.values()} | set(tokenizer.special_tokens)
        word = _word_merges_split([t for t in vocab if t not in added_texts], merges)
        if word is not None:
            raise CheckpointError(source, f"model.ignore_merges is {str(ignore_merges).lower()}, llama.cpp's "
                                          f"{name!r} pre-tokenizer has it {str(not ignore_merges).lower()}, and that "
                                          f"changes how the token {word!r} encodes", key="model.ignore_merges")
    tokens = {i: t for t, i in vocab.items()}
    types = {i: NORMAL for i in tokens}
    for i, entry in added.items():
        tokens[i], types[i] = entry["content"], CONTROL if entry.get("special") else USER_DEFINED
    for text, i in tokenizer.special_tokens.items():  # named by the side files only
        if i not in added and tokens.get(i, text) == text:
            tokens[i], types[i] = text, CONTROL if tokenizer.special_flags[text].special else USER_DEFINED
    token_list, type_list = _padded(tokens, types, vocab_size)
    keys = {"tokenizer.ggml.pre": (name, T.STRING), "tokenizer.ggml.merges": (merges, T.ARRAY)}
    return _Vocab(BYTE_LEVEL_BPE, token_list, type_list, keys, template_bos)


def _space_bpe_vocab(tokenizer: Tokenizer, vocab_size: int, source) -> _Vocab:
    """A SentencePiece-style BPE tokenizer.json (byte fallback, "▁" for spaces: Mistral, Gemma,
    Phi-3) as llama.cpp's SentencePiece ("llama") tokenizer, which merges, over and over, the two
    neighbouring pieces that make the vocabulary token of the highest score, where the
    tokenizers library applies the merges list in order. That is the same where the list is
    what a SentencePiece model converted to tokenizer.json holds (the published files are):
    every split of a token into two pieces that can be formed is a merge, and a token's merges
    sit together in the list; the scores written are minus the rank of a token's first merge.
    Otherwise refused, as are the settings llama.cpp's space prefix cannot follow (it puts "▁"
    before the text and after every added token, add_space_prefix, or nowhere)."""
    where = Path(source) / "tokenizer.json"
    data = json.loads(tokenizer.files["tokenizer.json"])
    model = data["model"]
    backend = tokenizer._backend
    prepend, split = backend.prepend, backend.settings["split"]
    vocab: dict[str, int] = model["vocab"]
    if prepend not in ("legacy", "never"):
        raise CheckpointError(where, f"a Metaspace pre-tokenizer with prepend_scheme {prepend!r} puts ▁ before "
                                     f"{'the text only' if prepend == 'first' else 'text that does not start with one'}"
                                     "; llama.cpp puts it before the text and after every added token, or nowhere",
                              key="pre_tokenizer")
    if split and any(SPACE in t[1:] for t in vocab):
        raise CheckpointError(where, "a Metaspace pre-tokenizer with split true keeps tokens from crossing a ▁, "
                                     "which llama.cpp does not, and the vocabulary has such tokens", key="pre_tokenizer")
    unk = model.get("unk_token")
    if unk not in vocab:
        raise CheckpointError(where, "llama.cpp's SentencePiece vocabulary (and zoo's reading of it) needs an unknown "
                                     f"token; model.unk_token is {unk!r}", key="model.unk_token")
    added = {e["id"]: e for e in data.get("added_tokens") or []}
    tokens = {i: t for t, i in vocab.items()}
    types = {i: BYTE if _BYTE_TOKEN.fullmatch(t) else NORMAL for t, i in vocab.items()}
    for i, entry in added.items():
        text = entry["content"]
        # llama.cpp matches added tokens in the raw text: one the library matches where the
        # normalizer made spaces "▁" is written with spaces (as llama.cpp's converter writes
        # user-defined tokens), unless a "▁" put before the text could be part of it.
        spaces = bool(entry.get("normalized")) and backend.replace_in_normalizer and SPACE in text
        special = entry.get("special") is not False
        if spaces and (special or (prepend == "legacy" and text.startswith(SPACE))):
            raise CheckpointError(where, f"the added token {text!r} is matched in the normalized text (its spaces "
                                         f"made ▁{', one put before the text' if not special else ''}), which "
                                         "llama.cpp, matching added tokens in the raw text, cannot follow",
                                  key="added_tokens")
        tokens[i] = text.replace(SPACE, " ") if spaces else text
        types[i] = CONTROL if special else USER_DEFINED
    for text, i in tokenizer.special_tokens.items():  # named by the side files only
        if i not in added and i not in tokens:
            tokens[i], types[i] = text, CONTROL if tokenizer.special_flags[text].special else USER_DEFINED
    tokens[vocab[unk]], types[vocab[unk]] = unk, UNKNOWN  # (an added token too, in the published files)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    scores = _merge_scores(tokens, merges, where)
    token_list, type_list = _padded(tokens, types, vocab_size)
    post = data.get("post_processor") or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    template_bos = any(isinstance(s, dict) and s.get("type") == "TemplateProcessing" and s.get("single")
                       and "SpecialToken" in s["single"][0] for s in steps)
    keys = {"tokenizer.ggml.pre": ("default", T.STRING),
            "tokenizer.ggml.scores": ([scores.get(i, 0.0) for i in range(vocab_size)], T.ARRAY),
            "tokenizer.ggml.add_space_prefix": (prepend == "legacy", T.BOOL),
            "tokenizer.ggml.remove_extra_whitespaces": (False, T.BOOL)}
    return _Vocab(SENTENCEPIECE, token_list, type_list, keys, template_bos)


_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def _merge_scores(tokens: dict[int, str], merges: list[tuple[str, str]], where: Path) -> dict[int, float]:
    """id -> score such that merging by score (llama.cpp's SentencePiece tokenizer) is applying
    `merges` in order (the tokenizers library's BPE), or CheckpointError naming the token where
    it is not. llama.cpp merges two neighbouring pieces whenever they make a token of any type;
    the library only by a merge of the list, and it never merges a character that is no token
    of its own (that one becomes byte tokens)."""
    rank = {pair: r for r, pair in enumerate(merges)}
    ids = {t: i for i, t in tokens.items()}
    first: dict[str, int] = {}  # token -> the rank of its first merge
    previous = None
    for r, (a, b) in enumerate(merges):
        made = a + b
        if made in first and made != previous:
            raise CheckpointError(where, f"the merges making {made!r} are not next to each other in model.merges (merge "
                                         f"{r + 1} is one): merging by a score per token, llama.cpp cannot order them",
                                  key="model.merges")
        first.setdefault(made, r)
        previous = made
    formed: set[str] = set()  # the tokens llama.cpp's merging can reach
    for token in sorted(ids, key=len):
        if len(token) < 2 or " " in token:  # llama.cpp merges text with its spaces made "▁"
            continue
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        splits = [(a, b) for a, b in splits if (len(a) == 1 or a in formed) and (len(b) == 1 or b in formed)]
        if not splits:
            continue
        formed.add(token)
        for a, b in splits:
            if (a, b) not in rank:
                raise CheckpointError(where, f"llama.cpp would merge {a!r} and {b!r} into the token {token!r}, but "
                                             "model.merges has no such merge (the tokenizers library never makes it "
                                             "so): not a SentencePiece vocabulary", key="model.merges")
            for piece in (a, b):
                if len(piece) == 1 and piece not in ids:
                    raise CheckpointError(where, f"{piece!r} is no token, so the tokenizers library writes it as byte "
                                                 f"tokens, but llama.cpp merges it into {token!r}", key="model.vocab")
    return {ids[t]: -float(r) for t, r in first.items() if t in ids}


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


def _word_merges_split(vocab: list[str], merges: list[str]) -> Optional[str]:
    """A token that the merges, applied to its characters, do not build whole (so whether a word
    that is that token is taken whole, ignore_merges, changes its ids), or None."""
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    for token in vocab:
        parts = list(token)
        while len(parts) > 1:
            pairs = [(ranks.get((a, b)), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best = min((p for p in pairs if p[0] is not None), default=None)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) > 1:
            return token
    return None
