"""What several verbs share: --from's help, the help formatter that shows defaults, the flags of
every verb that runs a model (threads, tokenizer, precision, a LoRA base's format) and of
sampling, the check of a flag's value, and the model a verb's --from names, loaded with those flags."""

from __future__ import annotations

import argparse
import sys
import warnings

from ..arch.lora import BASE_DTYPES, default_precision
from ..core.gemm import PRECISIONS
from ..core.native import set_threads
from ..io import load
from ..model import Model

# What --from (and the other model arguments) takes, in every verb's help.
FROM_HELP = ("the model: a Hugging Face checkpoint folder (sharded too), a zoo run folder or one of its "
             "checkpoints, a PEFT adapter folder or a GGUF file")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with "(default X)" after each option whose default is a value, unless its
    help already names the default. None (unset, or off) and on/off switches are left alone."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None
                or action.default is argparse.SUPPRESS or isinstance(action.default, bool)):
            return text
        return f"{text} (default %(default)s)".lstrip()


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags of every verb that runs a model: threads, tokenizer, precision, a LoRA base's format."""
    p.add_argument("--threads", type=int, default=None, metavar="N", help="CPU threads (default: all)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer folder (default: --from)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="of the matrix products (default: a run folder's, else fp32; bf16 needs a CPU with bf16 "
                        "dot products)")
    p.add_argument("--base-dtype", choices=BASE_DTYPES, default=None,
                   help="load the weights frozen in this format (less memory; the products then run in bf16 where "
                        "the CPU has bf16 dot products). An adapter folder (a LoRA run's): the format of its base "
                        "(default: the run's, else bf16); a checkpoint: fp32 by default")


def add_sampling_flags(p: argparse.ArgumentParser, max_new_tokens: int, temperature: float, budget: str) -> None:
    """How generate and chat pick tokens (generate.check_settings checks the values)."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N", help=budget)
    p.add_argument("--temperature", type=float, default=temperature, metavar="X", help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample from the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample from the likeliest tokens that together reach probability p (default: 1, all)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the sampling")


def check_flag(flag: str, value, ok: bool, expected: str) -> None:
    """ValueError naming the flag, before any work starts, unless ok."""
    if not ok:
        raise ValueError(f"{flag}: must be {expected}, got {value}")


def apply_threads(args) -> None:
    """--threads of a verb that runs a model, applied (set_threads checks it) before any weights
    are read. --precision is the model's to check (zoo.Model), before it reads any weights."""
    if args.threads is not None:
        set_threads(args.threads, "--threads")


def model_for(source, allow_nonfinite: bool, args=None):
    """The model of a resolved --from (io/load.py); with allow_nonfinite (--allow-nonfinite), a
    checkpoint holding NaN or Inf loads too, and the warning that says how many and where is
    printed as one line. args: a verb's --precision and --base-dtype, each defaulting to the
    run's when the source is a run folder or checkpoint (a LoRA run's adapters then go on the base
    it trained them on, and compute as it did)."""

    settings = {}
    if args is not None:
        run = source.settings()
        base_dtype = args.base_dtype or run.get("base_dtype")
        precision = args.precision or run.get("precision") or default_precision(base_dtype or "fp32")
        settings = dict(precision=precision, base_dtype=base_dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        model = load.load_model(source, Model, allow_nonfinite=allow_nonfinite, **settings)
    for w in caught:
        print(f"zoo: warning: {w.message}", file=sys.stderr)
    return model
