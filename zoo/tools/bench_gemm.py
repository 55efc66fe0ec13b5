"""`python -m zoo.tools.bench_gemm`: the GEMM libraries built into zoo, compared on the matrix
products of one model's training step, on this CPU.

Every matrix product of zoo goes through native/kernels/gemm.cpp. Its fp32 products run on one of the
libraries built in (OpenBLAS always; oneMKL and oneDNN where their wheels were installed at build
time), chosen once per process: zoo.set_gemm_library, or ZOO_GEMM. Its default rule
(default_fp32_library) was set by measurement: this tool is that measurement, so that the rule
can be checked on any CPU. bf16 products (operands rounded to bf16, fp32 accumulation) run on
oneDNN, where the CPU has bf16 dot products.

What it measures. A step multiplies, per layer, four linear layers (x (N, in) by W (out, in),
N = batch x seq_len rows):

  qkv       d_model -> (n_head + 2 n_kv_head) head_dim
  attn_out  n_head head_dim -> d_model
  mlp_in    d_model -> gate_width d_ff   (gate_width 2 for a gated MLP such as SwiGLU)
  mlp_out   d_ff -> d_model

and once the LM head (d_model -> vocab_size). Each linear layer makes three products, as
native/blocks/linear.hpp runs them:

  forward   y  = x W^T     M, N, K = rows, out, in    trans_b
  dx        dx = dy W      M, N, K = rows, in, out    no transposes
  dW        dW += dy^T x   M, N, K = out, in, rows    trans_a, added into dW

Each distinct shape (layers of the same in -> out merged) and product is timed on every fp32
library built in and in bf16 (where the CPU has bf16 dot products, or with --bf16-emulated where
oneDNN emulates them): one warm-up call (oneDNN makes its primitive then), then calls until
--min-seconds have passed (at least 3); the rate is 2 M N K / the median call. The same
float32 operands (standard normal, fixed seed) serve every library. Measure on an otherwise idle
machine: with another process busy on one of two cores, OpenBLAS's median call ran at a tenth
of its best, oneMKL's and oneDNN's (OpenMP threads) at half. The JSON keeps each best call too
(gflops_best): a best far above the median says the cores were shared.

All three products are added into an output allocated once (beta = 1). The native binding
allocates a fresh output for each call otherwise, and the page faults of a fresh 200 MB output
(the LM head's) cost 8-14% of its time, which a training step never pays: zoo's outputs live in
an arena it reuses, and its forward adds into them wherever the layer has a bias or a residual.

The whole-step rate of a column is the step's GEMM FLOPs over the step's GEMM time, each shape
weighted by how many times a step runs it (n_layer for a layer's shape, once for the head).
Attention's own products (QK^T, PV) are not linear layers and are not counted here.

The fastest fp32 library by that rate is printed beside the one zoo picks by default here
(gemm_info()["fp32_default"]), with the CPU as /proc/cpuinfo and oneDNN see it. A Markdown
table goes to stdout (progress to stderr), and the same numbers as JSON to --json FILE. The
library choice is set back to "auto" (and the thread count to what it was) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np

PRODUCTS = ("forward", "dx", "dW")
MIN_REPS = 3


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_description() -> dict:
    """Model name, vendor and the bf16 flags of the first CPU in /proc/cpuinfo ("unknown" where
    it is missing: not Linux, or an architecture that names them otherwise)."""
    from ..core.gemm import cpu_fields

    fields = cpu_fields()
    flags = fields.get("flags", "").split()
    bf16_flags = [flag for flag in flags if "bf16" in flag or flag == "avx_ne_convert"]
    return {"model_name": fields.get("model name", "unknown"), "vendor": fields.get("vendor_id", "unknown"),
            "bf16_flags": bf16_flags}


def linear_shapes(cfg) -> list[dict]:
    """Every distinct linear layer shape (in, out) of a step, with how many times a step runs
    it (zoo.core.gemm.linear_shapes)."""
    from ..core.gemm import linear_shapes as shapes

    return shapes(cfg)


def linear_products(x, w, dy) -> dict[str, tuple]:
    """The three products of a linear layer x (rows, in) by w (out, in), with dy (rows, out),
    as native/blocks/linear.hpp runs them: {product: (a, b, trans_a, trans_b, M, N, K)}, a and
    b as stored."""
    rows, n_in = x.shape
    n_out = w.shape[0]
    return {
        "forward": (x, w, False, True, rows, n_out, n_in),  # y = x W^T
        "dx": (dy, w, False, False, rows, n_in, n_out),  # dx = dy W
        "dW": (dy, x, True, False, n_out, n_in, rows),  # dW += dy^T x
    }


def kernel_run(precision: str, M: int, N: int, K: int) -> str:
    """The kernel the calls since the last reset of zoo's record ran on: oneDNN's own name for
    its implementation (the record of the products it ran), or the fp32 library's name."""
    import zoo
    from zoo.core.native import _native

    used = [u["kernel"] for u in _native.gemm_kernels_used() if (u["M"], u["N"], u["K"]) == (M, N, K)]
    if used:
        return used[0]

    return zoo.gemm_info()["fp32"] if precision == "fp32" else "unknown"


