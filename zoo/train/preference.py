"""Preference data: pairs of a prompt, a chosen answer and a rejected one, in TRL's formats,
tokenized once into a cache and packed into rows that compute each prompt once.

A JSONL file of preference records has one of TRL's shapes, its first record deciding:

  {"prompt": str, "chosen": str, "rejected": str}               text
  {"prompt": [messages], "chosen": [messages], "rejected": [...]} conversational, rendered with
                                                                  the checkpoint's chat template
  {"chosen": ..., "rejected": ...}                              implicit prompt: the longest
                                                                  common prefix of the two (text or
                                                                  messages) is the prompt

Tokenized as TRL's DPOTrainer does: prompt, prompt + chosen and prompt + rejected are encoded
whole (text: BOS first where the tokenizer has one distinct from EOS, EOS after the answer;
chats: the template writes everything, the prompt with the generation prompt), and the answer
starts where the prompt's ids and the whole's part (the common prefix of all three), so the
prompt's ids are the same before both answers.

A pair becomes one packed example: the prompt but its last token, then the chosen answer's
inputs (the prompt's last token and the answer but its last token), then the rejected answer's,
positions counting on from the prompt in both answers; the rejected answer does not see the
chosen one (a hidden key span, zoo.Model's `hidden`). The prompt's forward runs once for both
answers, and the targets are exactly those of the two sequences prompt + chosen and prompt +
rejected: each answer token predicted from the prompt and the answer before it. Examples go
into rows of seq_len side by side, as PackedWindows packs SFT examples.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..core.atomic import atomic_open, write_json
from ..text.chat_template import ChatTemplateError
from .data import (
    IGNORE,
    SHAREGPT_ROLES,
    DataError,
    _cache_key,
    _map,
    _read_meta,
    default_cache_dir,
    list_text_files,
    token_dtype,
)
from .records import is_table, records, uniform_records

PAIRS_FORMAT = 1  # bump when the pair cache's layout or the tokenization of a pair changes

# The record shapes, by their keys (every key required).
PAIR_SHAPES = {"explicit prompt": {"prompt", "chosen", "rejected"}, "implicit prompt": {"chosen", "rejected"}}


# --- records -----------------------------------------------------------------------------


def _record_kind(record, where: str) -> tuple[str, str]:
    """(shape, "text" or "conversational") of a record; DataError naming the line otherwise."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    keys = set(record)
    shape = next((name for name, required in PAIR_SHAPES.items() if keys == required), None)
    if shape is None:
        known = "; ".join("{" + ", ".join(sorted(k)) + "}" for k in PAIR_SHAPES.values())
        raise DataError(f"{where}: a record with keys {sorted(keys)} is no preference pair ({known}; "
                        "an SFT file trains with --method sft)")
    kinds = {key: "text" if isinstance(record[key], str) else "conversational" if isinstance(record[key], list)
             else None for key in sorted(keys)}
    for key, kind in kinds.items():
        if kind is None:
            raise DataError(f"{where}: \"{key}\" must be a string or a list of messages, got "
                            f"{type(record[key]).__name__}")
    if len(set(kinds.values())) > 1:
        shown = ", ".join(f"\"{k}\" {v}" for k, v in kinds.items())
        raise DataError(f"{where}: the fields mix text and messages ({shown}); a record is all text or all "
                        "messages")
    return shape, next(iter(kinds.values()))


def _check_messages(messages: list, key: str, where: str) -> None:
    if not messages and key != "prompt":
        raise DataError(f"{where}: \"{key}\" is an empty list of messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: {key}[{i}] must be an object with string \"role\" and \"content\"")


