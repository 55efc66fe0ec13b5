"""Layer arrangements side by side: the parallel-residual layer, chained by hand (the executor's)
and, in a Clad build, by Clad from its forward over block calls, against the hand-chained
sequential layer of the same size.

    python -m zoo.tools.bench_layer --preset gpt2 --batch-size 4 --seq-len 64 --threads 1 2 --rounds 7

The preset's layer shapes (d_model, heads, d_ff, norm, MLP, positions) with --n-layer layers
and a --vocab-size vocabulary (default 2 and 512), so that the step is the layers' and not the
embedding's or the LM head's. The models, with the same seed, stepped in turn in one process so
that all see the same load, each round starting with the next model: each arrangement
hand-chained over the hand-written block pullbacks (ad=manual); in a Clad build also the
parallel layer chained by Clad over the hand-written block pullbacks (ad={"parallel": "clad"}),
and both arrangements over Clad's block pullbacks (ad=clad). Per model, the median
forward (the loss), and the median and the best training step (forward, pullbacks, AdamW: the
best is the least disturbed by other work on a shared machine). The ratios compare the
parallel layer with the sequential one on the same block pullbacks. The parallel layer has
one norm per layer where the sequential one has two (its forward and pullback are one norm
cheaper); everything else is the same blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional

import numpy as np

from zoo.tools.bench_worker import timed_step

# (layer, ad, how the layer's pullback is chained); the Clad rows where the build has Clad.
MODELS = (("sequential", "manual", "hand"), ("parallel", "manual", "hand"))
CLAD_MODELS = (("parallel", {"parallel": "clad"}, "clad"), ("sequential", "clad", "hand"), ("parallel", "clad", "clad"))


def _forward(model, x, y) -> float:
    t0 = time.perf_counter()
    model.loss(x, y)
    return time.perf_counter() - t0


def measure(cfg, batch: int, seq_len: int, threads: int, rounds: int, warmup: int = 2, seed: int = 0) -> dict:
    import zoo

    zoo.set_threads(threads)
    chosen = MODELS + (CLAD_MODELS if zoo.build_info()["clad"] else ())
    models = {(layer, "clad" if ad == "clad" else "manual", chain): zoo.Model(cfg.model_copy(update={"layer": layer}),
                                                                              seed=seed, ad=ad)
              for layer, ad, chain in chosen}
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    for _ in range(warmup):
        for m in models.values():
            timed_step(m, x, y)
    steps = {k: [] for k in models}
    forwards = {k: [] for k in models}
    order = list(models)
    for r in range(rounds):  # each round starts with the next model: none always runs after the same one
        for k in order[r % len(order):] + order[:r % len(order)]:
            steps[k].append(timed_step(models[k], x, y))
            forwards[k].append(_forward(models[k], x, y))
    rows = []
    for key in models:
        layer, ad, chain = key
        sequential = ("sequential", ad, "hand")
        step, fwd, best = statistics.median(steps[key]), statistics.median(forwards[key]), min(steps[key])
        rows.append({"layer": layer, "ad": ad, "chain": chain, "forward_ms": 1e3 * fwd, "step_ms": 1e3 * step,
                     "step_best_ms": 1e3 * best,
                     "step_vs_sequential": step / statistics.median(steps[sequential]),
                     "best_vs_sequential": best / min(steps[sequential]),
                     "step_all_ms": [1e3 * s for s in steps[key]]})
    return {"threads": threads, "rows": rows}


def markdown(results: list[dict], title: str) -> str:
    lines = [f"### {title}", ""]
    for r in results:
        lines += [f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}:", "",
                  "| layer (its pullback) | block pullbacks | forward ms | training step ms (median) | "
                  "/ sequential | best step ms | / sequential |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for row in r["rows"]:
            chained = "hand-chained" if row["chain"] == "hand" else "chained by Clad"
            lines.append(f"| {row['layer']} ({chained}) | {row['ad']} | {row['forward_ms']:.1f} | "
                         f"{row['step_ms']:.1f} | {row['step_vs_sequential']:.3f} | {row['step_best_ms']:.1f} | "
                         f"{row['best_vs_sequential']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    import zoo

    p = argparse.ArgumentParser(prog="python -m zoo.tools.bench_layer", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2", help="whose layer shapes (default gpt2)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=7, help="timed steps per model (default 7)")
    p.add_argument("--json", metavar="FILE", default=None)
    a = p.parse_args(argv)
    cfg = zoo.ModelConfig(**{**zoo.preset(a.preset).model_dump(), "n_layer": a.n_layer, "vocab_size": a.vocab_size})
    results = [measure(cfg, a.batch_size, a.seq_len, t, a.rounds) for t in a.threads]
    title = (f"{a.preset}'s layers x {a.n_layer}, vocabulary {a.vocab_size}, B={a.batch_size}, T={a.seq_len}: "
             f"medians of {a.rounds} rounds, the four models stepped in turn in one process "
             f"({zoo.build_info()['compiler']})")
    print(markdown(results, title))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"preset": a.preset, "n_layer": a.n_layer, "vocab_size": a.vocab_size,
                       "batch_size": a.batch_size, "seq_len": a.seq_len, "config": cfg.model_dump(),
                       "compiler": zoo.build_info()["compiler"], "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
