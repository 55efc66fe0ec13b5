"""`zoo bench`: one full training step (zero grads, forward, loss, backward, gradient clipping,
AdamW) of zoo and of an independent PyTorch eager implementation (zoo/tools/torch_reference.py,
stepped by zoo/tools/bench_torch.py), side by side, with the same weights and the same data.

Every system runs in a process of its own, one after the other, so each one's peak resident
memory is its own (getrusage's ru_maxrss, read in the child) and no two compete for the cores:

  zoo               python -m zoo.tools.bench_worker --mode time        timed, unprofiled, then sgemm
  zoo_bf16          ... bench_worker --mode time --precision bf16       bf16 matmuls, then a bf16 GEMM
  torch_fused       python zoo/tools/bench_torch.py --optimizer fused   AdamW(fused=True)
  torch_fused_bf16  ... bench_torch.py --optimizer fused --precision bf16
                                                                        autocast bf16, AdamW(fused=True)
  torch_default     python zoo/tools/bench_torch.py --optimizer default AdamW() as PyTorch defaults it
  torch_hf_<attn>   ... bench_torch.py --optimizer fused --hf-class <attn>
                                                                        transformers' own class of the
                                                                        config's family (--hf-class), eager
                                                                        or sdpa attention, AdamW(fused=True)
  torch_hf_<attn>_bf16  the same under autocast bf16 (with --precision bf16)
  (profile)         python -m zoo.tools.bench_worker --mode profile     per-block times, zoo's precision
                                                                        under test

The *_bf16 systems run with --precision bf16 only, next to the fp32 ones, in every round. The
torch_hf_* systems run with --hf-class (next to the reference ones with --vs torch, instead of
them with --vs hf); they get zoo's weights by name, so their losses are zoo's too.

This process writes the weights (zoo's init, zoo.arch.layout.initial_value), the token batch and
zoo's parameter layout into a temporary work folder that every worker reads. The FLOP count of
a step is analytic (see step_flops); docs/benchmarks.md explains every number.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

SCHEMA = "zoo-bench/2"
# The systems each --precision runs, in the order each round runs them.
SYSTEMS = {"fp32": ("zoo", "torch_fused", "torch_default"),
           "bf16": ("zoo", "zoo_bf16", "torch_fused", "torch_fused_bf16", "torch_default")}
SYSTEM_PRECISION = {"zoo": "fp32", "zoo_bf16": "bf16", "torch_fused": "fp32", "torch_fused_bf16": "bf16",
                    "torch_default": "fp32"}
TORCH_OPTIMIZER = {"torch_fused": "fused", "torch_fused_bf16": "fused", "torch_default": "default"}
# zoo in each precision: the system every other one of that precision is compared with.
ZOO_OF_PRECISION = {"fp32": "zoo", "bf16": "zoo_bf16"}
# The optimizer both sides run: AdamW, weight decay on 2-D matmul weights, global-norm clipping.
OPTIMIZER = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1, "max_grad_norm": 1.0}
BLOCK_KINDS = ("embedding", "norm", "linear", "rope", "attention", "activation", "lm_head", "cross_entropy", "adamw")
# transformers' attention implementations a torch_hf system can run (--hf-class); sdpa is
# transformers' default, eager its matmul-softmax-matmul.
HF_ATTENTION = ("sdpa", "eager")


def system_precision(name: str) -> str:
    """The precision of a system's matrix products: its name ends in _bf16 or it is fp32."""
    return "bf16" if name.endswith("_bf16") else "fp32"


def is_torch(name: str) -> bool:
    return name.startswith("torch_")


def hf_attention(name: str) -> Optional[str]:
    """The attention implementation of a torch_hf_<attn>[_bf16] system, else None."""
    if not name.startswith("torch_hf_"):
        return None
    return name[len("torch_hf_"):].removesuffix("_bf16")


def system_names(precision: str, vs: str, hf_attn: tuple[str, ...] = ()) -> list[str]:
    """The systems a run measures, in the order each round runs them: zoo's, then the reference
    PyTorch ones (--vs torch), then transformers' classes (--hf-class), each in fp32 and, with
    --precision bf16, under autocast."""
    names = [n for n in SYSTEMS[precision] if not is_torch(n) or vs == "torch"]
    for attn in hf_attn if vs in ("torch", "hf") else ():
        names.append(f"torch_hf_{attn}")
        if precision == "bf16":
            names.append(f"torch_hf_{attn}_bf16")
    return names


class BenchError(Exception):
    """A worker failed or a setting cannot be run: shown as a message, not a traceback."""


