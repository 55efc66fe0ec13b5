"""The `zoo` command. Each verb is a pair of small functions in its module: `add_<verb>(subparsers)`
declares its flags, `_cmd_<verb>(args)` runs it. Add a verb by writing both and listing it in
VERBS. Verbs that share flags share a module (train, finetune, demo, launch: train.py); the
flags several verbs share are flags.py's, and boundary.py turns every failure into one line
and an exit status."""

from __future__ import annotations

import argparse

from . import boundary
from .bench import add_bench
from .chat import add_chat
from .checkpoints import add_convert, add_inspect, add_merge
from .evaluate import add_eval
from .flags import HelpFormatter
from .generate import add_generate
from .plot import add_plot
from .presets import add_card, add_cards, add_presets
from .train import add_demo, add_finetune, add_launch, add_train

VERBS = [add_presets, add_train, add_finetune, add_demo, add_launch, add_generate, add_chat, add_eval,
         add_plot, add_inspect, add_convert, add_merge, add_bench, add_card, add_cards]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zoo", description=(
        "Decoder language models of the Hugging Face families (GPT-2, Llama, Mistral, Qwen, Gemma, Phi-3, "
        "OLMo-2, SmolLM3, Granite, GPT-NeoX): train, finetune, generate."))
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for add in VERBS:
        add(sub)
    for verb_parser in sub.choices.values():
        verb_parser.formatter_class = HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    """`zoo ARGV...` (sys.argv without argv): its exit status."""
    return boundary.main(argv, build_parser)
