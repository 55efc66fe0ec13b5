"""The PyTorch side of `zoo bench`: the worker that times a training step of the PyTorch
reference model (torch_reference.py, next to this file: zoo's architecture space written
independently as an nn.Module).

This file is run by path (`python .../zoo/tools/bench_torch.py ...`), not with -m, so the
measured process holds PyTorch alone: it imports neither zoo nor its native core (whose BLAS
threads and memory would otherwise be counted against PyTorch); run by path, its own folder
is sys.path[0], where it finds torch_reference. It reads what `zoo bench` wrote into its work
folder: manifest.json (the config, the batch shape, the optimizer settings and zoo's parameter
layout), weights.bin (every parameter as float32, in zoo's arena order, which is also the
order the fused q/k/v and gate/up tensors need) and tokens.bin (int32, batch x (seq_len + 1)).
The zoo worker reads the same files, so both compute the same thing from the same weights
and data.

A step is the one PyTorch users write: zero_grad, forward, cross-entropy, backward,
clip_grad_norm_, AdamW.step. "fused" is AdamW(fused=True), PyTorch's fastest eager setting
on the CPU; "default" is AdamW with no implementation flag (on the CPU, PyTorch then uses
its single-tensor for-loop implementation: foreach kernels are not the CPU default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import time


def _rss_now_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


# What every worker of zoo bench and bench_lora shares (zoo's import these from here too).
def read_manifest(workdir: str) -> dict:
    with open(os.path.join(workdir, "manifest.json")) as f:
        return json.load(f)


def read_tokens(workdir: str, batch: int, seq_len: int):
    """tokens.bin as int32 (batch, seq_len + 1): inputs and targets."""
    import numpy as np

    return np.fromfile(os.path.join(workdir, "tokens.bin"), dtype=np.int32).reshape(batch, seq_len + 1)


def timed_steps(step, steps: int, warmup: int, after_warmup=None) -> tuple[list, list]:
    """warmup untimed calls of step(), then after_warmup() if given, then steps timed calls:
    (seconds of each, the losses step returned)."""
    for _ in range(warmup):
        step()
    if after_warmup:
        after_warmup()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    return times, losses


def load_weights(model, weights_path: str) -> tuple[list, list]:
    """Reads weights.bin straight into the model's parameters (no intermediate copies) and
    returns (decayed, not decayed) parameter lists, following zoo's decay mask. A fused role
    (q|k|v, gate|up) is one span of the file: zoo lays its tensors out next to each other."""
    decay, no_decay = [], []
    with open(weights_path, "rb", buffering=0) as f:
        for span in model.spans:
            first = span["records"][0]
            offset = first["offset"]
            for r in span["records"]:
                if r["offset"] != offset:
                    raise ValueError(f"bench_torch: {r['name']} is not next to the tensor before it, "
                                     f"which {first['role']!r} fuses it with")
                offset += math.prod(r["shape"])
            t = model.parameter_of(span)
            f.seek(4 * first["offset"])
            buf = memoryview(t.detach().numpy()).cast("B")
            got = 0
            while got < len(buf):
                got += f.readinto(buf[got:])
            (decay if first["decay"] else no_decay).append(t)
    return decay, no_decay


def run(workdir: str, optimizer: str, steps: int, warmup: int, threads: int, precision: str = "fp32") -> dict:
    rss_start = _rss_now_mib()
    import numpy as np
    import torch

    import torch_reference  # this file's folder, sys.path[0] when run by path

    torch.set_num_threads(threads)
    rss_imported = _rss_now_mib()
    manifest = read_manifest(workdir)
    cfg, B, T = manifest["config"], manifest["batch"], manifest["seq_len"]
    opt_cfg = manifest["optimizer"]

    model = torch_reference.Decoder(cfg, manifest["params"])
    decay, no_decay = load_weights(model, os.path.join(workdir, "weights.bin"))
    groups = [{"params": decay, "weight_decay": opt_cfg["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=opt_cfg["lr"], betas=(opt_cfg["beta1"], opt_cfg["beta2"]), eps=opt_cfg["eps"])
    opt = torch.optim.AdamW(groups, fused=True, **kw) if optimizer == "fused" else torch.optim.AdamW(groups, **kw)
    params = decay + no_decay

    data = torch.from_numpy(read_tokens(workdir, B, T).astype(np.int64))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    clip = opt_cfg["max_grad_norm"]

    # bf16 as PyTorch users write it: autocast around the forward; weights, gradients and
    # AdamW stay fp32.
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        return loss.item()

    times, losses = timed_steps(step, steps, warmup)
    return {
        "step_s": times, "losses": losses,
        "peak_rss_mib": _peak_rss_mib(), "rss_start_mib": rss_start, "rss_after_import_mib": rss_imported,
        "threads": torch.get_num_threads(),
        "implementation": f"PyTorch {torch.__version__} eager"
                          + (", autocast bf16" if precision == "bf16" else "") + ", AdamW("
                          + ("fused=True" if optimizer == "fused" else "defaults") + ")",
        "torch_version": torch.__version__,
        "median_s": statistics.median(times),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="zoo bench's PyTorch worker (run by zoo bench)")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--optimizer", choices=["fused", "default"], required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--out", required=True, help="where to write the result (JSON)")
    a = ap.parse_args(argv)
    try:
        result = run(a.workdir, a.optimizer, a.steps, a.warmup, a.threads, a.precision)
    except NotImplementedError as e:  # a block the reference lacks: one line for zoo bench to show
        print(f"bench_torch: {e}", file=sys.stderr)
        return 3
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