# --- command line -----------------------------------------------------------------------


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", default=None, help="a named architecture (default: gpt2)")
    model.add_argument("--config", metavar="FILE", default=None,
                       help="a YAML or JSON ModelConfig (or a training config with a `model:` section)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per system (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the systems in turn this many times and pool their steps; the ratios of "
                        "each round are reported too (default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"threads for every system (default: the CPUs this process may use, {default_threads()})")
    p.add_argument("--vs", choices=["torch", "hf", "none"], default=None,
                   help="compare with PyTorch eager (default when torch is installed), with transformers' "
                        "class alone (hf: the torch_hf systems of --hf-class, sdpa attention when "
                        "--hf-class names none), or measure zoo alone")
    p.add_argument("--hf-class", nargs="*", choices=HF_ATTENTION, default=None, metavar="ATTN",
                   help="also time transformers' own modeling class of the config's family (Qwen2ForCausalLM, "
                        "...; needs transformers), with zoo's weights, one system per attention "
                        "implementation named: sdpa (transformers' default, and the default here), eager")
    p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    p.add_argument("--png", metavar="FILE", default=None,
                   help="chart of step times and zoo's per-block times (default: next to --json)")
    p.add_argument("--ad", default="manual", help="zoo's differentiation backend (default: manual pullbacks)")
    p.add_argument("--checkpointing", action="store_true", help="zoo with activation checkpointing")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: also zoo with bf16 matmuls and PyTorch with autocast bf16, next to the fp32 "
                        "systems; needs a CPU with bf16 dot products (default fp32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the token batch (default 0)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zoo bench", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


def run_from_args(args: argparse.Namespace) -> int:
    """Runs the benchmark for parsed arguments and prints the table; 0, or 1 on an error."""
    try:
        cfg = model_config(args.preset, args.config)
        results = run_bench(
            cfg, preset_name=args.preset or (None if args.config else "gpt2"), config_file=args.config,
            batch=args.batch_size, seq_len=args.seq_len, steps=args.steps, warmup=args.warmup,
            rounds=args.rounds, threads=args.threads, vs=args.vs, ad=args.ad, checkpointing=args.checkpointing,
            seed=args.seed, precision=args.precision,
            hf_class=None if args.hf_class is None else tuple(args.hf_class or ("sdpa",)))
    except (BenchError, ValueError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"zoo bench: error: {msg}", file=sys.stderr)
        return 1
    print(markdown(results))
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        results["png"] = str(png)
        write_png(results, png)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.json or png:
        print(", ".join(f"wrote {f}" for f in (args.json, png) if f), file=sys.stderr)
    return 0


def model_config(preset: Optional[str], config_file: Optional[str]):
    """The ModelConfig to measure: a preset (default gpt2), or a YAML/JSON file holding a
    ModelConfig's fields, or a training config whose `model:` (or `preset:`) names one."""
    from ..arch.config import ModelConfig
    from ..arch.presets import preset as lookup

    if config_file is None:
        return lookup(preset or "gpt2")
    from ..train.config import read_config_file

    raw = read_config_file(config_file)
    if isinstance(raw.get("model"), dict):
        raw = raw["model"]
    elif isinstance(raw.get("preset"), str):
        return lookup(raw["preset"])
    try:
        return ModelConfig(**raw)
    except Exception as e:  # pydantic's ValidationError names the fields
        raise ValueError(f"config file {config_file}: not a model config: {e}") from None


# --- FLOPs --------------------------------------------------------------------------------


def matmul_params(cfg) -> int:
    """Parameters that take part in a matrix multiply: every layer's q/k/v, attention output,
    MLP in (gate and up for SwiGLU) and out weights, and the LM head (the embedding matrix
    again when tied). Embedding lookups, norms and biases are not matmuls."""
    from ..core import blocks

    fc_out = blocks.activations()[cfg.mlp]["gate_width"] * cfg.d_ff
    per_layer = cfg.d_model * cfg.qkv_dim + cfg.n_head * cfg.head_dim * cfg.d_model \
        + cfg.d_model * fc_out + cfg.d_ff * cfg.d_model
    return cfg.n_layer * per_layer + cfg.d_model * cfg.vocab_size


def step_flops(cfg, batch: int, seq_len: int) -> dict:
    """FLOPs of one training step, counted analytically.

    matmuls:   6 * N_matmul * B * T   (2 forward, 4 backward: the input and the weight gradient)
    attention: 6 * n_layer * B * T^2 * n_head * head_dim
               (QK^T and PV are 2 * T^2 * head_dim each per head forward, 4 * T^2 * hd forward,
                twice that backward: 12 * T^2 * hd per head; halved for the causal mask)
    """
    tokens = batch * seq_len
    n = matmul_params(cfg)
    mm = 6 * n * tokens
    att = 12 * cfg.n_layer * batch * seq_len * seq_len * cfg.head_dim * cfg.n_head // 2
    return {"total": mm + att, "matmul": mm, "attention": att, "matmul_params": n,
            "formula": "6 * N_matmul * B * T + 6 * n_layer * B * T^2 * n_head * head_dim"}


# --- running ------------------------------------------------------------------------------


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def transformers_available() -> bool:
    return torch_available() and importlib.util.find_spec("transformers") is not None


def write_workdir(workdir: Path, cfg, batch: int, seq_len: int, seed: int, hf_config: Optional[dict] = None) -> None:
    """manifest.json, weights.bin (float32, zoo's arena order) and tokens.bin (int32, B x (T+1)).
    The weights are zoo's init (zoo.arch.layout.initial_value, the draws in the order zoo.Model(cfg,
    seed) makes them, so they are the weights of that model); written one tensor at a time.
    hf_config: the transformers config of cfg (zoo.io.hf_config.config_to_hf), for --hf-class."""
    import numpy as np

    from .. import families
    from ..arch.layout import initial_value, parameter_layout

    rng = np.random.default_rng(seed)
    entries, offset = [], 0
    family = families.get(cfg.family)
    with open(workdir / "weights.bin", "wb") as f:
        for p in parameter_layout(cfg):
            f.write(initial_value(p, rng, cfg.n_layer).tobytes())
            order = family.row_order(cfg, p.name)  # rows a checkpoint keeps in another order (GPT-NeoX's q|k|v)
            entries.append({"name": p.name, "shape": list(p.shape), "role": p.role, "layer": p.layer,
                            "offset": offset, "decay": p.decay, "hf_transposed": p.hf_transposed,
                            "hf_row_order": None if order is None else order.tolist()})
            offset += math.prod(p.shape)
    tokens = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, (batch, seq_len + 1), dtype=np.int32)
    tokens.tofile(workdir / "tokens.bin")
    manifest = {"config": cfg.model_dump(), "batch": batch, "seq_len": seq_len, "optimizer": OPTIMIZER,
                "params": entries, "hf_config": hf_config}
    (workdir / "manifest.json").write_text(json.dumps(manifest))


