"""Times zoo's training step in two builds side by side: the zoo this Python imports, and
another build of zoo in a package root of its own (for example main before a change). Each
round runs both in turn, one process each, so a drifting machine slows both alike; the step
is zoo bench's (zero_grads, forward_backward, adamw_step with clipping) on zoo.Model(preset,
seed=0) and a fixed token batch.

    python -m zoo.tools.bench_ab --base /tmp/zoo-base --preset gpt2 --batch-size 4 --seq-len 64 \\
        --steps 10 --rounds 3 --json ab.json

--lora R trains LoRA adapters of rank R over a frozen base (--base-dtype, bf16 by default)
instead of the whole model; --current ROOT puts a second built root in place of this checkout,
so any two commits can be compared.

On a machine other jobs share, wall-clock steps move with the load; --clock cpu compares the
CPU time each step's process used instead (time.process_time(), all its threads together),
which moves far less (with --threads 1 it is the step's own work).

The base root is a folder holding a `zoo/` package with its native module built in place
(docs/benchmarks.md shows how to make one from a commit). It is imported with `python -S`, the
root first on sys.path, so an editable install of this checkout cannot redirect `import zoo`.
Only the API both builds share is used: zoo.preset, zoo.Model and its step methods.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Optional


def step_times(preset: str, batch: int, seq_len: int, steps: int, warmup: int, lora_rank: int = 0,
               base_dtype: str = "bf16", precision: str = "fp32") -> dict:
    """In the worker process: zoo's step times (seconds) and losses, of the whole model trained,
    or of LoRA adapters of rank lora_rank over a frozen base stored as base_dtype, the products in
    the given precision. The timing loop is this module's own, not bench_torch.timed_steps: the
    worker imports the base build's zoo, whose tools may predate it."""
    import numpy as np

    import zoo

    cfg = zoo.preset(preset)
    if lora_rank:
        model = zoo.Model(cfg, seed=0, precision=precision, lora=zoo.LoraConfig(r=lora_rank), base_dtype=base_dtype)
    else:
        model = zoo.Model(cfg, seed=0, precision=precision)
    data = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, seq_len + 1)).astype(np.int32)
    x, y = np.ascontiguousarray(data[:, :-1]), np.ascontiguousarray(data[:, 1:])

    def step() -> float:
        model.zero_grads()
        loss = model.forward_backward(x, y)
        model.adamw_step(1e-4, 0.9, 0.95, 1e-8, 0.1, 1.0)
        return loss

    losses = [step() for _ in range(warmup)]  # every step's loss, the untimed ones too
    times, cpu_times = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        cpu_times.append(time.process_time() - c0)
        times.append(time.perf_counter() - t0)
    return {"step_s": times, "cpu_s": cpu_times, "losses": losses, "zoo": str(Path(zoo.__file__).parent)}


def _max_rel_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b)), default=0.0)


def _losses_verdict(r: dict) -> str:
    """identical, or how far apart: the first step's loss is the forward alone (before any
    update), so a difference only after it is the pullback or the optimizer rounding otherwise."""
    if r["same_losses"]:
        return "identical"
    first = "first step identical" if r["first_loss_same"] else "first step differs"
    return f"NO: max relative difference {r['max_loss_rel_diff']:.1e} ({first})"


def _worker(argv: list[str]) -> int:
    a = argparse.ArgumentParser()
    a.add_argument("--root", default="")
    a.add_argument("--preset")
    a.add_argument("--batch-size", type=int)
    a.add_argument("--seq-len", type=int)
    a.add_argument("--steps", type=int)
    a.add_argument("--warmup", type=int)
    a.add_argument("--lora", type=int)
    a.add_argument("--base-dtype")
    a.add_argument("--precision", default="fp32")
    a.add_argument("--site-packages", default="")
    args = a.parse_args(argv)
    if args.root:  # started with -S: the root first, then this environment's packages (numpy ...)
        sys.path.insert(0, args.root)
        sys.path.append(args.site_packages)
    print(json.dumps(step_times(args.preset, args.batch_size, args.seq_len, args.steps, args.warmup, args.lora,
                                  args.base_dtype, args.precision)))
    return 0


