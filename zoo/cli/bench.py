"""zoo bench: a training step of zoo and of PyTorch timed side by side (zoo/tools/bench.py).

The benchmark is outside the runtime's import graph: the verb takes the rest of its command
line as it is and hands it, when it runs, to the tool's own parser (`zoo bench --help` is the
tool's help), so `zoo` starts without importing zoo.tools."""

from __future__ import annotations

import argparse


def add_bench(sub) -> None:
    # No word of a command line starts with NUL: with it as the only prefix character, argparse
    # takes every word after `bench`, its flags and --help included, as the tool's arguments.
    p = sub.add_parser("bench", help="time a training step of zoo and of PyTorch eager, side by side "
                                     "(see docs/benchmarks.md; zoo bench --help lists its flags)",
                       add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="...", help="zoo bench's flags (zoo bench --help)")
    p.set_defaults(run=_cmd_bench)


def _cmd_bench(args) -> int:
    from ..tools.bench import main  # zoo.tools: outside the runtime's import graph, imported when the verb runs

    return main(args.args)
