"""zoo generate: continue a prompt (text, or token ids) with a model, streamed."""

from __future__ import annotations

import sys

from ..core.errors import CheckpointError
from ..generate import (
    NonFiniteLogits,
    TextStream,
    check_settings,
    generate,
    prompt_tokens,
)
from ..generate_file import generate_file, read_prompts
from ..io import load
from ..io.checkpoints import stop_ids
from .flags import (
    FROM_HELP,
    add_model_flags,
    add_sampling_flags,
    apply_threads,
    check_flag,
    model_for,
)


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a checkpoint (KV cache, streamed)")
    p.add_argument("--from", dest="from_dir", required=True, metavar="MODEL", help=FROM_HELP)
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    prompt.add_argument("--prompt-ids", nargs="+", default=None, metavar="ID",
                        help="the prompt as token ids, comma- or space-separated (1,2,3 or 1 2 3); needs no "
                             "tokenizer. Prints the ids, then their text where the checkpoint has a tokenizer")
    prompt.add_argument("--prompts", default=None, metavar="FILE",
                        help="a file of prompts, one per line (or JSON Lines with a \"prompt\" each), decoded "
                             "--batch-size at a time; prints one JSON line per prompt: prompt, completion, new_tokens")
    p.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="with --prompts: sequences decoded together, sharing each read of the weights (default 8)")
    p.add_argument("--no-echo", dest="echo", action="store_false",
                   help="print only the continuation, not the prompt before it")
    add_sampling_flags(p, 200, 0.8, "tokens to add at most (fewer at an end-of-text token or the model's "
                                    "context length)")
    add_model_flags(p)
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load weights holding NaN or Inf too (refused by default), saying how many and where")
    p.set_defaults(run=_cmd_generate)


def _cmd_generate(args) -> int:
    check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, as_flags=True)
    prompt_ids = _token_ids("--prompt-ids", args.prompt_ids) if args.prompt_ids is not None else None
    check_flag("--batch-size", args.batch_size, args.batch_size >= 1, ">= 1")
    if args.prompts is not None:
        read_prompts(args.prompts)  # a bad file is refused before the weights are read
    apply_threads(args)  # before the weights are read
    source = load.resolve(args.from_dir)
    src = source.path
    model = model_for(source, args.allow_nonfinite, args)
    tokenizer = load.tokenizer_for(source, model, args.tokenizer)
    if source.form == "gguf" and tokenizer is None and prompt_ids is None:
        raise ValueError(f"--from {src}: this GGUF file carries no vocabulary (no tokenizer.ggml.* keys); "
                         "give a tokenizer folder with --tokenizer, or the prompt as token ids with --prompt-ids")
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer {args.tokenizer or src}: {tokenizer.vocab_size} tokens, more than the "
                         f"model's vocab_size {model.config.vocab_size}")
    if prompt_ids is not None:
        return _generate_ids(args, model, source, prompt_ids, tokenizer)
    if tokenizer is None:
        raise CheckpointError(src, "no tokenizer here (looked for zoo_tokenizer.json, tokenizer.json, tokenizer.model, "
                                   "vocab.json + merges.txt); give the prompt as token ids with --prompt-ids, or a "
                                   "tokenizer folder with --tokenizer")
    if args.prompts is not None:
        try:
            generate_file(model, tokenizer, args.prompts, args.max_new_tokens, args.temperature, args.top_k,
                          args.top_p, args.seed, args.batch_size)
        except NonFiniteLogits as e:
            raise NonFiniteLogits(f"--from {src}: {e}") from None
        return 0
    ids = prompt_tokens(tokenizer, args.prompt)
    stream = TextStream(tokenizer, ids)
    if args.echo:  # as the trainer's sample: the continuation reads on from the prompt
        sys.stdout.write(args.prompt)
        sys.stdout.flush()  # shown while the model reads the prompt
    try:
        generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                 stop_ids=tokenizer.eos_ids, on_token=stream)
    except NonFiniteLogits as e:
        sys.stdout.write("\n")  # the error line goes to stderr: end the text shown so far
        raise NonFiniteLogits(f"--from {src}: {e}") from None
    stream.finish()
    return 0


def _token_ids(flag: str, values: list[str]) -> list[int]:
    """Token ids from a flag's values, each holding ids separated by commas or spaces."""
    parts = [part for value in values for part in value.replace(",", " ").split()]
    if not parts:
        raise ValueError(f"{flag}: no token ids given")
    bad = next((part for part in parts if not (part.isascii() and part.isdigit())), None)
    if bad is not None:
        raise ValueError(f"{flag}: {bad!r} is not a token id (an integer >= 0)")
    return [int(part) for part in parts]


def _generate_ids(args, model, source, prompt_ids: list[int], tokenizer) -> int:
    """zoo generate --prompt-ids: the ids (the prompt's unless --no-echo, then the new ones) on
    one line as they come, then their text on the next where there is a tokenizer."""
    vocab, context = model.config.vocab_size, model.config.max_seq_len
    outside = next((i for i in prompt_ids if i >= vocab), None)
    if outside is not None:
        raise ValueError(f"--prompt-ids: id {outside} is outside the model's vocabulary (vocab_size {vocab}: "
                         f"ids 0 to {vocab - 1})")
    if len(prompt_ids) > context:
        raise ValueError(f"--prompt-ids: {len(prompt_ids)} ids, beyond the model's max_seq_len {context}")
    shown = list(prompt_ids) if args.echo else []
    sys.stdout.write(" ".join(map(str, shown)))
    sys.stdout.flush()

    def show(token: int) -> None:
        sys.stdout.write(f" {token}" if shown else str(token))
        sys.stdout.flush()
        shown.append(token)

    src = source.path
    stop = tokenizer.eos_ids if tokenizer is not None else stop_ids(source.model) if source.model.is_dir() else []
    try:
        generate(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                 stop_ids=stop, on_token=show)
    except NonFiniteLogits as e:
        sys.stdout.write("\n")
        raise NonFiniteLogits(f"--from {src}: {e}") from None
    sys.stdout.write("\n")
    if tokenizer is not None:
        sys.stdout.write(tokenizer.decode(shown) + "\n")
    return 0
