"""zoo bench: a training step of zoo and of PyTorch timed side by side (zoo/tools/bench.py)."""

from __future__ import annotations


def add_bench(sub) -> None:
    from ..tools.bench import add_arguments  # zoo.tools: outside the runtime's import graph

    p = sub.add_parser("bench", help="time a training step of zoo and of PyTorch eager, side by side "
                                     "(see docs/benchmarks.md)")
    add_arguments(p)
    p.set_defaults(run=_cmd_bench)


def _cmd_bench(args) -> int:
    from ..tools.bench import run_from_args  # zoo.tools: imported when the verb runs

    return run_from_args(args)
