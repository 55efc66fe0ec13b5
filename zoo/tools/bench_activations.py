"""`python -m zoo.tools.bench_activations`: the MLP activations' loops alone (native/blocks/
activation.hpp), through the block API: the forward, the pullback, and the executor's fused
recompute-and-pullback, over --rows x --width inputs (default 3072 x 3072: GPT-2's 9.4M MLP
values of a 4 x 64 step) drawn from a normal distribution of --scale's width, on --threads
threads. Gated activations read rows of [gate | up], so their width is the input's and their
output is half as wide. A wide --scale (20) puts most values in the saturated tails, where a
value that came out denormal would cost the CPU's slow path.

Prints the fastest of --repeats calls of each, in ms and in ns a value per thread. A loop the
compiler left scalar shows as several ns a value where the vectorized ones take a fraction of
one. tools/cpu_class_check.sh runs it, and tools/compiler_check.sh runs it on builds by other
compilers. Each call returns a new array, which glibc would map afresh every time (arrays this
large are above its mmap threshold): its page faults would be timed too, about half of a call
on the machine of docs/benchmarks.md. So the command raises the threshold first (not main()
called in another program's process, which would keep its freed arrays too)."""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from functools import partial
from pathlib import Path


def keep_large_arrays_in_the_heap() -> bool:
    """glibc: no fresh mapping (and no page faults) per returned array. False elsewhere."""
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def best_ms(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None, outputs_in_heap: bool = False) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", nargs="+", default=None, help="activations (default: every registered one)")
    ap.add_argument("--rows", type=int, default=3072, help="input rows (default 3072)")
    ap.add_argument("--width", type=int, default=3072, help="input values a row, even (default 3072)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="the inputs' standard deviation: wider reaches the saturated tails (default 1)")
    ap.add_argument("--threads", type=int, default=2, help="(default 2)")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls of each, the fastest reported (default 7)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here (default: none)")
    a = ap.parse_args(argv)
    if a.rows < 1 or a.width < 2 or a.width % 2 or a.threads < 1 or a.repeats < 1 or not a.scale > 0:
        ap.error("--rows, --threads, --repeats and --scale must be positive, --width even and at least 2")

    import numpy as np

    import zoo
    from zoo.core import blocks
    from zoo.core.atomic import write_json
    from zoo.core.native import _native

    in_heap = outputs_in_heap and keep_large_arrays_in_the_heap()
    registered = blocks.activations()
    names = a.name or list(registered)
    unknown = [n for n in names if n not in registered]
    if unknown:
        ap.error(f"no activation {', '.join(unknown)}; registered: {', '.join(registered)}")
    zoo.set_threads(a.threads)
    build = zoo.build_info()
    hand_written = {b["name"] for b in build["blocks"] if b["manual"]}  # relu2 trains on Clad's pullback alone
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.rows, a.width), dtype=np.float32) * np.float32(a.scale)
    values = x.size
    print(f"{a.rows} x {a.width} inputs ({values / 1e6:.1f}M values, standard deviation {a.scale:g}), "
          f"{a.threads} threads, best of {a.repeats}; "
          f"zoo built by {build['compiler']}, vector path {build['gemm']['vector_isa']}; "
          f"load {os.getloadavg()[0]:.2f}{'' if in_heap else '; page faults timed too'}")
    print("| activation | forward ms | pullback ms | recompute + pullback ms | ns a value per thread (forward) |")
    print("|---|---:|---:|---:|---:|")
    results = {}
    api = _native.blocks
    for name in names:
        dy = np.ones((a.rows, a.width // registered[name]["gate_width"]), np.float32)
        r = {"forward_ms": best_ms(partial(api.activation_forward, name, x), a.repeats),
             "pullback_ms": None, "recompute_and_pullback_ms": None}
        if name in hand_written:
            r["pullback_ms"] = best_ms(partial(api.activation_pullback, name, x, dy), a.repeats)
            r["recompute_and_pullback_ms"] = best_ms(partial(api.activation_recompute_and_pullback, name, x, dy),
                                                     a.repeats)
        r["forward_ns_per_value_per_thread"] = r["forward_ms"] * 1e6 * a.threads / values
        results[name] = r
        cells = [f"{v:.2f}" if v is not None else "(no hand-written pullback)"
                 for v in (r["forward_ms"], r["pullback_ms"], r["recompute_and_pullback_ms"])]
        print(f"| {name} | {' | '.join(cells)} | {r['forward_ns_per_value_per_thread']:.2f} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(a.json, {"rows": a.rows, "width": a.width, "values": values, "scale": a.scale,
                            "threads": a.threads, "repeats": a.repeats, "outputs_in_heap": in_heap,
                            "compiler": build["compiler"], "gemm": build["gemm"], "activations": results})


if __name__ == "__main__":
    main(outputs_in_heap=True)
