"""Sampling with a KV cache: the prompt goes through the model once, then one token per call;
several prompts together (generate_batch), one call per token for all of them.

Temperature 0 is greedy (argmax, ties to the lowest id, as torch.argmax); otherwise logits
are divided by the temperature, cut to the top-k and then to the smallest set whose
probability reaches top-p, and sampled with a generator seeded by `seed`.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from typing import Callable, Iterable, Optional, Sequence

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
    max_new_tokens, or at the model's context length: generate_batch of this one prompt.

    `on_token` is called with each new id as soon as it is chosen (for streaming).
    NonFiniteLogits if the model's logits are NaN or Inf at some position.
    """
    return generate_batch(model, [prompt_ids], max_new_tokens, temperature, top_k, top_p, seed, stop_ids,
                          on_token=None if on_token is None else lambda _, tok: on_token(tok),
                          stop_after=None if stop_after is None else lambda _, new: stop_after(new),
                          batch_size=1)[0]


def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                   top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
                   stop_ids: Iterable[int] = (), on_token: Optional[Callable[[int, int], None]] = None,
                   stop_after: Optional[Callable[[int, list[int]], bool]] = None,
                   batch_size: int = 8, on_done: Optional[Callable[[int, list[int]], None]] = None
                   ) -> list[list[int]]:
    """The new token ids after each prompt, the prompts decoded together: up to batch_size
    sequences, a KV cache slot each, go through the model in one call per token, sharing each
    read of the weights. Each stops on its own: after any of `stop_ids`, when
    `stop_after(i, new ids)` says so, after max_new_tokens, or at the model's context length;
    its slot then takes the next prompt waiting, whose prompt goes through the model in the
    same call as the others' next tokens.

    Prompt i samples from its own generator, np.random.default_rng([seed, i]): its tokens do not
    depend on which prompts share its batch (greedy ones do not either, up to the rounding of
    sums over different numbers of rows). `on_token(i, tok)` is called as each id is chosen,
    `on_done(i, new ids)` as each sequence stops (a prompt with no room left in the context
    stops at once, with none). NonFiniteLogits names the prompt and position whose logits are
    NaN or Inf.
    """
    prompts = [list(p) for p in prompts]
    check_settings(max_new_tokens, temperature, top_k, top_p, seed)
    if not batch_size >= 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    max_len, vocab = model.config.max_seq_len, model.config.vocab_size

    def name(i: int) -> str:  # the prompt, as an error names it
        return "prompt" if len(prompts) == 1 else f"prompt {i}"

    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"generate: {name(i)} is empty (give text, or a tokenizer with a BOS token)")
        if len(p) > max_len:
            raise ValueError(f"{name(i)}: {len(p)} tokens, beyond the model's max_seq_len {max_len}")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name(i)}: token id {bad[0]} outside the model's vocabulary (size {vocab})")
    budgets = [min(max_new_tokens, max_len - len(p)) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    waiting = deque(i for i in range(len(prompts)) if budgets[i] > 0)
    if on_done is not None:
        for i in range(len(prompts)):
            if budgets[i] <= 0:
                on_done(i, outs[i])
    if not waiting:
        return outs
    stop = set(stop_ids)
    rngs = {i: np.random.default_rng([seed, i]) for i in waiting}
    slots = min(batch_size, len(waiting))
    model.reset_cache(slots, max(len(prompts[i]) + budgets[i] for i in waiting))
    free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
    running: dict[int, tuple[int, int, int]] = {}  # slot -> (prompt, its last token, that token's position)
    while waiting or running:
        # One call: the waiting prompts that find a free slot, and every running sequence's last token.
        calls: list[tuple[int, int, list[int], int]] = []  # (slot, prompt, tokens, start)
        while free and waiting:
            i = waiting.popleft()
            calls.append((free.pop(), i, prompts[i], 0))
        calls += [(slot, i, [tok], pos) for slot, (i, tok, pos) in running.items()]
        logits = model.forward_segments([c[0] for c in calls], [c[2] for c in calls], [c[3] for c in calls])
        for (slot, i, tokens, start), row in zip(calls, logits):
            out = outs[i]
            if not np.isfinite(row).all():  # argmax would pick garbage, sampling would fail on NaN
                raise NonFiniteLogits(
                    f"the model produced non-finite logits (NaN or Inf) at position {start + len(tokens) - 1} "
                    f"({'the last token of ' + name(i) if not out else f'new token {len(out)} after ' + name(i)}): "
                    f"its weights are probably damaged (zoo inspect checks a checkpoint folder)")
            tok = sample_token(row, temperature, top_k, top_p, rngs[i])
            out.append(tok)
            if on_token is not None:
                on_token(i, tok)
            if tok in stop or len(out) == budgets[i] or (stop_after is not None and stop_after(i, out)):
                running.pop(slot, None)
                free.append(slot)
                if on_done is not None:
                    on_done(i, out)
            else:
                running[slot] = (i, tok, start + len(tokens))
    return outs


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
