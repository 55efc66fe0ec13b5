"""Chat templates with transformers' semantics: a conversation rendered by the Jinja template a
checkpoint carries, as transformers' `apply_chat_template(..., tokenize=False)` renders it, and
split into the pieces that assistant messages produced (what chat finetuning puts loss on).

Where the template comes from (`ChatTemplate.for_folder`), first found wins, as transformers
reads it: chat_template.jinja, then tokenizer_config.json's "chat_template" (a string, or a list
of {"name", "template"} of which "default" is taken), then zoo's FALLBACK_TEMPLATE.

Rendering: jinja2's ImmutableSandboxedEnvironment (templates from checkpoints are untrusted
code) with trim_blocks, lstrip_blocks and the loopcontrols extension; the globals
raise_exception() and strftime_now(); a tojson filter that writes what json.dumps writes
(non-ASCII kept, indent/separators/sort_keys passed on); transformers' {% generation %} tag
(renders its body). The template sees messages, add_generation_prompt, bos_token, eos_token,
tools=None, documents=None and any extra variables given.

Segments, the loss mask: the assistant's piece of message i is what rendering messages[:i+1]
adds to rendering messages[:i] with the generation prompt; that is the assistant's content
and the end of its turn, not the assistant header the generation prompt writes. This holds
only for templates where each such prefix renders as the start of the whole conversation
(prefix-stable); `segments` checks that and refuses the others.

The rendered text is meant to be encoded as it is, special-token text matched
(Tokenizer.encode(text), no BOS added): a template that wants BOS writes bos_token itself.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..core.errors import ChatTemplateError, CheckpointError
from ..core.files import parse_model, read_json, read_text
from .tokenizers import Tokenizer, TokenizerConfig, has_tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "FALLBACK_TEMPLATE", "ROLES"]

# The roles a message may have. Tool calls and tool results are not taken: templates render
# them in ways that differ (and whose loss mask would need more than assistant/other).
ROLES = ("system", "user", "assistant")

# For checkpoints that have no template: ChatML's framing (<|im_start|>role, newline, content),
# with the tokenizer's EOS ending each turn where ChatML writes <|im_end|>, so that generation
# stops at the end of the assistant's turn with any tokenizer; BOS first where zoo starts
# documents with it (a BOS distinct from EOS, as in pretraining).
FALLBACK_TEMPLATE = (
    "{%- if not eos_token %}{{ raise_exception('this template needs an eos_token') }}{% endif %}"
    "{%- if bos_token and bos_token != eos_token %}{{ bos_token }}{% endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CONFIG = "tokenizer_config.json"
_JINJA_FILE = "chat_template.jinja"


class ChatTemplate:
    """A compiled chat template. source: the Jinja text; origin: where it came from, named in
    every error (e.g. "DIR/tokenizer_config.json chat_template"); bos_token/eos_token: the
    texts the template sees under those names. ChatTemplateError on a syntax error."""

    def __init__(self, source: str, origin: str, bos_token: Optional[str] = None, eos_token: Optional[str] = None):
        if not isinstance(source, str):
            raise ChatTemplateError(origin, f"the template is a {type(source).__name__}, not text")
        self.source = source
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(origin, f"template syntax error at line {e.lineno}: {e.message}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.origin!r})"

    @classmethod
    def for_folder(cls, folder: str | os.PathLike) -> "ChatTemplate":
        """The chat template of a checkpoint or tokenizer folder, with its bos/eos texts
        (tokenizer_config.json, else special_tokens_map.json); FALLBACK_TEMPLATE when it has none."""
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(folder, "no such folder")
        bos, eos = _special_texts(folder)
        jinja_file = folder / _JINJA_FILE
        if jinja_file.exists():
            return cls(read_text(jinja_file, "chat template"), str(jinja_file), bos, eos)
        config_path = folder / _CONFIG
        if config_path.exists():
            config = read_json(config_path, _CONFIG)
            template = config.get("chat_template") if isinstance(config, dict) else None
            if template is not None:
                origin = f"{config_path} chat_template"
                if isinstance(template, list):
                    template, origin = _default_template(template, origin)
                return cls(template, origin, bos, eos)
        return cls(FALLBACK_TEMPLATE, f"zoo's fallback chat template ({folder} has none)", bos, eos)

    # --- rendering ---

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False, **extra: Any) -> str:
        """The conversation as text, as transformers' apply_chat_template(messages,
        tokenize=False, add_generation_prompt=...) writes it. extra: more template variables."""
        chat = self._checked(messages)
        return self._render(chat, add_generation_prompt, extra)

    def segments(self, messages: Sequence[dict], **extra: Any) -> list[tuple[str, bool]]:
        """render(messages) cut into pieces, True on those the assistant messages produced
        (content and end of turn), False on the rest (system and user turns, headers, the
        generation prompt's text). The pieces concatenate to render(messages). ChatTemplateError
        if the template is not prefix-stable (see the module's docstring)."""
        chat = self._checked(messages)
        full = self._render(chat, False, extra)
        pieces: list[tuple[str, bool]] = []
        at = 0
        for i, message in enumerate(chat):
            if message["role"] != "assistant":
                continue
            head = self._render(chat[:i], True, extra, f"rendering messages 0..{i - 1} with the generation prompt")
            turn = self._render(chat[:i + 1], False, extra, f"rendering messages 0..{i}")
            if not full.startswith(turn) or not turn.startswith(head) or len(head) < at:
                what = ("the conversation up to it does not start the whole conversation" if not full.startswith(turn)
                        else "the conversation before it with the generation prompt does not start the conversation "
                             "up to it" if not turn.startswith(head)
                        else "the conversation before it renders shorter than an earlier part of it")
                raise ChatTemplateError(
                    self.origin, f"the template is not prefix-stable at message {i} (assistant): {what}, so its "
                                 "assistant text cannot be told apart for the loss mask")
            pieces += [(full[at:len(head)], False), (full[len(head):len(turn)], True)]
            at = len(turn)
        pieces.append((full[at:], False))
        merged: list[tuple[str, bool]] = []
        for text, assistant in pieces:
            if not text:
                continue
            if merged and merged[-1][1] == assistant:
                merged[-1] = (merged[-1][0] + text, assistant)
            else:
                merged.append((text, assistant))
        return merged

    def _checked(self, messages: Sequence[dict]) -> list[dict]:
        """The messages as plain dicts (keys whose value is None dropped, as transformers does);
        ChatTemplateError naming the message at fault."""
        if not isinstance(messages, (list, tuple)):
            raise ChatTemplateError(self.origin, f"messages must be a list of {{\"role\", \"content\"}} objects, "
                                                 f"not a {type(messages).__name__}")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ChatTemplateError(self.origin, f"message {i} is a {type(message).__name__}, not a "
                                                     "{\"role\", \"content\"} object")
            role = message.get("role")
            if role not in ROLES:
                shown = "missing" if role is None else repr(role)
                raise ChatTemplateError(self.origin, f"message {i}: role {shown} is not one of {', '.join(ROLES)}")
            content = message.get("content")
            if not isinstance(content, str):
                shown = "missing" if content is None else f"a {type(content).__name__}"
                raise ChatTemplateError(self.origin, f"message {i} ({role}): content is {shown}, not text")
            chat.append({key: value for key, value in message.items() if value is not None})
        return chat

    def _render(self, chat: list[dict], add_generation_prompt: bool, extra: dict, doing: str = "rendering") -> str:
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, "tools": None, "documents": None,
                     **extra}
        try:
            return self._template.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # raise_exception, undefined names, the sandbox's refusals
            raise ChatTemplateError(self.origin, f"{doing}: {e.message or type(e).__name__}") from None
        except Exception as e:  # noqa: BLE001 - the template's own code failed (e.g. adding None to text)
            raise ChatTemplateError(self.origin, f"{doing}: {type(e).__name__}: {e}") from None


def _default_template(templates: list, origin: str) -> tuple[Any, str]:
    """The "default" one of tokenizer_config.json's list of named templates."""
    named = {}
    for entry in templates:
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and "template" in entry):
            raise ChatTemplateError(origin, "a list of chat templates must hold {\"name\", \"template\"} objects")
        named[entry["name"]] = entry["template"]
    if "default" not in named:
        raise ChatTemplateError(origin, f"no template named 'default' among {sorted(named)}")
    return named["default"], f"{origin} 'default'"


