"""The zoo side of `python -m zoo.tools.bench_lora`, one process per run
(`python -m zoo.tools.bench_lora_worker ...`): LoRA training steps over a frozen base of random
weights (zoo's init at the preset's shape) in bf16, int8 or nf4.

It reads the work folder bench_lora wrote (manifest.json: zoo's config, the batch shape, the
LoRA and optimizer settings; tokens.bin, as bench_lora_torch.py reads them) and writes its
result as JSON to --out. A step: zero grads, forward, cross-entropy, backward, AdamW with
global-norm clipping, over the adapters only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from .bench_torch import _peak_rss_mib, _rss_now_mib, read_manifest, read_tokens, timed_steps
from .bench_worker import cpu_info


def run(workdir: str, base_dtype: str, checkpointing: bool, steps: int, warmup: int, threads: int,
        profile: bool = False, checkpoint: str | None = None, packed_base: bool = False) -> dict:
    rss_start = _rss_now_mib()
    import numpy as np

    import zoo
    from zoo.arch.config import ModelConfig
    from zoo.arch.lora import LoraConfig, default_precision
    from zoo.core.native import _native

    zoo.set_threads(threads)
    rss_imported = _rss_now_mib()
    manifest = read_manifest(workdir)
    B, T, o, lora = manifest["batch"], manifest["seq_len"], manifest["optimizer"], manifest["lora"]
    t0 = time.perf_counter()
    cfg = ModelConfig(**manifest["config"])
    settings = dict(checkpointing=checkpointing, base_dtype=base_dtype, precision=default_precision(base_dtype),
                    lora=LoraConfig(r=lora["r"], alpha=lora["alpha"], dropout=lora["dropout"],
                                    targets=lora["targets"]))
    if checkpoint is None:
        model = zoo.Model(cfg, seed=0, **settings)
    else:  # as a user loads one (a bf16 base maps an untied token embedding from the file)
        model = zoo.Model.from_pretrained(checkpoint, **settings)
        if model.config != cfg:
            raise ValueError(f"{checkpoint}: its config.json reads back as a model other than the manifest's")
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    packed_bytes = model.set_packed_base(True) if packed_base else 0
    pack_s = time.perf_counter() - t0
    rss_built = _rss_now_mib()
    data = read_tokens(workdir, B, T)
    x, y = np.ascontiguousarray(data[:, :-1]), np.ascontiguousarray(data[:, 1:])

    def step() -> float:
        model.zero_grads()
        loss = model.forward_backward(x, y)
        model.adamw_step(o["lr"], o["beta1"], o["beta2"], o["eps"], o["weight_decay"], o["max_grad_norm"])
        return loss

    times, losses = timed_steps(step, steps, warmup,
                                after_warmup=(lambda: model.set_profiling(True)) if profile else None)
    blocks = {k: list(v) for k, v in model.block_profile().items()} if profile else None
    return {
        "blocks_s": blocks, "profiled": profile,
        "step_s": times, "losses": losses, "median_s": statistics.median(times), "build_s": build_s,
        "packed_base_bytes": packed_bytes, "pack_s": pack_s,
        "peak_rss_mib": _peak_rss_mib(), "rss_start_mib": rss_start, "rss_after_import_mib": rss_imported,
        "rss_after_build_mib": rss_built, "threads": zoo.get_threads(), "checkpoint": checkpoint,
        "arena_bytes": model.arena_bytes(),
        "trainable_params": sum(p.size for p in model.parameters().values()),
        "implementation": f"zoo {zoo.__version__}: {base_dtype} base, fp32 adapters, {model.precision} matmuls"
                          + (", checkpointing" if checkpointing else "")
                          + (", base packed for the input gradients" if packed_base else ""),
        "gemm": zoo.gemm_info(), "cpu": cpu_info(),
        # Every product the steps ran on oneDNN, with the kernel oneDNN picked for it.
        "kernels_used": _native.gemm_kernels_used(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="bench_lora's zoo worker (run by zoo.tools.bench_lora)")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--base", choices=["fp32", "bf16", "int8", "nf4"], required=True)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--profile", action="store_true", help="time every block (the executor's profile)")
    ap.add_argument("--checkpoint", default=None, help="load the base from this checkpoint folder")
    ap.add_argument("--packed-base", action="store_true", help="a bf16 base packed for its input gradients")
    ap.add_argument("--out", required=True, help="where to write the result (JSON)")
    a = ap.parse_args(argv)
    try:
        result = run(a.workdir, a.base, a.checkpointing, a.steps, a.warmup, a.threads, a.profile, a.checkpoint,
                     a.packed_base)
    except ValueError as e:  # a setting this zoo cannot honour: one line for the parent to show
        print(f"zoo bench_lora worker: {e}", file=sys.stderr)
        return 3
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
