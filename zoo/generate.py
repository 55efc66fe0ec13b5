"""Sampling with a KV cache: the prompt goes through the model once, then one token per call.

Temperature 0 is greedy (argmax, ties to the lowest id, as torch.argmax); otherwise logits
are divided by the temperature, cut to the top-k and then to the smallest set whose
probability reaches top-p, and sampled with a generator seeded by `seed`.
"""

from __future__ import annotations

import math
import sys
from typing import Callable, Iterable, Optional

import numpy as np


class NonFiniteLogits(ValueError):
    """The model's logits hold NaN or Inf: its weights are damaged, nothing can be sampled."""


def check_settings(max_new_tokens: int, temperature: float, top_k: Optional[int], top_p: Optional[float],
                   seed: int, as_flags: bool = False) -> None:
    """ValueError naming the first setting out of its range (as --top-k if as_flags, else top_k),
    before any work starts: a NaN temperature would otherwise surface as numpy's
    "Probabilities contain NaN"."""
    def name(setting: str) -> str:
        return "--" + setting.replace("_", "-") if as_flags else setting

    if not max_new_tokens >= 0:
        raise ValueError(f"{name('max_new_tokens')}: must be >= 0, got {max_new_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{name('temperature')}: must be a finite number >= 0 (0: greedy), got {temperature}")
    if top_k is not None and not top_k >= 1:
        raise ValueError(f"{name('top_k')}: must be >= 1, got {top_k}")
    if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"{name('top_p')}: must be in (0, 1], got {top_p}")
    if not seed >= 0:
        raise ValueError(f"{name('seed')}: must be >= 0, got {seed}")


def sample_token(logits: np.ndarray, temperature: float, top_k: Optional[int], top_p: Optional[float],
                 rng: np.random.Generator) -> int:
    """One token id from a (V,) row of finite logits."""
    if temperature == 0:
        return int(np.argmax(logits))
    # Shifted before the division: a tiny temperature then sends the others to -inf, never the
    # top to inf (inf - inf would be NaN).
    z = (logits.astype(np.float64) - float(logits.max())) / temperature
    if top_k is not None and 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z)
    p /= p.sum()
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]  # always at least the top token
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return int(rng.choice(p.size, p=p))


def generate(model, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
             stop_ids: Iterable[int] = (), on_token: Optional[Callable[[int], None]] = None,
             stop_after: Optional[Callable[[list[int]], bool]] = None) -> list[int]:
    """The new token ids after `prompt_ids`, stopping after any of `stop_ids` (the tokenizer's
    EOS ids), when `stop_after(new ids)` says so (a chat's end-of-turn text), after
    max_new_tokens, or at the model's context length.

    `on_token` is called with each new id as soon as it is chosen (for streaming).
    NonFiniteLogits if the model's logits are NaN or Inf at some position.
    """
    if not prompt_ids:
        raise ValueError("generate: the prompt is empty (give text, or a tokenizer with a BOS token)")
    check_settings(max_new_tokens, temperature, top_k, top_p, seed)
    max_len = model.config.max_seq_len
    if len(prompt_ids) > max_len:
        raise ValueError(f"prompt: {len(prompt_ids)} tokens, beyond the model's max_seq_len {max_len}")
    vocab = model.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt: token id {bad[0]} outside the model's vocabulary (size {vocab})")
    budget = min(max_new_tokens, max_len - len(prompt_ids))
    if budget <= 0:
        return []

    stop = set(stop_ids)
    rng = np.random.default_rng(seed)
    model.reset_cache(1, len(prompt_ids) + budget)
    logits = model.forward_cached(np.asarray([prompt_ids], dtype=np.int32), 0)[0]
    out: list[int] = []
    pos = len(prompt_ids)
    while True:
        if not np.isfinite(logits).all():  # argmax would pick garbage, sampling would fail on NaN
            raise NonFiniteLogits(
                f"the model produced non-finite logits (NaN or Inf) at position {pos - 1} "
                f"({'the last prompt token' if not out else f'new token {len(out)}'}): its weights are probably "
                f"damaged (zoo inspect checks a checkpoint folder)")
        tok = sample_token(logits, temperature, top_k, top_p, rng)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if tok in stop or len(out) == budget or (stop_after is not None and stop_after(out)):
            return out
        logits = model.forward_cached(np.asarray([[tok]], dtype=np.int32), pos)[0]
        pos += 1


def prompt_tokens(tokenizer, text: str) -> list[int]:
    """A prompt as the model saw documents in training: BOS (if distinct from EOS) then text."""
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    ids = [bos] if bos is not None and bos != eos else []
    ids += list(tokenizer.encode(text)) if text else []
    if not ids and eos is not None:
        ids = [eos]  # GPT-2 style: <|endoftext|> starts a fresh document
    return ids


class TextStream:
    """Writes decoded text as tokens arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, prompt_ids: list[int], file=None):
        self.tokenizer = tokenizer
        self.stop = set(getattr(tokenizer, "eos_ids", ())) | {tokenizer.eos_id}
        self.ids = list(prompt_ids)
        self.file = file if file is not None else sys.stdout
        self.shown = tokenizer.decode(self.ids)

    def __call__(self, tok: int) -> None:
        if tok in self.stop:
            return
        self.ids.append(tok)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            return
        if text.startswith(self.shown):
            self.file.write(text[len(self.shown):])
        else:  # a tokenizer that rewrites earlier text on decode: show the tail only
            self.file.write(self.tokenizer.decode([tok]))
        self.file.flush()
        self.shown = text

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids)
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.file.write(text[len(self.shown):])
        self.file.write("\n")
        self.file.flush()