def _special_texts(folder: Path) -> tuple[Optional[str], Optional[str]]:
    """bos/eos texts as transformers finds them (tokenizer_config.json, else
    special_tokens_map.json); else as zoo's tokenizer of the folder resolves them (a folder
    saved before zoo wrote these files)."""
    bos = eos = None
    for name in (_CONFIG, "special_tokens_map.json"):
        path = folder / name
        if not path.exists():
            continue
        config = parse_model(path, TokenizerConfig, read_json(path, name), name)
        bos = bos if bos is not None else _text(config.bos_token)
        eos = eos if eos is not None else _text(config.eos_token)
    if (bos is None or eos is None) and has_tokenizer(folder):
        tokenizer = Tokenizer.from_pretrained(folder)
        bos = bos if bos is not None else tokenizer.bos_token
        eos = eos if eos is not None else tokenizer.eos_token
    return bos, eos


def _text(value) -> Optional[str]:
    return value if isinstance(value, str) or value is None else value.content


# --- the Jinja environment, as transformers sets it up ---------------------------------------


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment():
    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: transformers marks assistant text with it
        (for its own masks); here it renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """namespace() that refuses attribute names starting with "_" (a way into Python's internals)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: names starting with _ "
                                                      "are not allowed")

    class Dict:
        """dict() and dict.fromkeys() for templates, without the class itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=Namespace, dict=Dict())
    return env