def time_product(call, min_seconds: float) -> dict:
    """One warm-up call, then calls until min_seconds have passed (at least MIN_REPS)."""
    call()
    times = []
    start = time.perf_counter()
    while len(times) < MIN_REPS or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return {"seconds_median": statistics.median(times), "seconds_best": min(times), "reps": len(times)}


def measure(preset_name: str, batch: int, seq_len: int, threads: int, bf16_emulated: bool,
            min_seconds: float) -> dict:
    import zoo
    from zoo.core.native import _native, threads_set_to
    from zoo.arch.presets import preset

    cfg = preset(preset_name)
    rows = batch * seq_len
    info = zoo.gemm_info()  # applies ZOO_GEMM first, if set: this tool then switches explicitly
    cpu = cpu_description()

    # The columns: every fp32 library built in, then bf16 where it can run (or is asked for).
    columns = list(info["built_in"])
    if info["bf16"] is None:
        bf16_note = "bf16: not measured (this zoo was built without oneDNN)"
    elif info["bf16_native"]:
        columns.append("bf16")
        bf16_note = "bf16: oneDNN on the CPU's bf16 dot products"
    elif bf16_emulated:
        columns.append("bf16")
        bf16_note = "bf16: oneDNN's emulation (--bf16-emulated): this CPU has no bf16 dot products"
    else:
        bf16_note = ("bf16: not measured (this CPU has no bf16 dot products; --bf16-emulated measures "
                     "oneDNN's emulation)")

    rng = np.random.default_rng(0)
    results = []
    with threads_set_to(threads):
        try:
            for shape in linear_shapes(cfg):
                n_in, n_out = shape["in"], shape["out"]
                print(f"measuring {shape['layer']} ({n_in} -> {n_out}) ...", file=sys.stderr, flush=True)
                x = rng.standard_normal((rows, n_in), dtype=np.float32)
                w = rng.standard_normal((n_out, n_in), dtype=np.float32)
                dy = rng.standard_normal((rows, n_out), dtype=np.float32)
                products = linear_products(x, w, dy)
                for product in PRODUCTS:
                    a, b, trans_a, trans_b, M, N, K = products[product]
                    c = np.zeros((M, N), dtype=np.float32)  # the output, allocated once (beta = 1)
                    flops = 2.0 * M * N * K
                    row = {**shape, "product": product, "M": M, "N": N, "K": K, "trans_a": trans_a,
                           "trans_b": trans_b, "flops": flops, "results": {}}
                    for column in columns:
                        if column == "bf16":
                            precision = "bf16"
                        else:
                            precision = "fp32"
                            zoo.set_gemm_library(column)

                        def call():
                            _native.gemm(a, b, trans_a, trans_b, precision=precision, c=c,
                                         allow_emulated=bf16_emulated)

                        _native.gemm_kernels_used(reset=True)
                        timing = time_product(call, min_seconds)
                        timing["gflops"] = flops / timing["seconds_median"] / 1e9
                        timing["gflops_best"] = flops / timing["seconds_best"] / 1e9  # JSON only
                        timing["kernel"] = kernel_run(precision, M, N, K)
                        timing["bf16_kernel"] = _native.is_bf16_kernel(timing["kernel"])
                        row["results"][column] = timing
                    results.append(row)
        finally:
            zoo.set_gemm_library("auto")

    # The whole step: each shape's time weighted by how many times a step runs it.
    step = {}
    for column in columns:
        flops = sum(r["count"] * r["flops"] for r in results)
        seconds = sum(r["count"] * r["results"][column]["seconds_median"] for r in results)
        step[column] = {"flops": flops, "seconds": seconds, "gflops": flops / seconds / 1e9}
    fp32_columns = [c for c in columns if c != "bf16"]
    fastest = max(fp32_columns, key=lambda c: step[c]["gflops"])
    default = zoo.gemm_info()["fp32_default"]
    return {
        "schema": "zoo-bench-gemm/1", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "preset": preset_name, "batch_size": batch, "seq_len": seq_len, "rows": rows, "threads": threads,
        "min_seconds": min_seconds, "zoo_version": zoo.__version__,
        "cpu": {**cpu, "cpuid_vendor": info["cpu_vendor"], "onednn_isa": info["onednn_isa"],
                "bf16_native": info["bf16_native"]},
        "gemm_info": info, "columns": columns, "bf16_emulated": "bf16" in columns and not info["bf16_native"],
        "bf16_note": bf16_note, "measurements": results, "step": step,
        "fastest_fp32": fastest, "default_fp32": default, "default_is_fastest": default == fastest,
        "default_vs_fastest": step[default]["gflops"] / step[fastest]["gflops"],
        "library_after": zoo.gemm_info()["fp32"],
    }


