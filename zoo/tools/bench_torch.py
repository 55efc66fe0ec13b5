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

With --hf-class ATTN the model is not the reference but transformers' own modeling class of
the config's family (Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM, ...): built by
AutoModelForCausalLM.from_config from the transformers config zoo bench wrote into the
manifest (zoo.io.hf_config.config_to_hf), with the attention implementation ATTN ("eager":
transformers' matmul-softmax-matmul; "sdpa": torch's scaled_dot_product_attention, transformers'
default), in fp32, then given zoo's weights by name (zoo's parameter names are the Hugging Face
ones). transformers is imported in this process only in that case.

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


def build_hf_model(manifest: dict, attn: str):
    """transformers' own class of the config's family, fp32, random init (replaced by
    load_hf_weights), the attention implementation `attn`, no KV cache."""
    import torch
    import transformers

    hf = manifest.get("hf_config")
    if not hf:
        raise NotImplementedError("the manifest has no transformers config (zoo bench --hf-class writes one)")
    config = transformers.AutoConfig.for_model(**hf)
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.train()
    return model


def load_hf_weights(model, manifest: dict, weights_path: str) -> tuple[list, list]:
    """zoo's weights into transformers' model by name (transposed where the family stores a
    matrix (in, out), as GPT-2's Conv1D); every parameter of the model must get one (a tied
    LM head is the embedding). (decayed, not decayed) lists, by zoo's decay mask."""
    import numpy as np
    import torch

    named = dict(model.named_parameters())  # a tied head appears once, as the embedding
    decay, no_decay, seen = [], [], set()
    with open(weights_path, "rb") as f:
        for p in manifest["params"]:
            t = named.get(p["name"])
            if t is None and p["role"] == "lm_head_w":  # transformers 5 names every LM head lm_head
                t = named.get("lm_head.weight")
            if t is None:
                raise ValueError(f"bench_torch: transformers' {type(model).__name__} has no parameter {p['name']}")
            n = math.prod(p["shape"])
            f.seek(4 * p["offset"])
            value = np.fromfile(f, dtype=np.float32, count=n).reshape(p["shape"])
            if p.get("hf_transposed"):
                value = value.T
            if p.get("hf_row_order") is not None:  # the checkpoint's row order: stored[order] = zoo's
                stored = np.empty_like(value)
                stored[np.asarray(p["hf_row_order"])] = value
                value = stored
            if tuple(t.shape) != value.shape:
                raise ValueError(f"bench_torch: {p['name']} is {list(t.shape)} in transformers, "
                                 f"{list(value.shape)} in zoo")
            with torch.no_grad():
                t.copy_(torch.from_numpy(np.ascontiguousarray(value)))
            (decay if p["decay"] else no_decay).append(t)
            seen.add(next(name for name, param in named.items() if param is t))
    missing = [name for name in named if name not in seen]
    if missing:
        raise ValueError(f"bench_torch: zoo has no weights for {', '.join(missing[:3])} of {type(model).__name__}")
    return decay, no_decay


def run(workdir: str, optimizer: str, steps: int, warmup: int, threads: int, precision: str = "fp32",
        hf_attn: str | None = None) -> dict:
    rss_start = _rss_now_mib()
    import numpy as np
    import torch

    if hf_attn:
        import transformers
    else:
        import torch_reference  # this file's folder, sys.path[0] when run by path

    torch.set_num_threads(threads)
    rss_imported = _rss_now_mib()
    manifest = read_manifest(workdir)
    cfg, B, T = manifest["config"], manifest["batch"], manifest["seq_len"]
    opt_cfg = manifest["optimizer"]

    t_build = time.perf_counter()
    if hf_attn:
        model = build_hf_model(manifest, hf_attn)
        decay, no_decay = load_hf_weights(model, manifest, os.path.join(workdir, "weights.bin"))
        hf_forward = model

        def forward(x, y):  # the logits of transformers' class, cross-entropy over the next tokens
            logits = hf_forward(input_ids=x).logits
            return torch.nn.functional.cross_entropy(logits.float().reshape(B * T, -1), y.reshape(-1))
    else:
        model = torch_reference.Decoder(cfg, manifest["params"])
        decay, no_decay = load_weights(model, os.path.join(workdir, "weights.bin"))
        forward = model
    build_s = time.perf_counter() - t_build
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
            loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        return loss.item()

    times, losses = timed_steps(step, steps, warmup)
    model_name = (f"transformers {transformers.__version__} {type(model).__name__} ({hf_attn} attention)"
                  if hf_attn else "the reference model (torch_reference.py)")
    out = {
        "step_s": times, "losses": losses,
        "peak_rss_mib": _peak_rss_mib(), "rss_start_mib": rss_start, "rss_after_import_mib": rss_imported,
        "threads": torch.get_num_threads(), "build_s": build_s,
        "implementation": f"PyTorch {torch.__version__} eager, {model_name}"
                          + (", autocast bf16" if precision == "bf16" else "") + ", AdamW("
                          + ("fused=True" if optimizer == "fused" else "defaults") + ")",
        "torch_version": torch.__version__,
        "median_s": statistics.median(times),
        "imported_zoo": "zoo" in sys.modules,  # must stay False: this process measures PyTorch alone
    }
    if hf_attn:
        out.update({"hf_class": type(model).__name__, "hf_attention": model.config._attn_implementation,
                    "transformers_version": transformers.__version__})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="zoo bench's PyTorch worker (run by zoo bench)")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--optimizer", choices=["fused", "default"], required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--hf-class", choices=["eager", "sdpa"], default=None, metavar="ATTN",
                    help="time transformers' own class of the config's family, with this attention "
                         "implementation, instead of the reference model")
    ap.add_argument("--out", required=True, help="where to write the result (JSON)")
    a = ap.parse_args(argv)
    try:
        result = run(a.workdir, a.optimizer, a.steps, a.warmup, a.threads, a.precision, a.hf_class)
    except NotImplementedError as e:  # a block the reference lacks: one line for zoo bench to show
        print(f"bench_torch: {e}", file=sys.stderr)
        return 3
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
