"""The Clad backend against the hand-written pullbacks, side by side (docs/clad.md).

    python -m zoo.tools.bench_ad --preset gpt2 --batch-size 4 --seq-len 64 --threads 1 2 --rounds 7

Two models with the same weights, one with ad="manual" and one with ad="clad", stepped in
turn in one process so that both see the same load on a shared machine. First the full
training step as a user runs it (zero_grads, forward_backward, adamw_step), nothing
profiled, the backends alternated ABBA (manual-clad, then clad-manual) so that neither
always runs first; then, in separate profiled steps, per block the time its pullbacks take in
one step (the executor's block profile; for cross-entropy, whose hand-written pullback is
fused with the loss, loss and adjoint together). Medians over rounds.
Needs a zoo built with Clad; zoo bench --ad clad measures the Clad step alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from zoo.tools.bench_worker import cpu_info, timed_step


# Profile kinds (native/executor/model.hpp) to the block names of ad=, where the model decides.
def _block_name(kind: str, cfg) -> str:
    # The LM head is a linear block: its pullback runs on the linear block's backend.
    return {"norm": cfg.norm, "activation": cfg.mlp, "lm_head": "linear"}.get(kind, kind)


def measure(cfg, batch: int, seq_len: int, threads: int, rounds: int, warmup: int = 2, seed: int = 0) -> dict:
    import zoo

    zoo.set_threads(threads)
    models = {ad: zoo.Model(cfg, seed=seed, ad=ad) for ad in ("manual", "clad")}
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    for _ in range(warmup):
        for m in models.values():
            timed_step(m, x, y)
    # The whole step: unprofiled, in ABBA order (a backend that always ran second would find
    # the caches and the threads as the other left them).
    steps = {ad: [] for ad in models}
    for r in range(rounds):
        for ad in (("manual", "clad") if r % 2 == 0 else ("clad", "manual")):
            steps[ad].append(timed_step(models[ad], x, y))
    # Per block: profiled steps of their own.
    pullback = {ad: {} for ad in models}  # ad -> block -> [seconds per round]
    for r in range(rounds):
        for ad in (("manual", "clad") if r % 2 == 0 else ("clad", "manual")):
            m = models[ad]
            m.set_profiling(True)
            timed_step(m, x, y)
            this_round: dict[str, float] = {}
            for kind, (fwd, back) in m.block_profile().items():
                # The hand-written cross-entropy computes the loss and its adjoint in one fused
                # pass (profiled as forward): compare loss plus adjoint for both backends.
                t = fwd + back if kind == "cross_entropy" else back
                if t > 0:
                    name = "cross_entropy (loss and adjoint)" if kind == "cross_entropy" else _block_name(kind, cfg)
                    this_round[name] = this_round.get(name, 0.0) + t
            for name, t in this_round.items():
                pullback[ad].setdefault(name, []).append(t)
            m.set_profiling(False)
    blocks = {}
    for block in pullback["manual"]:
        man = statistics.median(pullback["manual"][block])
        cl = statistics.median(pullback["clad"][block])
        blocks[block] = {"manual_ms": 1e3 * man, "clad_ms": 1e3 * cl, "ratio": cl / man}
    man, cl = statistics.median(steps["manual"]), statistics.median(steps["clad"])
    return {"threads": threads, "blocks": blocks,
            "step": {"manual_ms": 1e3 * man, "clad_ms": 1e3 * cl, "ratio": cl / man,
                     "manual_all_ms": [1e3 * s for s in steps["manual"]],
                     "clad_all_ms": [1e3 * s for s in steps["clad"]]}}


def markdown(results: list[dict], title: str) -> str:
    """One row per block and one for the whole step; per thread count: manual ms, clad ms, ratio."""
    head = "| block pullback |" + "".join(
        f" {r['threads']}T manual ms | {r['threads']}T clad ms | {r['threads']}T clad / manual |" for r in results)
    lines = [f"### {title}", "", head, "|---|" + "---:|---:|---:|" * len(results)]
    for block in results[0]["blocks"]:
        row = f"| {block} |"
        for r in results:
            b = r["blocks"].get(block)
            row += f" {b['manual_ms']:.2f} | {b['clad_ms']:.2f} | {b['ratio']:.2f} |" if b else " | | |"
        lines.append(row)
    row = "| **full training step** |"
    for r in results:
        s = r["step"]
        row += f" {s['manual_ms']:.0f} | {s['clad_ms']:.0f} | **{s['ratio']:.3f}** |"
    lines += [row, ""]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    import zoo

    p = argparse.ArgumentParser(prog="python -m zoo.tools.bench_ad", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=7, help="timed steps per backend (default 7)")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write the results as JSON (benchmarks/ad-<preset>-b<B>-t<T>.json keeps the recorded runs)")
    a = p.parse_args(argv)
    if not zoo.build_info()["clad"]:
        print("zoo.tools.bench_ad: this zoo was built without the Clad backend (docs/clad.md)", file=sys.stderr)
        return 1
    cfg = zoo.preset(a.preset)
    results = [measure(cfg, a.batch_size, a.seq_len, t, a.rounds) for t in a.threads]
    info = zoo.build_info()
    cpu = cpu_info()["model"]
    title = (f"{a.preset}, B={a.batch_size}, T={a.seq_len}: medians of {a.rounds} rounds, the two backends "
             f"stepped in turn in one process ({info['compiler']}, Clad {info['clad_version']}; {cpu})")
    print(markdown(results, title))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        doc = {"preset": a.preset, "batch_size": a.batch_size, "seq_len": a.seq_len, "rounds": a.rounds,
               "compiler": info["compiler"], "clad_version": info["clad_version"], "cpu": cpu, "results": results}
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {a.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