def split_implicit_prompt(chosen, rejected):
    """(prompt, chosen, rejected) from two whole texts or conversations: the prompt is their
    longest common prefix, as TRL's extract_prompt finds it (a space before the first difference
    goes to the answers; two that never differ leave their last element to the answers)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx and chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _PairEncoder:
    """A record's token ids: (prompt, chosen, rejected)."""

    def __init__(self, tokenizer, chat_template):
        if tokenizer is None:
            raise DataError("preference data is text: it needs a tokenizer, and the checkpoint has none (give "
                            "--tokenizer)")
        if tokenizer.eos_id is None:
            raise DataError("the tokenizer has no EOS token to end answers with")
        self.tokenizer, self.chat_template = tokenizer, chat_template
        bos, eos = tokenizer.bos_id, tokenizer.eos_id
        self.before = [bos] if bos is not None and bos != eos else []
        self.eos_text = tokenizer.eos_token

    def text(self, prompt: str, chosen: str, rejected: str) -> tuple[list, list, list]:
        enc = self.tokenizer.encode

        def whole(answer: str) -> list[int]:
            # TRL appends the EOS text to an answer that does not end with it; here its id
            ends = self.eos_text is not None and answer.endswith(self.eos_text)
            return self.before + enc(prompt + answer) + ([] if ends else [self.tokenizer.eos_id])

        return self._split(self.before + enc(prompt), whole(chosen), whole(rejected))

    def chat(self, prompt: list, chosen: list, rejected: list, where: str) -> tuple[list, list, list]:
        if self.chat_template is None:
            raise DataError(f"{where}: messages need a chat template, and none was given")
        enc = self.tokenizer.encode
        try:
            return self._split(enc(self.chat_template.render(prompt, add_generation_prompt=True)),
                               enc(self.chat_template.render(prompt + chosen)),
                               enc(self.chat_template.render(prompt + rejected)))
        except ChatTemplateError as e:
            raise DataError(f"{where}: {e}") from None

    @staticmethod
    def _split(prompt: list[int], with_chosen: list[int], with_rejected: list[int]) -> tuple[list, list, list]:
        n = min(common_prefix_length(prompt, with_chosen), common_prefix_length(prompt, with_rejected))
        return prompt[:n], with_chosen[n:], with_rejected[n:]


def _sharegpt_turns(messages):
    """A list of ShareGPT turns ({"from", "value"}) as messages ({"role", "content"}); any other list
    as it is (checked by _check_messages)."""
    if (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and set(m) == {"from", "value"} for m in messages)):
        return [{"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"]} for m in messages]
    return messages


def _pairs_in(path: Path, encoder: _PairEncoder, columns: Optional[dict] = None):
    """Yields (prompt, chosen, rejected) token ids per record of a JSONL, Parquet or Arrow file of pairs."""
    if path.suffix != ".jsonl" and not is_table(path):
        raise DataError(f"data file {path}: preference data is JSONL of {{\"prompt\", \"chosen\", \"rejected\"}} "
                        "or {\"chosen\", \"rejected\"} records, one per line, or Parquet or Arrow with those columns")

    def noun(kind: tuple[str, str], plural: bool) -> str:
        shape, form = kind
        return f"{form} records with an {shape}" if plural else f"a {form} record with an {shape}"

    items = ((where, {k: _sharegpt_turns(v) for k, v in record.items()} if isinstance(record, dict) else record)
             for where, record in records(path, {name: (keys, set()) for name, keys in PAIR_SHAPES.items()}, columns))
    for where, record, (shape, form) in uniform_records(path, items, _record_kind, noun):
        if shape == "implicit prompt":
            prompt, chosen, rejected = split_implicit_prompt(record["chosen"], record["rejected"])
        else:
            prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
        if form == "text":
            ids = encoder.text(prompt, chosen, rejected)
        else:
            for key, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
                _check_messages(value, key, where)
            ids = encoder.chat(prompt, chosen, rejected, where)
        for name, answer in (("chosen", ids[1]), ("rejected", ids[2])):
            if not answer:
                raise DataError(f"{where}: the {name} answer tokenizes to nothing after the prompt")
        yield form, ids


# --- tokenize once, cache ------------------------------------------------------------------


