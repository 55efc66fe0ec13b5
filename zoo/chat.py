"""Chatting with a checkpoint: each turn rendered with its chat template (the whole conversation,
as it was rendered in training), the reply generated with the KV cache and streamed, up to the
tokenizer's EOS or the template's end-of-turn text."""

from __future__ import annotations

import sys
from typing import Optional

from .generate import generate

_MARK = "\x00zoo-reply\x00"


def end_of_turn(template) -> str:
    """The text a template puts after an assistant's reply (e.g. "<|im_end|>"), found by
    rendering a reply that is a marker; "" when the template puts nothing there."""
    text = template.render([{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}])
    return text[text.index(_MARK) + len(_MARK):].strip() if _MARK in text else ""


class ChatSession:
    """One conversation: the messages so far (a system prompt first, where given)."""

    def __init__(self, model, tokenizer, template, system: Optional[str] = None, *, max_new_tokens: int = 256,
                 temperature: float = 0.7, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 seed: int = 0):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.messages = [{"role": "system", "content": system}] if system else []
        self.settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        self.seed = seed
        self.end = end_of_turn(template)

    def reply(self, text: str, file=None) -> str:
        """The model's answer to `text`, streamed to file (stdout by default) as it is made."""
        file = file if file is not None else sys.stdout
        messages = self.messages + [{"role": "user", "content": text}]
        prompt = self.template.render(messages, add_generation_prompt=True)
        ids = list(self.tokenizer.encode(prompt))  # the template writes BOS itself where the model wants one
        stop_ids = set(getattr(self.tokenizer, "eos_ids", ())) | {self.tokenizer.eos_id} - {None}
        shown = 0

        def answer(new: list[int]) -> str:
            return self.tokenizer.decode([t for t in new if t not in stop_ids])

        def stream(new: list[int]) -> bool:  # shows what can no longer turn out to be end-of-turn text
            nonlocal shown
            so_far = answer(new)
            done = bool(self.end) and self.end in so_far
            safe = so_far.index(self.end) if done else len(so_far) - max(len(self.end) - 1, 0)
            if so_far[:safe].endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the rest
                safe = shown
            if safe > shown:
                file.write(so_far[shown:safe])
                file.flush()
                shown = safe
            return done

        new = generate(self.model, ids, seed=self.seed, stop_ids=stop_ids, stop_after=stream, **self.settings)
        text_out = answer(new)
        if self.end and self.end in text_out:
            text_out = text_out[:text_out.index(self.end)]
        file.write(text_out[shown:].rstrip() + "\n")
        file.flush()
        self.messages = messages + [{"role": "assistant", "content": text_out.strip()}]
        self.seed += 1
        return text_out.strip()
