"""The named architectures: zoo presets lists them, zoo card prints one's model card, zoo cards
regenerates model_cards/ (zoo/tools/cards.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..arch.layout import num_parameters
from ..arch.presets import PRESETS


def add_presets(sub) -> None:
    p = sub.add_parser("presets", help="list the named architectures with their parameter counts")
    p.set_defaults(run=_cmd_presets)


def _cmd_presets(args) -> int:
    print(f"{'preset':16} {'parameters':>15}  {'layers':>6} {'d_model':>7} {'heads':>9}  blocks")
    for p in PRESETS:
        c = p.config
        heads = f"{c.n_head}/{c.n_kv_head}"
        blocks = f"{c.norm}, {c.mlp}, {c.positions}{', tied' if c.tied_embeddings else ''}"
        print(f"{p.name:16} {num_parameters(c):>15,}  {c.n_layer:>6} {c.d_model:>7} {heads:>9}  {blocks}")
    return 0


def add_card(sub) -> None:
    p = sub.add_parser("card", help="print a preset's model card (Markdown; see model_cards/)")
    p.add_argument("name", metavar="NAME", help="a preset name (zoo presets lists them)")
    p.add_argument("--benchmarks", metavar="DIR", default=None,
                   help="zoo bench --json results to show (default: benchmarks/ at the repository root)")
    p.add_argument("--json", action="store_true", help="print the machine-readable card instead")
    p.set_defaults(run=_cmd_card)


def _cmd_card(args) -> int:
    from ..tools import (
        cards,  # zoo.tools: outside the runtime's import graph, imported when the verb runs
    )

    bench_dir = Path(args.benchmarks) if args.benchmarks else cards.default_root() / cards.BENCHMARKS_DIR
    print(cards.render_card(args.name, bench_dir, as_json=args.json), end="")
    return 0


def add_cards(sub) -> None:
    p = sub.add_parser("cards", help="regenerate model_cards/ from the presets and benchmarks/ (--check: only compare)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 listing the cards that differ from what would be generated")
    p.add_argument("--out", metavar="DIR", default=None, help="cards folder (default: model_cards/ at the repository root)")
    p.add_argument("--benchmarks", metavar="DIR", default=None,
                   help="zoo bench --json results to show (default: benchmarks/ at the repository root)")
    p.set_defaults(run=_cmd_cards)


def _cmd_cards(args) -> int:
    from ..tools import (
        cards,  # zoo.tools: outside the runtime's import graph, imported when the verb runs
    )

    root = cards.default_root()
    out = Path(args.out) if args.out else root / cards.CARDS_DIR
    files = cards.render_all(Path(args.benchmarks) if args.benchmarks else root / cards.BENCHMARKS_DIR)
    if args.check:
        bad = cards.differing(out, files)
        for line in bad:
            print(line)
        if bad:
            print(f"zoo cards: {len(bad)} card(s) out of date; run `zoo cards` to regenerate", file=sys.stderr)
            return 1
        print(f"zoo cards: {len(files)} files in {out} are up to date", file=sys.stderr)
        return 0
    done = cards.write_all(out, files)
    for line in done:
        print(line)
    print(f"zoo cards: {len(files)} files in {out}, {len(done)} changed", file=sys.stderr)
    return 0