@dataclass
class PairFile:
    """The tokenized pairs: pair i's prompt, chosen and rejected ids are tokens[starts[3i]:
    starts[3i+1]], [starts[3i+1]:starts[3i+2]] and [starts[3i+2]:starts[3i+3]]."""

    tokens: np.ndarray  # read-only memory map, uint16 or uint32
    starts: np.ndarray  # int64, 3 per pair and the end
    path: Path
    key: str  # the cache key: the data, the tokenizer and the chat template
    files: list[Path]
    formats: list[str]  # per file: "text" or "conversational"
    reused: bool

    @property
    def n_pairs(self) -> int:
        return (len(self.starts) - 1) // 3

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s = self.starts[3 * i:3 * i + 4]
        return self.tokens[s[0]:s[1]], self.tokens[s[1]:s[2]], self.tokens[s[2]:s[3]]

    @property
    def streams(self) -> list[np.ndarray]:
        return [self.tokens]

    def lengths(self) -> np.ndarray:
        """(n_pairs, 3): the tokens of each pair's prompt, chosen and rejected answer."""
        return np.diff(np.asarray(self.starts, np.int64)).reshape(-1, 3)


class PairsMeta(BaseModel):
    """The JSON file beside a cached pair file."""

    model_config = ConfigDict(strict=True, extra="allow")
    key: str
    format: int
    n_tokens: int
    n_pairs: int
    dtype: str
    files: list[str]
    formats: list[str]


def tokenize_pairs(paths: list[str | os.PathLike], tokenizer, cache_dir: str | os.PathLike | None = None,
                   chat_template=None, vocab_size: Optional[int] = None, columns: Optional[dict] = None) -> PairFile:
    """The preference files tokenized into a cached pair file (or the cache reused), memory-mapped.
    columns: the records' column mapping (--data-columns)."""
    files = list_text_files(paths)
    if vocab_size is None:
        vocab_size = tokenizer.vocab_size
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(f"zoo-pairs-v{PAIRS_FORMAT}\n{_cache_key(files, tokenizer, chat_template, vocab_size, columns)}"
                         .encode()).hexdigest()
    tok_path = cache / f"pairs-{key[:24]}.bin"
    meta_path, starts_path = tok_path.with_suffix(".json"), tok_path.with_suffix(".starts")
    dtype = token_dtype(vocab_size)
    meta = _read_meta(meta_path, PairsMeta)
    if (meta is not None and meta.key == key and meta.format == PAIRS_FORMAT and tok_path.is_file()
            and tok_path.stat().st_size == meta.n_tokens * dtype.itemsize and starts_path.is_file()
            and starts_path.stat().st_size == 8 * (3 * meta.n_pairs + 1)):
        return PairFile(_map(tok_path, dtype), _map(starts_path, np.dtype(np.int64)), tok_path, key, files,
                        meta.formats, reused=True)
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"token cache folder {cache}: cannot create it ({e.strerror or e})") from None
    encoder = None
    limit = np.iinfo(dtype).max
    n, starts, formats = 0, [0], []
    try:
        with atomic_open(tok_path) as out:
            for f in files:
                encoder = encoder or _PairEncoder(tokenizer, chat_template)
                pairs = _pairs_in(f, encoder, columns)
                form, first = next(pairs)  # the file's errors before anything of it is written
                formats.append(form)
                for _, ids in itertools.chain([(form, first)], pairs):
                    for part in ids:
                        arr = np.asarray(part, dtype=np.int64)
                        if arr.size and (arr.min() < 0 or arr.max() > limit):
                            raise DataError(f"data file {f}: tokenizer produced id {arr.max()} outside {dtype.name}")
                        out.write(arr.astype(dtype).tobytes())
                        n += arr.size
                        starts.append(n)
            with atomic_open(starts_path) as s:
                s.write(np.asarray(starts, np.int64).tobytes())
    except OSError as e:
        raise DataError(f"token cache file {tok_path}: cannot write it ({e.strerror or e})") from None
    try:  # after the tokens: a meta file always describes complete files
        write_json(meta_path, {"key": key, "format": PAIRS_FORMAT, "n_tokens": n, "n_pairs": (len(starts) - 1) // 3,
                               "dtype": dtype.name, "files": [str(f.resolve()) for f in files], "formats": formats})
    except OSError as e:
        raise DataError(f"token cache file {meta_path}: cannot write it ({e.strerror or e})") from None
    return PairFile(_map(tok_path, dtype), _map(starts_path, np.dtype(np.int64)), tok_path, key, files, formats,
                    reused=False)


