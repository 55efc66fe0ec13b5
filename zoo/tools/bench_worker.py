"""The zoo side of `zoo bench`, one process per run (`python -m zoo.tools.bench_worker ...`).

--mode time:    warm-up steps, then timed training steps; peak RSS of this process; then,
                with the model freed, the GEMM rate at the model's largest product (the LM
                head forward) in the precision under test (fp32: zoo's own linear_forward;
                bf16: _native.gemm in bf16), seconds after the timed steps, so that both see
                the machine in the same state.
--mode profile: the same steps with zoo's per-block profiling on (a separate process, so the
                timed run carries no profiling overhead).

--precision fp32|bf16 is zoo.Model's precision of the matrix products. Both modes also report
the GEMM libraries and the LM head's kernel as this process ran them, and the CPU's
bf16-relevant flags, so the report says what ran rather than what the parent would pick.

It reads the work folder `zoo bench` wrote (manifest.json, weights.bin, tokens.bin; see
bench_torch.py) and writes its result as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# The PyTorch worker runs bench_torch.py by path (it never imports zoo); zoo's worker shares
# its memory probes.
from .bench_torch import _peak_rss_mib, _rss_now_mib, read_manifest, read_tokens, timed_steps


# The /proc/cpuinfo flags that decide how bf16 (and fp32) products can run.
CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx_ne_convert", "avx512f", "avx2")


def cpu_info() -> dict:
    """The CPU's model name and which of CPU_FLAGS it has, from /proc/cpuinfo (Linux)."""
    name, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name is None:
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": name, "flags": [f for f in CPU_FLAGS if f in flags]}


def timed_step(model, x, y) -> float:
    """Seconds of one training step as a user runs it (zero_grads, forward_backward, adamw_step):
    the unit of the side-by-side tools (bench_ad, bench_layer, bench_variants)."""
    t0 = time.perf_counter()
    model.zero_grads()
    model.forward_backward(x, y)
    model.adamw_step(1e-4)
    return time.perf_counter() - t0


def load_model(workdir: str, manifest: dict, ad: str, checkpointing: bool, precision: str):
    import zoo
    from zoo.arch.config import ModelConfig

    cfg = ModelConfig(**manifest["config"])
    model = zoo.Model(cfg, seed=None, ad=ad, checkpointing=checkpointing, precision=precision)
    params = model.parameters()
    with open(os.path.join(workdir, "weights.bin"), "rb", buffering=0) as f:
        for p in manifest["params"]:  # straight into the arena, no intermediate copies
            f.seek(4 * p["offset"])
            buf = memoryview(params[p["name"]]).cast("B")
            got = 0
            while got < len(buf):
                got += f.readinto(buf[got:])
    return model


def measure_sgemm(m: int, k: int, n: int, precision: str = "fp32", min_seconds: float = 0.5,
                  min_reps: int = 3) -> dict:
    """x (m, k) times W (n, k) transposed at one shape: fp32 through zoo's linear_forward (no
    bias), bf16 through _native.gemm (operands rounded to bf16, fp32 accumulation)."""
    import numpy as np

    from zoo.core.native import _native

    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02)
    if precision == "fp32":
        def product():
            _native.blocks.linear_forward(x, w, None)
    else:
        def product():
            _native.gemm(x, w, False, True, precision)
    product()  # warm-up: pages, thread pool, oneDNN's kernel build
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_seconds and len(times) < 200):
        t0 = time.perf_counter()
        product()
        times.append(time.perf_counter() - t0)
    flops = 2.0 * m * k * n
    return {"precision": precision, "m": m, "k": k, "n": n, "reps": len(times), "flops": flops,
            "gflops_median": flops / statistics.median(times) / 1e9, "gflops_best": flops / min(times) / 1e9}


def run(workdir: str, mode: str, steps: int, warmup: int, threads: int, ad: str, checkpointing: bool,
        precision: str = "fp32") -> dict:
    rss_start = _rss_now_mib()
    import numpy as np

    import zoo
    from zoo.core.native import _native

    zoo.set_threads(threads)
    rss_imported = _rss_now_mib()
    manifest = read_manifest(workdir)
    B, T, o = manifest["batch"], manifest["seq_len"], manifest["optimizer"]
    model = load_model(workdir, manifest, ad, checkpointing, precision)
    data = read_tokens(workdir, B, T)
    x, y = np.ascontiguousarray(data[:, :-1]), np.ascontiguousarray(data[:, 1:])

    def step() -> float:
        model.zero_grads()
        loss = model.forward_backward(x, y)
        model.adamw_step(o["lr"], o["beta1"], o["beta2"], o["eps"], o["weight_decay"], o["max_grad_norm"])
        return loss

    times, losses = timed_steps(step, steps, warmup,
                                after_warmup=(lambda: model.set_profiling(True)) if mode == "profile" else None)
    peak = _peak_rss_mib()
    activation_error = None
    try:  # the planned activation arena: informative only, never a reason to lose the timings
        activation_mib = model.activation_bytes(B, T) / 2**20
    except Exception as e:
        activation_mib, activation_error = None, f"{type(e).__name__}: {e}"
    out = {"step_s": times, "losses": losses, "peak_rss_mib": peak, "rss_start_mib": rss_start,
           "rss_after_import_mib": rss_imported, "threads": zoo.get_threads(), "activation_mib": activation_mib,
           "activation_error": activation_error,
           "implementation": f"zoo {zoo.__version__} ({precision} matmuls, ad={ad}"
                             f"{', checkpointing' if checkpointing else ''})",
           "build_info": zoo.build_info(), "precision": model.precision,
           # Read after the model was made (ZOO_GEMM applies then): what this process ran on.
           "gemm": zoo.gemm_info(), "cpu": cpu_info()}
    cfg = manifest["config"]
    # The LM head forward: x (B*T, d_model) times W (vocab, d_model) transposed.
    out["gemm_kernel"] = _native.gemm_kernel(precision, False, True, B * T, cfg["vocab_size"], cfg["d_model"])
    # Every oneDNN product the steps ran, with the kernel oneDNN picked for it (fp32 products on
    # OpenBLAS or oneMKL are not listed: their library is the kernel).
    out["kernels_used"] = _native.gemm_kernels_used()
    if mode == "profile":
        out["blocks_s"] = {k: list(v) for k, v in model.block_profile().items()}
        model.set_profiling(False)
    else:  # after the peak RSS was read: the sgemm arrays do not count towards it
        del model  # nor need they sit beside the arena
        out["sgemm"] = measure_sgemm(B * T, cfg["d_model"], cfg["vocab_size"], precision)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="zoo bench's zoo worker (run by zoo bench)")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--mode", choices=["time", "profile"], default="time")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--ad", default="manual")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--out", required=True, help="where to write the result (JSON)")
    a = ap.parse_args(argv)
    try:
        result = run(a.workdir, a.mode, a.steps, a.warmup, a.threads, a.ad, a.checkpointing, a.precision)
    except ValueError as e:  # a setting this zoo cannot honour: one line for the parent to show
        print(f"zoo bench worker: {e}", file=sys.stderr)
        return 3
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