def render(r: dict) -> str:
    columns = r["columns"]
    labels = [c + (" (emulated)" if c == "bf16" and r["bf16_emulated"] else "") for c in columns]
    has_bf16 = "bf16" in columns
    lines = [
        f"## GEMM libraries: {r['preset']}, {r['batch_size']} x {r['seq_len']} = {r['rows']} rows, "
        f"{r['threads']} threads",
        "",
        "GFLOP/s (2 M N K / median call); the fastest fp32 library of each row in bold.",
        "",
        "| layer | in -> out | product | M x N x K | per step | " + " | ".join(labels)
        + (" | bf16 kernel |" if has_bf16 else " |"),
        "|---|---|---|---|---:|" + "---:|" * len(columns) + ("---|" if has_bf16 else ""),
    ]
    for row in r["measurements"]:
        fp32 = {c: row["results"][c]["gflops"] for c in columns if c != "bf16"}
        best = max(fp32, key=fp32.get)
        cells = []
        for c in columns:
            value = f"{row['results'][c]['gflops']:.1f}"
            cells.append(f"**{value}**" if c == best else value)
        line = (f"| {row['layer']} | {row['in']} -> {row['out']} | {row['product']} | "
                f"{row['M']} x {row['N']} x {row['K']} | {row['count']} | " + " | ".join(cells) + " |")
        if has_bf16:
            line += f" {row['results']['bf16']['kernel']} |"
        lines.append(line)
    step = r["step"]
    fastest, default = r["fastest_fp32"], r["default_fp32"]
    lines += [
        "",
        "Whole step (each shape weighted by the times a step runs it: n_layer per layer shape, "
        "once for the head):",
        "",
        "| | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * len(columns),
        "| GEMM GFLOP per step | " + " | ".join(f"{step[c]['flops'] / 1e9:.4g}" for c in columns) + " |",
        "| GEMM ms per step | " + " | ".join(f"{step[c]['seconds'] * 1e3:.1f}" for c in columns) + " |",
        "| GFLOP/s | " + " | ".join(f"{step[c]['gflops']:.1f}" for c in columns) + " |",
        f"| vs {fastest} | " + " | ".join(f"{step[c]['gflops'] / step[fastest]['gflops']:.2f}" for c in columns)
        + " |",
        "",
        f"- fastest fp32 library: {fastest} ({step[fastest]['gflops']:.1f} GFLOP/s)",
        f"- zoo's default here: {default} ("
        + ("agrees" if r["default_is_fastest"] else f"disagrees: {r['default_vs_fastest']:.2f}x the fastest")
        + ")",
        f"- {r['bf16_note']}",
    ]
    if has_bf16:
        on_bf16 = sum(row["results"]["bf16"]["bf16_kernel"] for row in r["measurements"])
        lines.append(f"- bf16 products on kernels with bf16 dot products (as run): {on_bf16} of "
                     f"{len(r['measurements'])}" + ("" if on_bf16 == len(r["measurements"]) else
                                                    ": the others run no faster than fp32 here"))
    lines += [
        f"- CPU: {r['cpu']['model_name']} ({r['cpu']['vendor']}); oneDNN ISA: {r['cpu']['onednn_isa'] or 'none'}; "
        f"bf16 flags: {' '.join(r['cpu']['bf16_flags']) or 'none'}; bf16 native: "
        f"{'yes' if r['cpu']['bf16_native'] else 'no'}",
        f"- zoo {r['zoo_version']}, {r['threads']} threads, at least {r['min_seconds']} s per measurement; "
        f"library after the run: {r['library_after']} (auto)",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    from zoo.arch.presets import PRESETS

    p = argparse.ArgumentParser(prog="python -m zoo.tools.bench_gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2", choices=[x.name for x in PRESETS])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=default_threads(), help="default: every usable CPU")
    p.add_argument("--bf16-emulated", action="store_true",
                   help="measure bf16 even where the CPU has no bf16 dot products (oneDNN emulates them)")
    p.add_argument("--min-seconds", type=float, default=0.25,
                   help="time each product for at least this long, and at least 3 calls (default 0.25)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    a = p.parse_args(argv)
    if a.batch_size < 1 or a.seq_len < 1 or a.threads < 1:
        p.error("--batch-size, --seq-len and --threads must be at least 1")
    try:
        r = measure(a.preset, a.batch_size, a.seq_len, a.threads, a.bf16_emulated, a.min_seconds)
    except ValueError as e:  # ZOO_GEMM naming a library this zoo lacks
        print(f"bench_gemm: {e}", file=sys.stderr)
        return 2
    print(render(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