# --- packing ------------------------------------------------------------------------------


class PairBatch(NamedTuple):
    """Packed pairs. x, y, positions (B, T), hidden (B, T, 2) as zoo.Model takes them; answer
    (B, T): 2k on the rows whose targets are pair k's chosen answer, 2k + 1 on its rejected
    answer's, -1 elsewhere; prompt (B, T): True on the rows whose targets are a prompt's (they
    carry a target only where the batch was packed with prompt_targets); lengths (n, 2): the
    answer tokens of each pair, chosen and rejected."""

    x: np.ndarray
    y: np.ndarray
    positions: np.ndarray
    hidden: np.ndarray
    answer: np.ndarray
    prompt: np.ndarray
    lengths: np.ndarray

    @property
    def n_pairs(self) -> int:
        return len(self.lengths)


def answer_cap(prompt: int, chosen: int, rejected: int, seq_len: int) -> int:
    """The most tokens of each answer a row of seq_len keeps with the prompt (all of both where
    they fit; 0: not even one token each, the pair cannot be trained on)."""
    shared = max(prompt - 1, 0)
    if shared + chosen + rejected <= seq_len:
        return max(chosen, rejected)
    cap = (seq_len - shared) // 2
    # the shorter answer may be whole, leaving the longer one more room
    short = min(chosen, rejected)
    if short < cap:
        cap = seq_len - shared - short
    return max(cap, 0)


def pack_pairs(pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]], seq_len: int, share_prompt: bool = True,
               prompt_targets: bool = False) -> PairBatch:
    """Rows of seq_len holding the pairs (prompt, chosen, rejected), each cut to fit a row
    (answer_cap; the caller has left out those that cannot). share_prompt=False lays each pair out
    as the two whole sequences TRL runs, prompt + chosen and prompt + rejected, one after the
    other (the same targets, the prompt computed twice: for measurements and tests)."""
    T = seq_len
    # examples: lists of (segment, whether it hides the chosen answer before it), a segment being
    # (tokens, targets, positions, answer ids, prompt flags)
    examples = []
    lengths = np.zeros((len(pairs), 2), np.int64)
    for k, (prompt, chosen, rejected) in enumerate(pairs):
        prompt, chosen, rejected = (np.asarray(a, np.int64) for a in (prompt, chosen, rejected))
        cap = answer_cap(len(prompt), len(chosen), len(rejected), T)
        if cap < 1:
            raise ValueError(f"pair {k}: a prompt of {len(prompt)} tokens leaves no room for its answers in a row of "
                             f"{T}")
        chosen, rejected = chosen[:cap], rejected[:cap]
        P = len(prompt)
        s0 = max(P - 1, 0)  # the answers' inputs start at the prompt's last token
        segments = []
        for which, answer in ((0, chosen), (1, rejected)):
            whole = np.concatenate([prompt, answer])
            n_in = len(whole) - 1 - s0  # inputs s0..len-2, targets s0+1..len-1 (all answer tokens)
            lengths[k, which] = n_in
            start = 0 if not share_prompt else s0
            tokens = whole[start:-1]
            targets = whole[start + 1:].copy()
            role = np.full(len(tokens), 2 * k + which, np.int64)
            is_prompt = np.zeros(len(tokens), bool)
            if start < s0:  # the prompt's own predictions, in the unshared layout
                role[:s0] = -1
                is_prompt[:s0] = which == 0
                if not (prompt_targets and which == 0):
                    targets[:s0] = IGNORE
            segments.append((tokens, targets, np.arange(start, start + len(tokens)), role, is_prompt))
        if share_prompt:
            shared = (prompt[:s0], prompt[1:s0 + 1].copy() if prompt_targets else np.full(s0, IGNORE),
                      np.arange(s0), np.full(s0, -1), np.ones(s0, bool))
            examples.append([(shared, False), (segments[0], False), (segments[1], True)])
        else:
            examples.append([(segments[0], False)])
            examples.append([(segments[1], False)])
    rows: list[list] = []
    room = 0
    for example in examples:
        size = sum(len(seg[0]) for seg, _ in example)
        if size > room:
            rows.append([])
            room = T
        rows[-1].append(example)
        room -= size
    B = len(rows)
    x = np.zeros((B, T), np.int32)
    y = np.full((B, T), IGNORE, np.int32)
    positions = np.zeros((B, T), np.int32)
    hidden = np.zeros((B, T, 2), np.int32)
    answer = np.full((B, T), -1, np.int32)
    is_prompt = np.zeros((B, T), bool)
    for r, row in enumerate(rows):
        at = 0
        for example in row:
            chosen_span = (at, at)  # none where the chosen answer is empty
            for (tokens, targets, pos, role, flags), hides_chosen in example:
                n = len(tokens)
                x[r, at:at + n], y[r, at:at + n], positions[r, at:at + n] = tokens, targets, pos
                answer[r, at:at + n], is_prompt[r, at:at + n] = role, flags
                if hides_chosen:
                    hidden[r, at:at + n] = chosen_span
                if n and role[-1] >= 0 and role[-1] % 2 == 0:
                    chosen_span = (at, at + n)
                at += n
        positions[r, at:] = np.arange(T - at)  # padding: a segment of its own, no loss
    return PairBatch(x, y, positions, hidden, answer, is_prompt, lengths)


