"""What each Llama variant option costs zoo, block by block, beside the Llama baseline.

    python -m zoo.tools.bench_variants --preset qwen3-1.7b --batch-size 4 --seq-len 256 --threads 2 \\
        --json benchmarks/variants-qwen3-1.7b-b4-t256.json

The preset's layer shapes (d_model, heads, head_dim, d_ff) as a plain Llama (pre-norms, no biases,
no q/k norm, RoPE on every layer: the baseline), then the same with one ModelConfig option of
issue 28's families at a time: per-head q/k RMSNorm (Qwen3), q/k RMSNorm over the projection
(OLMo-2), norms on the branch outputs instead of their inputs (OLMo-2) and on both, q/k/v biases
(Qwen2), a NoPE layer (SmolLM3), a sliding window (Mistral, Qwen2's option) and Granite's four
scales. --n-layer layers and a --vocab-size vocabulary (default 2 and 512), so that the step is
the layers' and not the embedding's or the LM head's.

Every variant is built, stepped and freed in turn in one process, round after round, each round
starting with the next variant, so all see the same machine (and only one model is resident at
a time): per round and variant, --warmup untimed steps, --steps timed steps (the training step
as a user runs it: zero_grads, forward_backward, adamw_step), then one profiled step (the
executor's per-block profile). Medians over the rounds. With --base bf16 (or int8, nf4) the
step is LoRA (rank 16 on every linear of the blocks) over a frozen base in that format, as
bench_lora's zoo worker runs it; by default full finetuning in --precision.

The executor's profile has one slot per block kind: the q/k norm and the branch-output norms are
timed in the "norm" slot with the pre-norms, so a variant's own cost is its norm slot (and its
step) minus the baseline's. The report gives both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import numpy as np

from zoo.tools.bench_worker import timed_step

SCHEMA = "zoo-bench-variants/1"
SLOTS = ("embedding", "norm", "linear", "lora", "rope", "attention", "activation", "lm_head", "cross_entropy",
         "adamw")

# Each variant: the options over the baseline, and the family that has it.
VARIANTS: dict[str, tuple[dict, str]] = {
    "llama": ({}, "the baseline: Llama (pre-norms, RoPE, no biases)"),
    "qk_norm_head": ({"qk_norm": "head"}, "Qwen3: RMSNorm over each head's q and k"),
    "qk_norm_projection": ({"qk_norm": "projection"}, "OLMo-2's q/k RMSNorm over the whole projection"),
    "post_norms": ({"branch_norms": "post"}, "OLMo-2's norms on the branch outputs (no pre-norms)"),
    "pre_and_post_norms": ({"branch_norms": "both"}, "norms on the branch inputs and outputs"),
    "olmo2": ({"qk_norm": "projection", "branch_norms": "post"}, "OLMo-2: both of its changes"),
    "qkv_bias": ({"attention_bias": True, "attention_out_bias": False}, "Qwen2: q, k and v biases"),
    "nope_layer": ({"nope_layers": (0,)}, "SmolLM3: RoPE skipped on layer 0"),
    "sliding_window": ({"sliding_window": 64}, "a 64-key sliding window on every layer (Mistral, Qwen2's option)"),
    "granite_scales": ({"embedding_scale": 12.0, "residual_scale": 0.22, "attention_scale": 0.0078125,
                        "logit_scale": 0.125}, "Granite's embedding, residual, attention and logit scales"),
}


def baseline_config(preset: str, n_layer: int, vocab_size: int):
    """The preset's layer shapes as a plain Llama (family llama; every variant option off)."""
    from zoo.arch.config import ModelConfig
    from zoo.arch.presets import preset as lookup

    d = lookup(preset).model_dump()
    if d["positions"] != "rope" or d["norm"] != "rmsnorm":
        raise ValueError(f"--preset {preset}: not a Llama-like shape (RoPE and RMSNorm)")
    d.update(family="llama", n_layer=n_layer, vocab_size=vocab_size, qk_norm="none", branch_norms="pre",
             attention_bias=False, attention_out_bias=False, mlp_bias=False, sliding_window=None,
             sliding_layers=None, nope_layers=(), embedding_scale=1.0, residual_scale=1.0, attention_scale=None,
             logit_scale=1.0, rope_scaling=None)
    return ModelConfig(**d)


def variant_config(base, name: str):
    from zoo.arch.config import ModelConfig

    options, _ = VARIANTS[name]
    return ModelConfig(**{**base.model_dump(), **options})


def _build(cfg, base_dtype: Optional[str], precision: str):
    import zoo

    if base_dtype is None:
        return zoo.Model(cfg, seed=0, precision=precision)
    from zoo.arch.lora import LoraConfig, default_precision

    return zoo.Model(cfg, seed=0, base_dtype=base_dtype, precision=default_precision(base_dtype),
                     lora=LoraConfig(r=16, alpha=32.0))


