"""The Clad backend against the hand-written pullbacks, side by side (docs/clad.md).

    python -m zoo.tools.bench_ad --preset gpt2 --batch-size 4 --seq-len 64 --threads 1 2 --rounds 7

Two models with the same weights, one with ad="manual" and one with ad="clad", stepped in
turn in one process so that both see the same load on a shared machine. Per block, the median
over rounds of the time its pullbacks take in one training step (the executor's block
profile; for cross-entropy, whose hand-written pullback is fused with the loss, loss and
adjoint together); then the median full training step (forward, pullbacks, AdamW) without
profiling.
Needs a zoo built with Clad; zoo bench --ad clad measures the Clad step alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional

import numpy as np

# Profile kinds (native/model.hpp) to the block names of ad=, where the model decides.
def _block_name(kind: str, cfg) -> str:
    return {"norm": cfg.norm, "activation": cfg.mlp}.get(kind, kind)


def _step(model, x, y) -> float:
    t0 = time.perf_counter()
    model.zero_grads()
    model.forward_backward(x, y)
    model.adamw_step(1e-4)
    return time.perf_counter() - t0


def measure(cfg, batch: int, seq_len: int, threads: int, rounds: int, warmup: int = 2, seed: int = 0) -> dict:
    import zoo

    zoo.set_threads(threads)
    models = {ad: zoo.Model(cfg, seed=seed, ad=ad) for ad in ("manual", "clad")}
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    for _ in range(warmup):
        for m in models.values():
            _step(m, x, y)
    pullback = {ad: {} for ad in models}  # ad -> block -> [seconds per round]
    for _ in range(rounds):
        for ad, m in models.items():
            m.set_profiling(True)
            _step(m, x, y)
            for kind, (fwd, back) in m.block_profile().items():
                # The hand-written cross-entropy computes the loss and its adjoint in one fused
                # pass (profiled as forward): compare loss plus adjoint for both backends.
                t = fwd + back if kind == "cross_entropy" else back
                if t > 0:
                    name = "cross_entropy (loss and adjoint)" if kind == "cross_entropy" else _block_name(kind, cfg)
                    pullback[ad].setdefault(name, []).append(t)
            m.set_profiling(False)
    steps = {ad: [] for ad in models}
    for _ in range(rounds):
        for ad, m in models.items():
            steps[ad].append(_step(m, x, y))
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
    lines = [f"### {title}", ""]
    for r in results:
        lines += [f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}:", "",
                  "| block pullback | manual ms | clad ms | clad / manual |", "|---|---:|---:|---:|"]
        for block, b in r["blocks"].items():
            lines.append(f"| {block} | {b['manual_ms']:.2f} | {b['clad_ms']:.2f} | {b['ratio']:.2f} |")
        s = r["step"]
        lines += [f"| **full training step** | {s['manual_ms']:.0f} | {s['clad_ms']:.0f} | **{s['ratio']:.3f}** |", ""]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    import zoo

    p = argparse.ArgumentParser(prog="python -m zoo.tools.bench_ad", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=7, help="timed steps per backend (default 7)")
    p.add_argument("--json", metavar="FILE", default=None)
    a = p.parse_args(argv)
    if not zoo.build_info()["clad"]:
        print("zoo.tools.bench_ad: this zoo was built without the Clad backend (docs/clad.md)", file=sys.stderr)
        return 1
    cfg = zoo.preset(a.preset)
    results = [measure(cfg, a.batch_size, a.seq_len, t, a.rounds) for t in a.threads]
    title = (f"{a.preset}, B={a.batch_size}, T={a.seq_len}: medians of {a.rounds} rounds, "
             f"the two backends stepped in turn in one process ({zoo.build_info()['compiler']})")
    print(markdown(results, title))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"preset": a.preset, "batch_size": a.batch_size, "seq_len": a.seq_len, "results": results}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