class PairSplits:
    """Training and validation pairs of a PairFile, and their batches: batch_size pairs a
    micro-batch, drawn from numpy.random.default_rng((seed, step, micro)) (the batch of any step is
    known without replaying the ones before); the last val_fraction of the pairs is the
    validation split. Pairs longer than a row are cut to it (answer_cap: both answers to the
    same length at most), or left out where not one token of each answer fits."""

    def __init__(self, pair_file: PairFile, batch_size: int, seq_len: int, val_fraction: float, eval_batches: int,
                 seed: int, source: str = "the data"):
        self.pair_file = pair_file
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        lengths = pair_file.lengths()
        caps = np.array([answer_cap(p, c, r, seq_len) for p, c, r in lengths.tolist()], np.int64)
        kept = np.flatnonzero(caps >= 1)
        self.dropped = int(len(lengths) - len(kept))
        self.truncated = int(np.count_nonzero(caps[kept] < np.maximum(lengths[kept, 1], lengths[kept, 2])))
        n = len(kept)
        n_val = int(round(n * val_fraction)) if val_fraction > 0 else 0
        if val_fraction > 0 and n > 1:
            n_val = max(n_val, 1)
        n_val = min(n_val, max(n - 1, 0))
        self.train_pairs, self.val_pairs = kept[:n - n_val], kept[n - n_val:]
        if not len(self.train_pairs):
            raise DataError(f"{source}: no preference pair fits a row of --seq-len {seq_len}"
                            + (f" ({self.dropped} left out: the prompt alone fills it)" if self.dropped else ""))
        picks = min(eval_batches * batch_size, len(self.val_pairs))
        self._val_picks = (self.val_pairs[np.linspace(0, len(self.val_pairs) - 1, picks).round().astype(np.int64)]
                           if picks else np.zeros(0, np.int64))
        # What a step's budget counts (TrainConfig.total_steps): a row of seq_len per pair.
        self.n_train, self.n_val = len(self.train_pairs) * seq_len, len(self.val_pairs) * seq_len

    def describe(self) -> str:
        cut = f", {self.truncated:,} longer than a row cut to it" if self.truncated else ""
        if self.dropped:
            cut += f", {self.dropped:,} left out (the prompt alone fills a row)"
        return f"{len(self.train_pairs):,} train pairs, {len(self.val_pairs):,} val{cut}"

    def train_indices(self, step: int, micro: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, step, micro))
        return self.train_pairs[rng.integers(0, len(self.train_pairs), self.batch_size)]

    def val_indices(self):
        for i in range(0, len(self._val_picks), self.batch_size):
            yield self._val_picks[i:i + self.batch_size]

    def pairs(self, indices) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return [self.pair_file.pair(int(i)) for i in indices]
