"""The PyTorch + PEFT side of `python -m zoo.tools.bench_lora`: times LoRA training steps of a
transformers model with random weights, in a process of its own.

Run by path (`python .../zoo/tools/bench_lora_torch.py ...`), like bench_torch.py: the measured
process holds PyTorch, transformers and PEFT alone and never imports zoo. It reads the work
folder bench_lora wrote: manifest.json (the transformers config of the preset, the batch shape,
the LoRA and optimizer settings) and tokens.bin (int32, batch x (seq_len + 1)).

The model is built at the preset's shape directly in the dtype of its weights (no download, no
float32 copy of a bf16 model), with transformers' own random init:
  bf16: weights in bf16; PEFT's adapters in fp32 (its autocast_adapter_dtype default); the forward
        under torch.autocast(bfloat16), as PyTorch users train in mixed precision on the CPU.
  fp32: everything in fp32.
A step: zero_grad, forward, cross-entropy over the next tokens, backward, clip_grad_norm_, AdamW
(fused) over the adapters. --checkpointing turns on transformers' gradient checkpointing (the
non-reentrant form, which needs no input gradients). The model is transformers' own class of
the preset's family (LlamaForCausalLM, Qwen3ForCausalLM, ...: AutoModelForCausalLM picks it from
the config's model_type); --attn picks its attention implementation (sdpa, transformers' default,
or eager), and without it transformers picks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

# this file's folder, sys.path[0] when run by path
from bench_torch import _peak_rss_mib, _rss_now_mib, read_manifest, read_tokens, timed_steps


def build_model(hf_config: dict, dtype, lora: dict, checkpointing: bool, attn=None):
    import peft
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    config.use_cache = False
    torch.manual_seed(0)
    # Built in `dtype` from the start: a bf16 8B model never exists in fp32.
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=dtype, **({"attn_implementation": attn} if attn else {}))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    lora_config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                  target_modules=lora["targets"], task_type="CAUSAL_LM")
    return peft.get_peft_model(model, lora_config)


def run(workdir: str, setting: str, checkpointing: bool, steps: int, warmup: int, threads: int,
        attn=None) -> dict:
    rss_start = _rss_now_mib()
    import numpy as np
    import peft
    import torch
    import transformers

    torch.set_num_threads(threads)
    rss_imported = _rss_now_mib()
    manifest = read_manifest(workdir)
    B, T, o = manifest["batch"], manifest["seq_len"], manifest["optimizer"]
    dtype = torch.bfloat16 if setting == "bf16" else torch.float32
    t0 = time.perf_counter()
    model = build_model(manifest["hf_config"], dtype, manifest["lora"], checkpointing, attn)
    build_s = time.perf_counter() - t0
    rss_built = _rss_now_mib()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"],
                            weight_decay=o["weight_decay"], fused=True)
    data = torch.from_numpy(read_tokens(workdir, B, T).astype(np.int64))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if setting == "bf16" else contextlib.nullcontext()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(B * T, -1), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, o["max_grad_norm"])
        opt.step()
        return loss.item()

    times, losses = timed_steps(step, steps, warmup)
    describe = {"bf16": "bf16 weights, fp32 adapters, autocast bf16", "fp32": "fp32"}[setting]
    return {
        "step_s": times, "losses": losses, "median_s": statistics.median(times), "build_s": build_s,
        "peak_rss_mib": _peak_rss_mib(), "rss_start_mib": rss_start, "rss_after_import_mib": rss_imported,
        "rss_after_build_mib": rss_built, "threads": torch.get_num_threads(),
        "trainable_params": sum(p.numel() for p in trainable),
        "attention": model.config._attn_implementation,
        "hf_class": type(model.get_base_model()).__name__,
        "implementation": f"PyTorch {torch.__version__} + transformers {transformers.__version__} + PEFT "
                          f"{peft.__version__}: {describe}"
                          + (", gradient checkpointing" if checkpointing else "") + ", AdamW(fused=True)",
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "peft_version": peft.__version__,
        "imported_zoo": "zoo" in sys.modules,  # must stay False: this process measures PyTorch alone
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="bench_lora's PyTorch + PEFT worker (run by zoo.tools.bench_lora)")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--setting", choices=["bf16", "fp32"], required=True)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default=None,
                    help="transformers' attention implementation (default: transformers picks, sdpa)")
    ap.add_argument("--out", required=True, help="where to write the result (JSON)")
    a = ap.parse_args(argv)
    result = run(a.workdir, a.setting, a.checkpointing, a.steps, a.warmup, a.threads, a.attn)
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
