"""LoRA finetuning steps of zoo and of PyTorch + PEFT, side by side in one run: random weights of
a preset's shape, LoRA (rank 16 by default) on every linear layer inside the blocks, the same
token batch.

  python -m zoo.tools.bench_lora --preset llama-3.2-1b --batch-size 1 --seq-len 256 --rank 16 \\
      --base bf16 --torch bf16 fp32 --threads 2 --json benchmarks/lora-llama-3.2-1b.json

Every system runs in a process of its own, one after the other, so that each one's peak resident
memory (getrusage's ru_maxrss, read in the child) is its own and none competes for the cores:

  zoo_<base>    python -m zoo.tools.bench_lora_worker --base bf16|int8|nf4 [--checkpointing]
                the frozen base in that format, fp32 adapters (one system per --base)
  zoo_bf16_packed  ... --base bf16 --packed-base: the bf16 base with its packed copy
                (Model.set_packed_base), beside zoo_bf16, where --packed-base is given
  torch_bf16    python zoo/tools/bench_lora_torch.py --setting bf16: transformers + PEFT, bf16
                weights, fp32 adapters, autocast bf16
  torch_fp32    ... --setting fp32: everything in fp32
                (the model is transformers' own class of the preset's family, Qwen3ForCausalLM for a
                qwen3 preset; --hf-class eager|sdpa picks its attention implementation)
                (--torch-checkpointing: transformers' gradient checkpointing)

The PyTorch worker is run by path and never imports zoo; it builds the transformers model of the
preset's config (zoo.io.hf_config.config_to_hf) in its weights' dtype, without downloading anything.
PyTorch, transformers and PEFT are optional: benchmark (and test) dependencies only.

FLOPs: a LoRA step over a frozen base needs the forward and the input gradients through every
frozen product, no weight gradients: 4 x N_matmul x tokens (the floor the issue's targets are
measured against), the adapters and attention on top.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from .bench import (OPTIMIZER, BenchError, _run_worker, _summary, default_threads, machine_info, matmul_params,
                    model_config)

SCHEMA = "zoo-bench-lora/1"
BASES = ("bf16", "int8", "nf4", "fp32")
TORCH_SETTINGS = ("bf16", "fp32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", default=None, help="a named architecture (default: llama-3.2-1b)")
    model.add_argument("--config", metavar="FILE", default=None, help="a YAML or JSON ModelConfig")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank r (default 16)")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: 2 x rank)")
    p.add_argument("--targets", nargs="+", default=None, metavar="MODULE",
                   help="module types to adapt, by their Hugging Face names (default: every linear layer "
                        "inside the blocks: q_proj ... down_proj, or c_attn c_proj c_fc)")
    p.add_argument("--base", nargs="+", default=["bf16"], metavar="DTYPE",
                   help=f"zoo's frozen base, one system each: {', '.join(BASES)}; 'none': no zoo system "
                        "(default bf16)")
    p.add_argument("--checkpointing", action="store_true", help="zoo with activation checkpointing")
    p.add_argument("--packed-base", action="store_true",
                   help="also zoo's bf16 base packed for its input gradients (system zoo_bf16_packed)")
    p.add_argument("--from-checkpoint", action="store_true",
                   help="write zoo's random model once as a bf16 safetensors checkpoint folder (in the run's "
                        "temporary folder, removed at its end) and have every zoo system load it as a user does "
                        "(zoo.Model.from_pretrained); default: each builds it in memory")
    p.add_argument("--torch", nargs="+", default=None, metavar="SETTING",
                   help="PyTorch + PEFT settings, one system each: bf16 (bf16 weights, autocast), fp32; 'none': "
                        "no PyTorch system (default bf16 when torch, transformers and peft are installed)")
    p.add_argument("--torch-checkpointing", action="store_true",
                   help="PyTorch with transformers' gradient checkpointing")
    p.add_argument("--hf-class", nargs="*", choices=["sdpa", "eager"], default=None, metavar="ATTN",
                   help="the PyTorch side is transformers' own class of the preset's family; this names its "
                        "attention implementation: sdpa (transformers' default; the default of the bare flag) "
                        "or eager, or both: a system each, torch_<setting>_<attn> (default: transformers picks)")
    p.add_argument("--profile", action="store_true",
                   help="then each zoo system once more, profiled per block (a process of its own, after the "
                        "timed ones)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the systems in turn this many times and pool their steps; the ratios of each round "
                        "are reported too (default 1)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per system (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"threads for every system (default: the CPUs this process may use, {default_threads()})")
    p.add_argument("--seed", type=int, default=0, help="seed of the token batch (default 0)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.tools.bench_lora", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        results = run_bench(args)
    except (BenchError, ValueError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"bench_lora: error: {msg}", file=sys.stderr)
        return 1
    print(markdown(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _torch_side_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "peft"))


def _chosen(values: list[str], allowed: tuple[str, ...], flag: str) -> list[str]:
    if values == ["none"]:
        return []
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"{flag} {bad[0]}: choose from {', '.join(allowed)}, or 'none'")
    return list(dict.fromkeys(values))


def lora_flops(cfg, tokens: int, rank: int, adapted: list) -> dict:
    """FLOPs of a LoRA step: the frozen products forward and their input gradients (4 x N x
    tokens), and each adapter's two small products forward, input gradients and weight
    gradients (6 x r x (in + out) x tokens). Attention is left out (as in the issue's floor)."""
    n = matmul_params(cfg)
    frozen = 4 * n * tokens
    small = sum(6 * rank * (a.d_in + a.o1 - a.o0) * tokens for a in adapted)
    return {"total": frozen + small, "frozen": frozen, "adapters": small, "matmul_params": n,
            "formula": "4 * N_matmul * tokens + 6 * r * (in + out) * tokens per adapter"}


def write_random_checkpoint(cfg, folder: Path, seed: int = 0) -> None:
    """zoo's random init of cfg as a Hugging Face checkpoint folder in bf16 (config.json,
    safetensors shards): the draws zoo.Model(cfg, seed=seed) makes for a frozen base, in the same
    order, so that a bf16 base loaded from it holds the values one built in memory holds. Written
    a block of rows at a time: no tensor is ever whole in memory in float32 (one GPT-2 Conv1D
    weight or reordered tensor is, being transposed or permuted whole)."""
    import math

    import numpy as np

    from .. import families
    from ..arch.layout import initial_value, parameter_layout
    from ..core.atomic import write_json
    from ..io.hf_config import CONFIG_FILE, config_to_hf
    from ..io.safetensors import Pieces, write_checkpoint
    from ..model import _INIT_CHUNK_VALUES

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    family = families.get(cfg.family)

    def pieces(spec):
        def blocks():
            step = max(1, _INIT_CHUNK_VALUES // max(1, math.prod(spec.shape[1:])))
            for r0 in range(0, spec.shape[0], step):
                yield initial_value(spec, rng, cfg.n_layer, min(step, spec.shape[0] - r0))

        if not spec.hf_transposed and family.row_order(cfg, spec.name) is None:
            return blocks

        def whole():
            value = np.concatenate(list(blocks()))
            yield family.rows_to_checkpoint(cfg, spec.name, value.T if spec.hf_transposed else value)
        return whole

    tensors = [(spec.name, Pieces(tuple(reversed(spec.shape)) if spec.hf_transposed else spec.shape, pieces(spec)))
               for spec in parameter_layout(cfg)]
    write_checkpoint(folder, tensors, "BF16")
    write_json(folder / CONFIG_FILE, config_to_hf(cfg, dtype="bfloat16"))


def run_bench(args: argparse.Namespace) -> dict:
    from ..arch.layout import num_parameters
    from ..arch.lora import LoraConfig, adapters, module_names
    from ..io.hf_config import config_to_hf

    cfg = model_config(args.preset or (None if args.config else "llama-3.2-1b"), args.config)
    preset_name = args.preset or (None if args.config else "llama-3.2-1b")
    for name, v, low in (("--batch-size", args.batch_size, 1), ("--seq-len", args.seq_len, 1),
                         ("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--rank", args.rank, 1),
                         ("--rounds", args.rounds, 1)):
        if v < low:
            raise ValueError(f"{name} must be at least {low}, got {v}")
    if args.seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's context ({cfg.max_seq_len})")
    threads = args.threads or default_threads()
    bases = _chosen(args.base, BASES, "--base")
    torch_default = ["bf16"] if _torch_side_available() else ["none"]
    settings = _chosen(args.torch or torch_default, TORCH_SETTINGS, "--torch")
    if settings and not _torch_side_available():
        raise ValueError("--torch needs torch, transformers and peft installed (pip install -e '.[dev]')")
    if not bases and not settings:
        raise ValueError("nothing to measure: --base none and --torch none")
    if args.packed_base and "bf16" not in bases:
        raise ValueError("--packed-base packs a bf16 base: add bf16 to --base")
    known = module_names(cfg)
    targets = args.targets or known
    unknown = [t for t in targets if t not in known]
    if unknown:
        raise ValueError(f"--targets {unknown[0]}: this model's modules are {', '.join(known)}")
    alpha = args.alpha if args.alpha is not None else 2.0 * args.rank
    lora = {"r": args.rank, "alpha": alpha, "dropout": 0.0, "targets": targets}
    tokens = args.batch_size * args.seq_len
    flops = lora_flops(cfg, tokens, args.rank, adapters(cfg, LoraConfig(r=args.rank, targets=targets)))

    raw: dict[str, list[dict]] = {}  # system -> one result per round
    with tempfile.TemporaryDirectory(prefix="zoo-bench-lora-") as tmp:
        work = Path(tmp)
        import numpy as np

        batch = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1),
                                                          dtype=np.int32)
        batch.tofile(work / "tokens.bin")
        manifest = {"config": cfg.model_dump(), "hf_config": config_to_hf(cfg), "batch": args.batch_size,
                    "seq_len": args.seq_len, "optimizer": OPTIMIZER, "lora": lora}
        (work / "manifest.json").write_text(json.dumps(manifest))
        common = ["--workdir", str(work), "--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--threads", str(threads)]
        zoo_common = ["--checkpointing"] if args.checkpointing else []
        if args.from_checkpoint and bases:
            print(f"bench_lora: writing the random model to {work / 'checkpoint'}", file=sys.stderr)
            write_random_checkpoint(cfg, work / "checkpoint", seed=0)
            zoo_common += ["--checkpoint", str(work / "checkpoint")]
        attns = list(dict.fromkeys(args.hf_class or ["sdpa"])) if args.hf_class is not None else [None]
        # (system, command): zoo's bases, then PyTorch's settings, each with every attention named
        runs = [(f"zoo_{base}", [sys.executable, "-m", "zoo.tools.bench_lora_worker", "--base", base, *common,
                                 *zoo_common]) for base in bases]
        if args.packed_base:
            runs.append(("zoo_bf16_packed", [sys.executable, "-m", "zoo.tools.bench_lora_worker", "--base", "bf16",
                                             "--packed-base", *common, *zoo_common]))
        torch_worker = str(Path(__file__).with_name("bench_lora_torch.py"))
        for setting in settings:
            for attn in attns:
                name = f"torch_{setting}" + (f"_{attn}" if len(attns) > 1 else "")
                cmd = [sys.executable, torch_worker, "--setting", setting, *common]
                cmd += ["--checkpointing"] if args.torch_checkpointing else []
                cmd += ["--attn", attn] if attn else []
                runs.append((name, cmd))
        for r in range(args.rounds):
            of = f" (round {r + 1} of {args.rounds})" if args.rounds > 1 else ""
            for name, cmd in runs:
                raw.setdefault(name, []).append(_run_worker(name + of, cmd, work / f"{name}.json", threads))
        profiles = {}
        for name, cmd in runs if args.profile else ():
            if name.startswith("zoo_"):
                profiles[name] = _run_worker(f"{name}, profiled per block", cmd + ["--profile"],
                                             work / f"{name}-profile.json", threads)

    systems = {}
    for name, results in raw.items():
        result = results[0]
        s = _summary(results, tokens, flops["total"])
        s.update({k: result[k] for k in ("build_s", "pack_s", "packed_base_bytes", "rss_after_build_mib",
                                         "arena_bytes", "trainable_params",
                                         "imported_zoo", "kernels_used", "hf_class", "attention")
                  if k in result})
        s["checkpointing"] = args.checkpointing if name.startswith("zoo_") else args.torch_checkpointing
        if name.startswith("zoo_"):
            s["loaded_from"] = "safetensors checkpoint (bf16)" if args.from_checkpoint else "built in memory"
        if name in profiles:
            prof = profiles[name]
            s["blocks"] = {k: {"forward_ms": 1000.0 * f / args.steps, "pullback_ms": 1000.0 * b / args.steps,
                               "total_ms": 1000.0 * (f + b) / args.steps} for k, (f, b) in prof["blocks_s"].items()}
            s["profiled_step_ms_mean"] = 1000.0 * statistics.fmean(prof["step_s"])
        systems[name] = s
    ratios = {}
    for a in (n for n in systems if n.startswith("zoo_")):
        for b in (n for n in systems if n.startswith("torch_")):
            ratios[f"{a}_over_{b}"] = {
                "step_time": systems[a]["step_ms_median"] / systems[b]["step_ms_median"],
                "peak_rss": systems[a]["peak_rss_mib"] / systems[b]["peak_rss_mib"]}
    if "zoo_bf16_packed" in systems and "zoo_bf16" in systems:  # what the packed copy buys, and costs
        a, b = systems["zoo_bf16_packed"], systems["zoo_bf16"]
        ratios["zoo_bf16_packed_over_zoo_bf16"] = {"step_time": a["step_ms_median"] / b["step_ms_median"],
                                                   "peak_rss": a["peak_rss_mib"] / b["peak_rss_mib"]}
    by_round = []
    for r in range(args.rounds):
        ms = {name: 1000.0 * statistics.median(raw[name][r]["step_s"]) for name in raw}
        by_round.append({**{f"{name}_step_ms": v for name, v in ms.items()},
                         **{key: ms[key.split("_over_")[0]] / ms[key.split("_over_")[1]] for key in ratios}})
    command = ["python", "-m", "zoo.tools.bench_lora",
               *(["--config", args.config] if args.config else ["--preset", preset_name]),
               "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--rank", str(args.rank),
               "--alpha", f"{alpha:g}", "--targets", *targets, "--base", *(bases or ["none"]),
               "--torch", *(settings or ["none"]), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--threads", str(threads), "--seed", str(args.seed)]
    command += (["--checkpointing"] if args.checkpointing else []) + (
        ["--torch-checkpointing"] if args.torch_checkpointing else []) + (
        ["--hf-class", *args.hf_class] if args.hf_class is not None else []) + (
        ["--rounds", str(args.rounds)] if args.rounds > 1 else []) + (["--profile"] if args.profile else []) + (
        ["--from-checkpoint"] if args.from_checkpoint else []) + (["--packed-base"] if args.packed_base else [])
    return {
        "schema": SCHEMA,
        "command": shlex.join(command),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {"preset": preset_name, "config_file": args.config, "config": cfg.model_dump(),
                  "n_params": num_parameters(cfg), "matmul_params": flops["matmul_params"]},
        "batch": args.batch_size, "seq_len": args.seq_len, "tokens_per_step": tokens, "steps": args.steps,
        "warmup": args.warmup, "threads": threads, "seed": args.seed, "lora": lora, "hf_class": args.hf_class,
        "rounds": args.rounds, "by_round": by_round,
        "optimizer": dict(OPTIMIZER, name="AdamW", clipping="global L2 norm", over="the adapters only"),
        "flops_per_step": flops["total"], "flops": flops,
        "systems": systems, "ratios": ratios, "machine": machine_info(),
    }


def markdown(r: dict) -> str:
    m, lora = r["model"], r["lora"]
    lines = [
        f"## bench_lora: {m['preset'] or m['config_file']} ({m['n_params']:,} parameters), batch {r['batch']} x "
        f"seq {r['seq_len']} = {r['tokens_per_step']} tokens, {r['threads']} thread{'s' if r['threads'] != 1 else ''}",
        "",
        f"LoRA r={lora['r']}, alpha={lora['alpha']:g} on {', '.join(lora['targets'])} in every layer; "
        f"{r['steps']} timed steps after {r['warmup']} warm-up, each system in its own process"
        + (f", the systems in turn {r['rounds']} times (steps pooled)" if r.get("rounds", 1) > 1 else "")
        + ". A step: zero grads, "
        f"forward, cross-entropy, backward, clip to norm {r['optimizer']['max_grad_norm']}, AdamW over the adapters.",
        "",
        "| system | setting | step s (median) | min | max | tokens/s | GFLOP/s | peak RSS GiB | build s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in r["systems"].items():
        setting = s["implementation"].split(": ", 1)[-1]
        lines.append(f"| {name} | {setting} | {s['step_ms_median'] / 1000:.2f} | {s['step_ms_min'] / 1000:.2f} | "
                     f"{s['step_ms_max'] / 1000:.2f} | {s['tokens_per_s']:,.1f} | {s['gflops']:,.1f} | "
                     f"{s['peak_rss_mib'] / 1024:.2f} | {s['build_s']:.1f} |")
    lines.append("")
    for key, ratio in r["ratios"].items():
        a, b = key.split("_over_")
        lines.append(f"- {a} / {b}: step time {ratio['step_time']:.3f}x, peak RSS {ratio['peak_rss']:.3f}x")
    if r.get("rounds", 1) > 1:
        keys = list(r["ratios"])
        lines += ["", "| round | " + " | ".join(f"{n} s" for n in r["systems"]) + " | "
                  + " | ".join(k.replace("_over_", " / ") for k in keys) + " |",
                  "|---:" * (1 + len(r["systems"]) + len(keys)) + "|"]
        for i, e in enumerate(r["by_round"], 1):
            lines.append(f"| {i} | " + " | ".join(f"{e[n + '_step_ms'] / 1000:.2f}" for n in r["systems"]) + " | "
                         + " | ".join(f"{e[k]:.3f}x" for k in keys) + " |")
        lines.append("")
    f = r["flops"]
    lines.append(f"- FLOPs per step: {f['total'] / 1e9:,.1f} GFLOP = frozen products 4 x {f['matmul_params']:,} x "
                 f"{r['tokens_per_step']} ({f['frozen'] / 1e9:,.1f}) + adapters ({f['adapters'] / 1e9:,.2f}); "
                 "attention not counted")
    for name, s in r["systems"].items():
        if s.get("packed_base_bytes"):
            lines.append(f"- {name}: {s['packed_base_bytes'] / 2**20:,.1f} MiB of the base packed in "
                         f"{s['pack_s']:.1f} s, before the steps")
    for name, s in r["systems"].items():
        if s.get("hf_class"):
            lines.append(f"- {name}: transformers' {s['hf_class']}, {s['attention']} attention")
    for name, s in r["systems"].items():  # the kernels zoo's products ran on, as oneDNN named them
        used = s.get("kernels_used")
        if used:
            kernels = sorted({u["kernel"] for u in used})
            slow = sum(u["precision"] == "bf16" and not u["bf16_kernel"] for u in used)
            lines.append(f"- {name}'s products ran on {', '.join(kernels)}"
                         + (f" (**{slow} of its {len(used)} bf16 product shapes on kernels without bf16 dot products**)"
                            if slow else ""))
    for name, s in r["systems"].items():
        if s.get("blocks"):
            total = s["profiled_step_ms_mean"]
            lines += ["", f"{name} per block (a separate profiled run, ms per step):", "",
                      "| block | forward | pullback | total | share |", "|---|---:|---:|---:|---:|"]
            for kind, b in s["blocks"].items():
                if b["total_ms"] > 0:
                    lines.append(f"| {kind} | {b['forward_ms']:.1f} | {b['pullback_ms']:.1f} | {b['total_ms']:.1f} | "
                                 f"{100 * b['total_ms'] / total:.1f}% |")
            outside = total - sum(b["total_ms"] for b in s["blocks"].values())
            lines += [f"| outside blocks | | | {outside:.1f} | {100 * outside / total:.1f}% |",
                      f"| profiled step (mean) | | | {total:.1f} | 100% |", ""]
    versions = dict.fromkeys(s["implementation"].split(": ", 1)[0] for s in r["systems"].values())
    lines.append(f"- {r['machine']['cpu']}; {'; '.join(versions)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
