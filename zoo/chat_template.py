"""Chat templates: a checkpoint's Jinja template turning messages into the text the model was
trained on, rendered with the semantics of transformers' apply_chat_template (a sandboxed Jinja
environment with trim_blocks and lstrip_blocks, loop controls, raise_exception, strftime_now,
tojson without ASCII escapes, bos_token and eos_token).

segments() splits a chat's text into the parts the model is trained on (each assistant turn,
with the template's end-of-turn text after it) and the context (everything else), by rendering
prefixes of the conversation: the part of messages[:i+1] beyond messages[:i] with the
generation prompt is turn i's own. Templates for which a prefix's text is not the start of the
whole (a template that rewrites earlier turns) are refused, naming the template.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

from .files import read_json

# For checkpoints that have no template (a model trained from scratch, a base model): ChatML,
# the format of SmolLM and Qwen. With a tokenizer that lacks its markers as special tokens they
# are plain text (bytes for zoo's byte-level tokenizer), which a model learns as well.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant")


class ChatTemplateError(ValueError):
    """A template that cannot render a chat, or a chat it cannot take: names the template."""


class ChatTemplate:
    def __init__(self, source: str, origin: str, bos_token: Optional[str] = None, eos_token: Optional[str] = None):
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token
        self._compiled = None

    def _template(self):
        if self._compiled is None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ChatTemplateError(f"{self.origin}: the template refused the chat: {message}")

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._compiled = env.from_string(self.source)
            except TemplateError as e:
                raise ChatTemplateError(f"{self.origin}: not a valid Jinja template ({e})") from None
        return self._compiled

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **extra) -> str:
        """The chat's text, as transformers' apply_chat_template(tokenize=False) gives it."""
        from jinja2 import TemplateError

        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                role = m.get("role") if isinstance(m, dict) else None
                raise ChatTemplateError(f"messages[{i}] has role {role!r}: a chat's roles are {', '.join(ROLES)}, "
                                        "each with a string \"content\"")
        template = self._template()
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"{self.origin}: failed to render the chat ({type(e).__name__}: {e})") from None

    def segments(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """The chat's text in pieces, True on those an assistant turn produced (its content and
        the end-of-turn text after it, not the header the generation prompt writes)."""
        pieces: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            if message.get("role") == "assistant":
                done = self._extend(pieces, done, self.render(messages[:i], add_generation_prompt=True), False)
            done = self._extend(pieces, done, self.render(messages[:i + 1]), message.get("role") == "assistant")
        return pieces

    def _extend(self, pieces: list, done: str, text: str, trained: bool) -> str:
        if not text.startswith(done):
            raise ChatTemplateError(f"{self.origin}: the template renders a conversation's start differently once "
                                    "it goes on, so the assistant's turns cannot be told apart for the loss mask")
        if len(text) > len(done):
            pieces.append((text[len(done):], trained))
        return text


def _token_text(value) -> Optional[str]:
    if isinstance(value, dict):  # an AddedToken's fields
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_template_for(folder: Optional[Path]) -> ChatTemplate:
    """The chat template of a checkpoint folder (tokenizer_config.json's chat_template: a string,
    or named templates, of which "default"), else FALLBACK_TEMPLATE."""
    if folder is not None:
        path = Path(folder) / "tokenizer_config.json"
        if path.is_file():
            config = read_json(path, "tokenizer config")
            if isinstance(config, dict) and config.get("chat_template"):
                source = config["chat_template"]
                if isinstance(source, list):
                    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                    source = named.get("default")
                if not isinstance(source, str):
                    raise ChatTemplateError(f"{path}: chat_template must be a string, or a list of named templates "
                                            "with one named \"default\"")
                return ChatTemplate(source, f"{path} chat_template", _token_text(config.get("bos_token")),
                                    _token_text(config.get("eos_token")))
    return ChatTemplate(FALLBACK_TEMPLATE, "zoo's fallback chat template (the checkpoint has none)")