def _run(root: Optional[str], args, threads: int, label: str) -> dict:
    cmd = [sys.executable] + (["-S"] if root else []) + [os.path.abspath(__file__), "--worker",
                                                          "--root", root or "", "--preset", args.preset,
                                                          "--batch-size", str(args.batch_size),
                                                          "--seq-len", str(args.seq_len), "--steps", str(args.steps),
                                                          "--warmup", str(args.warmup), "--lora", str(args.lora),
                                                          "--base-dtype", args.base_dtype,
                                                          "--precision", args.precision,
                                                          "--site-packages", sysconfig.get_paths()["purelib"]]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, env=env, cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-10:])
        raise SystemExit(f"bench_ab: the {label} build failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return _worker(argv[1:])
    p = argparse.ArgumentParser(prog="python -m zoo.tools.bench_ab", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base", required=True, help="package root of the other build (holds zoo/ with its compiled core)")
    p.add_argument("--current", default=None, metavar="ROOT",
                   help="a package root built the same way to stand for 'current' instead of this checkout "
                        "(two commits side by side, for example to find which commit changed the losses)")
    p.add_argument("--preset", default="gpt2", help="a named architecture")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=3, help="processes per build, in turn")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="train LoRA adapters of rank R over a frozen base instead of the whole model (0: whole)")
    p.add_argument("--base-dtype", choices=("fp32", "bf16", "int8", "nf4"), default="bf16",
                   help="with --lora: how the frozen base is stored")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="the products' precision")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads for both")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="compare wall-clock step times, or the CPU time of the step's process")
    p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    base = os.path.abspath(args.base)
    current = os.path.abspath(args.current) if args.current else None
    for flag, root in (("--base", base), ("--current", current)):
        if root and not (Path(root) / "zoo" / "__init__.py").is_file():
            raise SystemExit(f"bench_ab: {flag} {root}: no zoo package there (docs/benchmarks.md: making a base build)")
    rounds = []
    for r in range(args.rounds):
        print(f"bench_ab: round {r + 1} of {args.rounds} ...", file=sys.stderr, flush=True)
        before, after = _run(base, args, args.threads, "base"), _run(current, args, args.threads, "current")
        key = "step_s" if args.clock == "wall" else "cpu_s"
        rounds.append({"base_ms": 1000 * statistics.median(before[key]),
                       "current_ms": 1000 * statistics.median(after[key]),
                       "same_losses": before["losses"] == after["losses"],
                       "first_loss_same": before["losses"][:1] == after["losses"][:1],
                       "max_loss_rel_diff": _max_rel_diff(before["losses"], after["losses"]),
                       "base_losses": before["losses"], "current_losses": after["losses"],
                       "base_zoo": before["zoo"], "current_zoo": after["zoo"]})
    what = (f", LoRA r={args.lora} over a {args.base_dtype} base" if args.lora else "") + f", {args.precision}"
    print(f"\n{args.preset}{what}, batch {args.batch_size} x {args.seq_len}, {args.threads} threads, "
          f"median of {args.steps} steps per process, {'wall-clock' if args.clock == 'wall' else 'CPU'} time\n")
    print("| round | base ms | current ms | current / base | losses, every step |\n|---:|---:|---:|---:|---|")
    for i, r in enumerate(rounds, 1):
        print(f"| {i} | {r['base_ms']:,.1f} | {r['current_ms']:,.1f} | {r['current_ms'] / r['base_ms']:.3f}x | "
              f"{_losses_verdict(r)} |")
    ratio = statistics.fmean(r["current_ms"] for r in rounds) / statistics.fmean(r["base_ms"] for r in rounds)
    print(f"\ncurrent / base, mean of the round medians: {ratio:.3f}x")
    print(f"base: {rounds[0]['base_zoo']}\ncurrent: {rounds[0]['current_zoo']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "batch": args.batch_size,
                                               "seq_len": args.seq_len, "lora": args.lora,
                                               "base_dtype": args.base_dtype if args.lora else None,
                                               "precision": args.precision, "threads": args.threads, "clock": args.clock,
                                               "steps": args.steps, "rounds": rounds, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
