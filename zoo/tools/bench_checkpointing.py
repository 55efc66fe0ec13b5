"""Activation checkpointing against stored activations, side by side in one process: the
activation arena each plans and the median training step of each, stepped in turn.

    python -m zoo.tools.bench_checkpointing --preset gpt2 --batch-size 4 --seq-len 64
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import zoo
from zoo.model import activation_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.tools.bench_checkpointing", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode, after one warm-up step")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        zoo.set_threads(args.threads)
    cfg = zoo.preset(args.preset)
    B, T = args.batch_size, args.seq_len
    models = {on: zoo.Model(cfg, seed=0, checkpointing=on) for on in (False, True)}
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(args.steps + 1):
        for on, model in models.items():
            t0 = time.perf_counter()
            model.zero_grads()
            model.forward_backward(x, y)
            model.adamw_step(1e-4, 0.9, 0.999, 1e-8, 0.1, 1.0)
            if step:  # the first step of each faults in its pages
                times[on].append(time.perf_counter() - t0)
    mib = {on: activation_bytes(cfg, B, T, on) / 2**20 for on in (False, True)}
    ms = {on: 1000 * float(np.median(times[on])) for on in (False, True)}
    print(f"{args.preset}, batch {B} x {T}, {zoo.get_threads()} threads, median of {args.steps} steps each")
    print("| activations | arena MiB | step ms |")
    print("|---|---:|---:|")
    for on in (False, True):
        print(f"| {'checkpointed' if on else 'stored'} | {mib[on]:,.1f} | {ms[on]:,.0f} |")
    print(f"activation memory {mib[False] / mib[True]:.2f}x smaller, step time {ms[True] / ms[False]:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
