"""zoo chat: a conversation with a model, in its chat template."""

from __future__ import annotations

import sys

from ..chat import ChatSession
from ..core.errors import CheckpointError
from ..generate import check_settings
from ..io import load
from .flags import (
    FROM_HELP,
    add_model_flags,
    add_sampling_flags,
    apply_threads,
    model_for,
)


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="chat with a checkpoint (its chat template; streamed; --prompt for one turn)")
    p.add_argument("--from", dest="from_dir", required=True, metavar="MODEL", help=FROM_HELP)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    p.add_argument("--prompt", default=None, metavar="TEXT", help="one message: print the reply and exit")
    add_sampling_flags(p, 256, 0.7, "tokens per reply at most (fewer at an end-of-text token or the model's "
                                    "context length)")
    add_model_flags(p)
    p.set_defaults(run=_cmd_chat)


def _cmd_chat(args) -> int:
    check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, as_flags=True)
    apply_threads(args)
    source = load.resolve(args.from_dir)
    model = model_for(source, False, args)
    tokenizer = load.tokenizer_for(source, model, args.tokenizer)
    if tokenizer is None:
        raise CheckpointError(source.path, "no tokenizer here (nor in a GGUF file's metadata): a chat is text; give "
                                           "a tokenizer folder with --tokenizer")
    session = ChatSession(model, tokenizer, load.chat_template_for(source, args.tokenizer), args.system,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)
    if args.prompt is not None:
        session.reply(args.prompt)
        return 0
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        if line.strip():
            session.reply(line)