def measure(base, names: list[str], batch: int, seq_len: int, rounds: int, steps: int, warmup: int,
            base_dtype: Optional[str], precision: str, log=None) -> dict:
    tokens = np.random.default_rng(1).integers(0, base.vocab_size, (batch, seq_len + 1))
    x, y = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
    step_s = {n: [] for n in names}
    blocks = {n: {k: [] for k in SLOTS} for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if log:
                log(f"round {r + 1} of {rounds}: {name}")
            model = _build(variant_config(base, name), base_dtype, precision)
            for _ in range(warmup):
                timed_step(model, x, y)
            step_s[name].append(statistics.median(timed_step(model, x, y) for _ in range(steps)))
            model.set_profiling(True)
            timed_step(model, x, y)
            prof = model.block_profile()
            model.set_profiling(False)
            for k in SLOTS:
                fwd, back = prof.get(k, (0.0, 0.0))
                blocks[name][k].append(fwd + back)
            del model
    out = {}
    for name in names:
        med = {k: 1e3 * statistics.median(v) for k, v in blocks[name].items()}
        out[name] = {"step_ms": 1e3 * statistics.median(step_s[name]), "step_ms_rounds": [1e3 * s for s in step_s[name]],
                     "blocks_ms": med, "options": {k: list(v) if isinstance(v, tuple) else v
                                                   for k, v in VARIANTS[name][0].items()},
                     "what": VARIANTS[name][1]}
    ref = out[names[0]]
    for name in names:
        o = out[name]
        o["step_over_baseline"] = o["step_ms"] / ref["step_ms"]
        o["step_minus_baseline_ms"] = o["step_ms"] - ref["step_ms"]
        o["blocks_minus_baseline_ms"] = {k: o["blocks_ms"][k] - ref["blocks_ms"][k] for k in SLOTS}
    return out


def markdown(r: dict) -> str:
    mode = (f"LoRA r=16 over a {r['base_dtype']} base" if r["base_dtype"]
            else f"full finetuning, {r['precision']} products")
    lines = [f"### zoo per variant: {r['preset']}'s layer shapes, {r['n_layer']} layers, vocabulary {r['vocab_size']}, "
             f"B={r['batch']}, T={r['seq_len']}, {r['threads']} threads, {mode}", "",
             f"Medians of {r['rounds']} rounds (each: {r['warmup']} warm-up, the median of {r['steps']} timed steps, "
             "one profiled step); ms per training step; the variants built and stepped in turn in one process.", "",
             "| variant | step ms | step / llama | norm ms (+ over llama) | rope ms | attention ms | linear ms |"
             + (" lora ms |" if r["base_dtype"] else ""),
             "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if r["base_dtype"] else "")]
    for name, v in r["variants"].items():
        b, d = v["blocks_ms"], v["blocks_minus_baseline_ms"]
        lines.append(f"| {name}: {v['what']} | {v['step_ms']:,.1f} | {v['step_over_baseline']:.3f}x | "
                     f"{b['norm']:.2f} ({d['norm']:+.2f}) | {b['rope']:.2f} | {b['attention']:.2f} | "
                     f"{b['linear']:.1f} |" + (f" {b['lora']:.1f} |" if r["base_dtype"] else ""))
    lines.append("")
    g = r["machine"]["gemm"]
    lines.append(f"- {r['machine']['cpu']}; zoo {r['machine']['zoo']}; fp32 products on {g['fp32']}"
                 + (f" ({g['openblas_core']} kernels)" if g["fp32"] == "openblas" else "")
                 + (f", bf16 products on {g['bf16']} ({g['onednn_isa']})" if g.get("bf16") else ""))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    import zoo

    from .bench import default_threads

    p = argparse.ArgumentParser(prog="python -m zoo.tools.bench_variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-1.7b", help="the layer shapes (default qwen3-1.7b)")
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS), metavar="NAME",
                   help=f"the variants, the baseline first (default: all: {', '.join(VARIANTS)})")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant and round (default 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="full finetuning's products")
    p.add_argument("--base", choices=["bf16", "int8", "nf4", "fp32"], default=None,
                   help="LoRA over a frozen base in this format instead of full finetuning")
    p.add_argument("--json", metavar="FILE", default=None)
    a = p.parse_args(argv)
    names = a.variants or list(VARIANTS)
    if names[0] != "llama":
        names = ["llama"] + [n for n in names if n != "llama"]
    if a.seq_len <= 64 and "sliding_window" in names:
        print("bench_variants: note: --seq-len at most 64: the 64-key window masks nothing", file=sys.stderr)
    threads = a.threads or default_threads()
    zoo.set_threads(threads)
    try:
        base = baseline_config(a.preset, a.n_layer, a.vocab_size)
    except (KeyError, ValueError) as e:
        print(f"bench_variants: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 1
    variants = measure(base, names, a.batch_size, a.seq_len, a.rounds, a.steps, a.warmup, a.base, a.precision,
                       log=lambda m: print(f"bench_variants: {m}", file=sys.stderr, flush=True))
    from .bench_worker import cpu_info

    r = {"schema": SCHEMA, "command": "python -m zoo.tools.bench_variants " + " ".join(argv or sys.argv[1:]),
         "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "preset": a.preset,
         "n_layer": a.n_layer, "vocab_size": a.vocab_size, "batch": a.batch_size, "seq_len": a.seq_len,
         "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup, "threads": threads, "precision": a.precision,
         "base_dtype": a.base, "baseline_config": base.model_dump(), "variants": variants,
         "machine": {"cpu": cpu_info()["model"], "zoo": zoo.__version__, "gemm": zoo.gemm_info(),
                     "build_info": zoo.build_info()}}
    print(markdown(r))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(r, indent=2) + "\n")
        print(f"wrote {a.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