def _run_worker(what: str, cmd: list[str], out: Path, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    print(f"zoo bench: {what} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd + ["--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        if proc.returncode < 0:
            tail += f"\n(killed by signal {-proc.returncode}{': out of memory?' if proc.returncode == -9 else ''})"
        raise BenchError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(out.read_text())
    result["process_wall_s"] = time.perf_counter() - t0
    return result


def _summary(runs: list[dict], tokens: int, flops: float) -> dict:
    """One system over its rounds: steps pooled, the highest peak RSS, the first round's losses."""
    raw = runs[0]
    ms = [1000.0 * s for run in runs for s in run["step_s"]]
    median = statistics.median(ms)
    out = {"step_ms_median": median, "step_ms_min": min(ms), "step_ms_max": max(ms),
           "tokens_per_s": tokens / (median / 1000.0), "peak_rss_mib": max(run["peak_rss_mib"] for run in runs),
           "step_ms_mean": statistics.fmean(ms), "step_ms": ms, "gflops": flops / (median / 1000.0) / 1e9,
           "threads": raw["threads"], "loss_first": raw["losses"][0], "loss_last": raw["losses"][-1],
           "rss_after_import_mib": raw["rss_after_import_mib"], "implementation": raw["implementation"]}
    for k in ("activation_mib", "torch_version", "build_info", "build_s", "hf_class", "hf_attention",
              "transformers_version", "imported_zoo"):
        if k in raw:
            out[k] = raw[k]
    if raw.get("activation_error"):
        out["activation_error"] = raw["activation_error"]
    return out


def _gemm_rate(runs: list[dict], what: str) -> dict:
    """The GEMM rate a zoo worker measured after its timed steps: the median over the rounds,
    the best call of any round."""
    out = {"what": what, **runs[0]["sgemm"]}
    out["gflops_median"] = statistics.median(run["sgemm"]["gflops_median"] for run in runs)
    out["gflops_best"] = max(run["sgemm"]["gflops_best"] for run in runs)
    return out


def products_table(used: list[dict], system: str) -> list[str]:
    """The products a worker ran on oneDNN, one line each, with the kernel it ran on; a line
    of warning first where some bf16 product ran on a kernel without bf16 dot products."""
    if not used:
        return []
    slow = [u for u in used if u["precision"] == "bf16" and not u["bf16_kernel"]]
    lines = ["", f"{system}'s products on oneDNN, as run (op(A) M x K times op(B) K x N; calls over all its steps):", ""]
    if slow:
        lines[1:1] = ["", f"**warning: {len(slow)} of {system}'s {len(used)} bf16 product shapes ran on kernels "
                          f"without bf16 dot products** ({', '.join(sorted({u['kernel'] for u in slow}))})"]
    lines += ["| M x N x K | transposed | operands | kernel | calls |", "|---|---|---|---|---:|"]
    for u in used:
        trans = "+".join(n for n, t in (("A", u["trans_a"]), ("B", u["trans_b"])) if t) or "none"
        operands = "bf16" if u["bf16_operands"] else "fp32"
        lines.append(f"| {u['M']} x {u['N']} x {u['K']} | {trans} | {operands} | {u['kernel']} | {u['calls']} |")
    return lines


def _gemm_report(zoo_fp32: dict, zoo_bf16: Optional[dict], m: int, k: int, n: int) -> dict:
    """The GEMM libraries, the LM head's kernels and the CPU, as the zoo workers ran them (each
    precision from the worker that ran it)."""
    under_test = zoo_bf16 or zoo_fp32
    return {
        "fp32_library": zoo_fp32["gemm"]["fp32"],
        "bf16_library": zoo_bf16["gemm"]["bf16"] if zoo_bf16 else None,
        "lm_head_kernel": {"fp32": zoo_fp32["gemm_kernel"], "bf16": zoo_bf16["gemm_kernel"] if zoo_bf16 else None},
        # Each product (shape) the timed workers ran on oneDNN, with its kernel and calls.
        "products": {"fp32": zoo_fp32.get("kernels_used", []),
                     "bf16": zoo_bf16.get("kernels_used", []) if zoo_bf16 else []},
        "lm_head_shape": {"m": m, "k": k, "n": n},
        "built_in": under_test["gemm"]["built_in"],
        "cpu_vendor": under_test["gemm"]["cpu_vendor"],
        "onednn_isa": under_test["gemm"]["onednn_isa"],
        # OpenBLAS's kernels as the process ran them (OPENBLAS_CORETYPE, or OpenBLAS's own pick)
        "openblas_core": under_test["gemm"].get("openblas_core"),
        "openblas_coretype_env": os.environ.get("OPENBLAS_CORETYPE"),  # the workers inherit it
        "bf16_native": under_test["gemm"]["bf16_native"],
        "cpu": under_test["cpu"]["model"],
        "cpu_flags": under_test["cpu"]["flags"],
    }


def run_bench(cfg, *, preset_name: Optional[str] = None, config_file: Optional[str] = None, batch: int = 4,
              seq_len: int = 64, steps: int = 10, warmup: int = 3, rounds: int = 1, threads: Optional[int] = None,
              vs: Optional[str] = None, ad: str = "manual", checkpointing: bool = False,
              seed: int = 0, precision: str = "fp32", hf_class: Optional[tuple[str, ...]] = None) -> dict:
    """Runs every worker and returns the results (the --json document). hf_class: the attention
    implementations of transformers' class to time (torch_hf_<attn> systems), or None."""
    from ..arch.layout import num_parameters

    for name, v, low in (("--batch-size", batch, 1), ("--seq-len", seq_len, 1), ("--steps", steps, 1),
                         ("--warmup", warmup, 0), ("--rounds", rounds, 1)):
        if v < low:
            raise ValueError(f"{name} must be at least {low}, got {v}")
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's context ({cfg.max_seq_len})")
    threads = threads or default_threads()
    if threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    if vs is None:
        vs = "torch" if torch_available() else "none"
    elif vs == "torch" and not torch_available():
        raise ValueError("--vs torch: PyTorch is not installed here (pip install torch), or use --vs none")
    if vs == "hf" and not hf_class:
        hf_class = ("sdpa",)
    if hf_class and vs == "none":
        raise ValueError("--hf-class: transformers' class is a PyTorch system; --vs none measures zoo alone")
    hf_class = tuple(dict.fromkeys(hf_class or ()))
    bad = [a for a in hf_class if a not in HF_ATTENTION]
    if bad:
        raise ValueError(f"--hf-class {bad[0]}: choose from {', '.join(HF_ATTENTION)}")
    hf_config = None
    if hf_class:
        if not transformers_available():
            raise ValueError("--hf-class: PyTorch and transformers must be installed (pip install -e '.[dev]')")
        from ..io.hf_config import config_to_hf

        hf_config = config_to_hf(cfg)  # a CheckpointError names the field transformers' class cannot express
    if precision not in SYSTEMS:
        raise ValueError(f"--precision {precision!r}: choose fp32 or bf16")
    if precision == "bf16":
        from ..core.gemm import check_precision

        check_precision("bf16")  # a PrecisionError (a ValueError) names what is missing, before any work

    tokens = batch * seq_len
    flops = step_flops(cfg, batch, seq_len)
    to_run = system_names(precision, vs, hf_class)
    names = list(SYSTEMS[precision]) + [n for n in to_run if n not in SYSTEMS[precision]]
    common = ["--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads)]
    zoo_flags = ["--ad", ad] + (["--checkpointing"] if checkpointing else [])
    raw: dict[str, list[dict]] = {}  # system -> one result per round
    with tempfile.TemporaryDirectory(prefix="zoo-bench-") as tmp:
        work = Path(tmp)
        print(f"zoo bench: writing weights and data ({num_parameters(cfg):,} parameters)", file=sys.stderr)
        write_workdir(work, cfg, batch, seq_len, seed, hf_config)
        zoo_cmd = [sys.executable, "-m", "zoo.tools.bench_worker", "--workdir", tmp] + common + zoo_flags
        # By path, not -m: the PyTorch process must not import zoo (bench_torch.py says why).
        script = str(Path(__file__).with_name("bench_torch.py"))
        for r in range(rounds):
            of = f" (round {r + 1} of {rounds})" if rounds > 1 else ""
            for name in to_run:
                p = system_precision(name)
                if is_torch(name):
                    what = f"{name}: {steps} steps after {warmup} warm-up{of}"
                    cmd = [sys.executable, script, "--workdir", tmp, "--optimizer", TORCH_OPTIMIZER.get(name, "fused"),
                           "--precision", p] + common
                    if hf_attention(name):
                        cmd += ["--hf-class", hf_attention(name)]
                else:
                    what = f"{name}: {steps} steps after {warmup} warm-up, then the {p} GEMM{of}"
                    cmd = zoo_cmd + ["--mode", "time", "--precision", p]
                raw.setdefault(name, []).append(_run_worker(what, cmd, work / f"{name}.json", threads))
        profile = _run_worker(f"zoo ({precision}), profiled per block",
                              zoo_cmd + ["--mode", "profile", "--precision", precision],
                              work / "profile.json", threads)

    systems = {}
    for name in names:
        systems[name] = None
        if name in raw:
            systems[name] = _summary(raw[name], tokens, flops["total"])
            systems[name]["precision"] = system_precision(name)
    # Every system against zoo in the same precision: zoo_over_torch_fused, zoo_bf16_over_torch_fused_bf16, ...
    pairs = [(ZOO_OF_PRECISION[system_precision(n)], n) for n in names if is_torch(n)]
    ratios = {}
    for a, b in pairs:
        sa, sb = systems[a], systems[b]
        ratios[f"{a}_over_{b}"] = None if sb is None else {
            "step_time": sa["step_ms_median"] / sb["step_ms_median"],
            "tokens_per_s": sa["tokens_per_s"] / sb["tokens_per_s"],
            "peak_rss": sa["peak_rss_mib"] / sb["peak_rss_mib"]}

    prof_ms = [1000.0 * s for s in profile["step_s"]]
    blocks = {}
    for kind in BLOCK_KINDS + tuple(k for k in profile["blocks_s"] if k not in BLOCK_KINDS):
        fwd, back = profile["blocks_s"].get(kind, (0.0, 0.0))
        blocks[kind] = {"forward_ms": 1000.0 * fwd / steps, "pullback_ms": 1000.0 * back / steps,
                        "total_ms": 1000.0 * (fwd + back) / steps}
    in_blocks = sum(b["total_ms"] for b in blocks.values())
    prof_mean = statistics.fmean(prof_ms)
    # Each round pairs zoo's median step with the GEMM rate measured right after it, in each precision.
    by_round = []
    for r in range(rounds):
        ms = {name: 1000.0 * statistics.median(raw[name][r]["step_s"]) for name in raw}
        sgemm_r = raw["zoo"][r]["sgemm"]["gflops_median"]
        entry = {"zoo_step_ms": ms["zoo"], "sgemm_gflops": sgemm_r,
                 "zoo_step_fraction_of_sgemm": flops["total"] / (ms["zoo"] / 1000.0) / 1e9 / sgemm_r}
        if "zoo_bf16" in raw:
            bf16_r = raw["zoo_bf16"][r]["sgemm"]["gflops_median"]
            entry.update({"zoo_bf16_step_ms": ms["zoo_bf16"], "bf16_gemm_gflops": bf16_r,
                          "zoo_bf16_step_fraction_of_bf16_gemm":
                              flops["total"] / (ms["zoo_bf16"] / 1000.0) / 1e9 / bf16_r})
        for a, b in pairs:
            if b in raw:
                entry[f"{b}_step_ms"] = ms[b]
                entry[f"{a}_over_{b}"] = ms[a] / ms[b]
        by_round.append(entry)
    sgemm = _gemm_rate(raw["zoo"], "zoo._native.blocks.linear_forward: (m, k) x (k, n), the LM head forward, "
                                   "in zoo's timing process right after its timed steps (median over rounds)")
    zoo_gflops = systems["zoo"]["gflops"]
    bf16_gemm = zoo_bf16_gflops = None
    if "zoo_bf16" in raw:
        bf16_gemm = _gemm_rate(raw["zoo_bf16"], "zoo._native.gemm(x, w, False, True, 'bf16'): x (m, k) times W (n, k) "
                                                "transposed, the LM head forward in bf16, in zoo_bf16's timing "
                                                "process right after its timed steps (median over rounds)")
        zoo_bf16_gflops = systems["zoo_bf16"]["gflops"]
    gemm = _gemm_report(raw["zoo"][0], raw["zoo_bf16"][0] if "zoo_bf16" in raw else None,
                        sgemm["m"], sgemm["k"], sgemm["n"])
    return {
        "schema": SCHEMA,
        "command": shlex.join(
            ["zoo", "bench", *(["--config", config_file] if config_file else ["--preset", preset_name or "?"]),
             "--batch-size", str(batch), "--seq-len", str(seq_len), "--steps", str(steps), "--warmup", str(warmup),
             "--rounds", str(rounds), "--threads", str(threads), "--vs", vs, "--ad", ad, "--seed", str(seed),
             "--precision", precision]
            + (["--checkpointing"] if checkpointing else []) + (["--hf-class", *hf_class] if hf_class else [])),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {"preset": preset_name, "config_file": config_file, "config": cfg.model_dump(),
                  "n_params": num_parameters(cfg), "matmul_params": flops["matmul_params"]},
        "batch": batch, "seq_len": seq_len, "tokens_per_step": tokens, "steps": steps, "warmup": warmup,
        "rounds": rounds,
        "threads": threads, "vs": vs, "ad": ad, "checkpointing": checkpointing, "seed": seed,
        "precision": precision, "hf_class": list(hf_class), "system_order": to_run,
        "hf_config": hf_config,
        "optimizer": dict(OPTIMIZER, name="AdamW", clipping="global L2 norm",
                          decay_on="2-D matmul weights (zoo's decay mask)"),
        "flops_per_step": flops["total"],
        "flops": {k: flops[k] for k in ("matmul", "attention", "formula")},
        "systems": systems,
        "ratios": ratios,
        "sgemm_gflops": sgemm["gflops_median"],
        "zoo_step_gflops": zoo_gflops,
        "zoo_step_fraction_of_sgemm": zoo_gflops / sgemm["gflops_median"],
        "bf16_gemm_gflops": bf16_gemm["gflops_median"] if bf16_gemm else None,
        "zoo_bf16_step_gflops": zoo_bf16_gflops,
        "zoo_bf16_step_fraction_of_bf16_gemm": zoo_bf16_gflops / bf16_gemm["gflops_median"] if bf16_gemm else None,
        "by_round": by_round,
        "sgemm": sgemm,
        "bf16_gemm": bf16_gemm,
        "gemm": gemm,
        "blocks": blocks,
        "blocks_profile": {"precision": precision, "norm": cfg.norm, "activation": cfg.mlp, "steps": steps,
                           "step_ms_mean": prof_mean, "step_ms_median": statistics.median(prof_ms),
                           "in_blocks_ms": in_blocks, "outside_blocks_ms": max(prof_mean - in_blocks, 0.0)},
        "machine": machine_info(),
    }


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy

    info = {"cpu": cpu, "cpus_usable": default_threads(), "cpus_total": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(), "numpy": numpy.__version__,
            "hostname": platform.node()}
    try:
        import zoo

        info["zoo"] = zoo.__version__
        info["zoo_build"] = zoo.build_info()
    except Exception:  # the build info is a courtesy; the workers already ran zoo
        pass
    try:
        from importlib.metadata import version

        info["torch"] = version("torch")
    except Exception:
        info["torch"] = None
    return info


# --- reporting ----------------------------------------------------------------------------


def _f(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def markdown(r: dict) -> str:
    m, cfg = r["model"], r["model"]["config"]
    bf16 = r["precision"] == "bf16"
    name = m["preset"] or m["config_file"] or "model"
    lines = [
        f"## zoo bench: {name} ({m['n_params']:,} parameters), batch {r['batch']} x seq {r['seq_len']} "
        f"= {r['tokens_per_step']} tokens, {r['threads']} thread{'s' if r['threads'] != 1 else ''}",
        "",
        f"{r['steps']} timed steps after {r['warmup']} warm-up, each system in its own process"
        + (f", the systems in turn {r['rounds']} times (steps pooled)" if r["rounds"] > 1 else "")
        + ". A step: zero "
        f"grads, forward, cross-entropy, backward, clip to norm {r['optimizer']['max_grad_norm']}, AdamW "
        f"(weight decay {r['optimizer']['weight_decay']}).",
        "",
        "| system | step ms (median) | min | max | tokens/s | GFLOP/s | peak RSS MiB | zoo step / this step"
        + (" (zoo in this precision)" if bf16 else "") + " |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    # With bf16 the fp32 systems say so: both precisions share the table.
    fp32 = " fp32" if bf16 else ""
    checkpointing = " (checkpointing)" if r["checkpointing"] else ""
    labels = {"zoo": ("zoo: fp32" if bf16 else "zoo") + checkpointing,
              "zoo_bf16": "zoo_bf16: bf16 matmuls" + checkpointing,
              "torch_fused": f"torch_fused: eager{fp32}, AdamW(fused=True)",
              "torch_fused_bf16": "torch_fused_bf16: eager, autocast bf16, AdamW(fused=True)",
              "torch_default": f"torch_default: eager{fp32}, AdamW()"}
    for key in r.get("system_order") or SYSTEMS[r["precision"]]:
        s = r["systems"][key]
        if s is None:
            continue
        if hf_attention(key):
            labels[key] = (f"{key}: transformers {s.get('hf_class', '?')} ({hf_attention(key)} attention)"
                           + (", autocast bf16" if system_precision(key) == "bf16" else fp32) + ", AdamW(fused=True)")
        zoo_ms = r["systems"][ZOO_OF_PRECISION[system_precision(key)]]["step_ms_median"]
        lines.append(f"| {labels[key]} | {_f(s['step_ms_median'])} | {_f(s['step_ms_min'])} | {_f(s['step_ms_max'])} "
                     f"| {_f(s['tokens_per_s'], 0)} | {_f(s['gflops'])} | {_f(s['peak_rss_mib'], 0)} "
                     f"| {zoo_ms / s['step_ms_median']:.3f}x |")
    lines.append("")
    for key, ratio in r["ratios"].items():
        if ratio:
            this, other = key.split("_over_")
            lines.append(f"- {this} / {other}: step time {ratio['step_time']:.3f}x, peak RSS {ratio['peak_rss']:.3f}x")
    if r["vs"] == "none":
        lines.append("- zoo alone (--vs none)")
    for name in ("zoo", "zoo_bf16"):
        act = r["systems"].get(name, {}).get("activation_mib")
        if act is not None:
            lines.append(f"- {name}'s activation arena: {act:,.1f} MiB"
                         + (" (activation checkpointing)" if r["checkpointing"] else ""))
    f = r["flops"]
    sg = r["sgemm"]
    lines += [
        f"- FLOPs per step: {r['flops_per_step'] / 1e9:,.2f} GFLOP = matmuls 6 x {r['model']['matmul_params']:,} x "
        f"{r['tokens_per_step']} ({f['matmul'] / 1e9:,.2f}) + causal attention ({f['attention'] / 1e9:,.3f})",
        f"- sgemm, zoo linear_forward at the LM head shape ({sg['m']} x {sg['k']}) x ({sg['k']} x {sg['n']}), "
        f"right after zoo's timed steps: {r['sgemm_gflops']:,.1f} GFLOP/s (median of {sg['reps']} calls"
        + (" per round, over the rounds" if r["rounds"] > 1 else "") + f"; best {sg['gflops_best']:,.1f})",
        f"- zoo's whole step: {r['zoo_step_gflops']:,.1f} GFLOP/s = {100 * r['zoo_step_fraction_of_sgemm']:.0f}% "
        "of that sgemm rate",
    ]
    if bf16:
        bg = r["bf16_gemm"]
        lines += [
            f"- bf16 GEMM, zoo _native.gemm in bf16 at the same shape, right after zoo_bf16's timed steps: "
            f"{r['bf16_gemm_gflops']:,.1f} GFLOP/s (median of {bg['reps']} calls"
            + (" per round, over the rounds" if r["rounds"] > 1 else "") + f"; best {bg['gflops_best']:,.1f})",
            f"- zoo_bf16's whole step: {r['zoo_bf16_step_gflops']:,.1f} GFLOP/s = "
            f"{100 * r['zoo_bf16_step_fraction_of_bf16_gemm']:.0f}% of that bf16 rate",
        ]
    g = r["gemm"]
    libraries = f"fp32 on {g['fp32_library']} (LM head kernel {g['lm_head_kernel']['fp32']}"
    if g["fp32_library"] == "openblas" and g.get("openblas_core"):
        libraries += f", OpenBLAS's {g['openblas_core']} kernels"
        if g.get("openblas_coretype_env"):
            libraries += f" as OPENBLAS_CORETYPE={g['openblas_coretype_env']} picks"
    libraries += ")"
    if g["bf16_library"]:
        libraries += f", bf16 on {g['bf16_library']} (LM head kernel {g['lm_head_kernel']['bf16']})"
    lines.append(f"- GEMM as zoo's workers ran it: {libraries}; CPU {g['cpu'] or 'unknown'} ({g['cpu_vendor']}), "
                 f"flags {' '.join(g['cpu_flags']) or 'none of avx2/avx512f/bf16'}, oneDNN ISA "
                 f"{g['onednn_isa'] or 'none'}, bf16 dot products {'yes' if g['bf16_native'] else 'no'}")
    lines += products_table(g["products"]["bf16"], "zoo_bf16")
    if r["rounds"] > 1:
        # Each compared system next to the zoo of its precision (the ratios' pairs).
        pairs = [key.split("_over_") for key, ratio in r["ratios"].items() if ratio]
        head = "| round | zoo ms | sgemm GFLOP/s | zoo / sgemm rate |"
        if bf16:
            head += " zoo_bf16 ms | bf16 GEMM GFLOP/s | zoo_bf16 / bf16 rate |"
        head += "".join(f" {b} ms | {a} / {b} |" for a, b in pairs)
        lines += ["", head, "|---:" * head[1:].count("|") + "|"]
        for i, e in enumerate(r["by_round"], 1):
            row = (f"| {i} | {_f(e['zoo_step_ms'])} | {_f(e['sgemm_gflops'])} | "
                   f"{100 * e['zoo_step_fraction_of_sgemm']:.0f}% |")
            if bf16:
                row += (f" {_f(e['zoo_bf16_step_ms'])} | {_f(e['bf16_gemm_gflops'])} | "
                        f"{100 * e['zoo_bf16_step_fraction_of_bf16_gemm']:.0f}% |")
            row += "".join(f" {_f(e[f'{b}_step_ms'])} | {e[f'{a}_over_{b}']:.3f}x |" for a, b in pairs)
            lines.append(row)
    lines += [
        "",
        f"### zoo per block (a separate profiled run{', bf16 matmuls' if bf16 else ''}, ms per step, "
        f"mean of {r['blocks_profile']['steps']})",
        "",
        "| block | forward | pullback | total | share |",
        "|---|---:|---:|---:|---:|",
    ]
    bp = r["blocks_profile"]
    shown = {"norm": f"norm ({bp['norm']})", "activation": f"activation ({bp['activation']})",
             "adamw": "adamw (clip + update)"}
    total = bp["step_ms_mean"]
    for kind, b in r["blocks"].items():
        if kind == "rope" and cfg["positions"] != "rope":
            continue
        lines.append(f"| {shown.get(kind, kind)} | {b['forward_ms']:.2f} | {b['pullback_ms']:.2f} | "
                     f"{b['total_ms']:.2f} | {100 * b['total_ms'] / total:.1f}% |")
    lines.append(f"| outside blocks | | | {bp['outside_blocks_ms']:.2f} | "
                 f"{100 * bp['outside_blocks_ms'] / total:.1f}% |")
    lines.append(f"| profiled step (mean) | | | {total:.2f} | 100% |")
    return "\n".join(lines)


def write_png(r: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bf16 = r["precision"] == "bf16"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14 if bf16 else 12, 4.8),
                                   gridspec_kw={"width_ratios": [1.4 if bf16 else 1, 1.5]})
    names = [k for k in r.get("system_order") or SYSTEMS[r["precision"]] if r["systems"][k] is not None]
    med = [r["systems"][k]["step_ms_median"] for k in names]
    lo = [m - r["systems"][k]["step_ms_min"] for k, m in zip(names, med)]
    hi = [r["systems"][k]["step_ms_max"] - m for k, m in zip(names, med)]
    # The bf16 bars in a lighter shade of their fp32 system's colour.
    colors = {"zoo": "tab:green", "zoo_bf16": "yellowgreen", "torch_fused": "tab:blue",
              "torch_fused_bf16": "lightskyblue", "torch_default": "tab:gray"}
    for k in names:
        if hf_attention(k):
            colors[k] = "navajowhite" if system_precision(k) == "bf16" else "tab:orange"
    bars = ax1.bar(names, med, yerr=[lo, hi], capsize=6, color=[colors[k] for k in names])
    ax1.tick_params(axis="x", labelsize=8 if len(names) > 3 else 10)
    for b, k in zip(bars, names):
        ax1.annotate(f"{r['systems'][k]['step_ms_median']:,.0f} ms\n{r['systems'][k]['peak_rss_mib']:,.0f} MiB",
                     (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8,
                     xytext=(0, 3), textcoords="offset points")
    ax1.set_ylabel("ms per training step (median, min-max)")
    ax1.set_title(f"{r['model']['preset'] or 'model'}, B={r['batch']}, T={r['seq_len']}, {r['threads']} threads")
    ax1.margins(y=0.2)

    kinds = [k for k, b in r["blocks"].items() if b["total_ms"] > 0] or list(r["blocks"])
    fwd = [r["blocks"][k]["forward_ms"] for k in kinds]
    back = [r["blocks"][k]["pullback_ms"] for k in kinds]
    ax2.barh(kinds, fwd, color="tab:orange", label="forward (adamw: update)")
    ax2.barh(kinds, back, left=fwd, color="tab:purple", label="pullback")
    ax2.invert_yaxis()
    ax2.set_xlabel("ms per step")
    if bf16:
        ax2.set_title(f"zoo per block (profiled, bf16); bf16 GEMM {r['bf16_gemm_gflops']:,.0f} GFLOP/s, "
                      f"step {r['zoo_bf16_step_gflops']:,.0f} GFLOP/s", fontsize=10)
    else:
        ax2.set_title(f"zoo per block (profiled); sgemm {r['sgemm_gflops']:,.0f} GFLOP/s, "
                      f"step {r['zoo_step_gflops']:,.0f} GFLOP/s")
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
