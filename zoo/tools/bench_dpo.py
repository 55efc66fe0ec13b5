"""DPO steps of zoo and of TRL's DPOTrainer + PEFT, side by side in one run: random weights of a
preset's shape, LoRA (rank 16) on every linear layer inside the blocks, one preference pair per
step (a prompt and two answers of random token ids), bf16 products.

  python -m zoo.tools.bench_dpo --preset llama-3.2-1b --prompt-len 128 --answer-len 128 --rank 16 \\
      --threads 2 --rounds 2 --json benchmarks/dpo-llama-3.2-1b.json

Every system runs in a process of its own, one after the other, the systems taking turns over
--rounds rounds (A B C A B C), so that each one's peak resident memory (getrusage's ru_maxrss,
read in the child) is its own, none competes for the cores, and a slow spell of a shared machine
falls on all of them:

  zoo           python -m zoo.tools.bench_dpo --worker ...: what `zoo finetune --lora --method dpo`
                runs by default: the bf16 frozen base, fp32 adapters, bf16 products, activation
                checkpointing as the method's default has it (TrainConfig.checkpoint_layers: the
                first k layers, the fewest within config.DEFAULT_CHECKPOINT_GROWTH of the memory
                of checkpointing all);
                a step: the reference's forward (the adapters off), the policy's forward with the
                LM head on the answers alone, the pullback, AdamW. The pair packed as zoo trains
                it: the prompt computed once for both answers.
  zoo_checkpointing, zoo_no_checkpointing  the same with every layer checkpointed, or none
                (every layer's activations kept: a forward less, more memory).
  zoo_unshared  the same as zoo with the pair laid out as TRL runs it, prompt + chosen and
                prompt + rejected as two sequences: what computing the prompt once saves.
  trl           python zoo/tools/bench_dpo_trl.py: TRL's DPOTrainer over a PEFT LoRA model
                (transformers' model of the preset's config, bf16 weights, fp32 adapters, bf16
                autocast: DPOConfig(bf16=True)), trainer.train() timed step by step; its default
                gradient checkpointing off unless --trl-checkpointing.
  trl_fp32      the same with the model's weights in fp32 (transformers' default dtype) under
                the same bf16 autocast.

TRL, PyTorch, transformers and PEFT are optional: benchmark (and test) dependencies only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from .bench import (
    BenchError,
    _run_worker,
    default_threads,
    machine_info,
    matmul_params,
    model_config,
)

SCHEMA = "zoo-bench-dpo/1"
OPTIMIZER = {"lr": 5e-6, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0}
SYSTEMS = ("zoo", "zoo_checkpointing", "zoo_no_checkpointing", "zoo_unshared", "trl", "trl_fp32")
# The worker's --checkpointing of each zoo system (default: the method's, TrainConfig.checkpoint_layers).
CHECKPOINTING = {"zoo_checkpointing": "on", "zoo_no_checkpointing": "off"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="llama-3.2-1b", help="a named architecture (default: llama-3.2-1b)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--answer-len", type=int, default=128, help="tokens of each answer, EOS included (default 128)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank r (default 16; alpha 2 r)")
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta (default 0.1)")
    p.add_argument("--systems", nargs="+", default=["zoo", "zoo_unshared", "trl"], metavar="SYSTEM",
                   help=f"what to measure: {', '.join(SYSTEMS)} (default zoo zoo_unshared trl; trl needs trl, "
                        "peft and transformers)")
    p.add_argument("--trl-checkpointing", action="store_true", help="TRL with gradient checkpointing (its default)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per system and round (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--rounds", type=int, default=2, help="turns each system takes (default 2)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"threads for every system (default: the CPUs this process may use, {default_threads()})")
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids (default 0)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")


def main(argv: Optional[list[str]] = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m zoo.tools.bench_dpo", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        results = run_bench(args)
    except (BenchError, ValueError, OSError) as e:
        print(f"bench_dpo: error: {e}", file=sys.stderr)
        return 1
    print(markdown(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def run_bench(args: argparse.Namespace) -> dict:
    import numpy as np

    from ..arch.layout import num_parameters
    from ..arch.lora import module_names
    from ..io.hf_config import config_to_hf

    cfg = model_config(args.preset, None)
    for name, v, low in (("--prompt-len", args.prompt_len, 1), ("--answer-len", args.answer_len, 2),
                         ("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--rounds", args.rounds, 1),
                         ("--rank", args.rank, 1)):
        if v < low:
            raise ValueError(f"{name} must be at least {low}, got {v}")
    systems = list(dict.fromkeys(args.systems))
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise ValueError(f"--systems {bad[0]}: choose from {', '.join(SYSTEMS)}")
    if any(s.startswith("trl") for s in systems) and not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft", "trl")):
        raise ValueError("--systems trl needs torch, transformers, peft and trl (pip install -e '.[dev]')")
    threads = args.threads or default_threads()
    rng = np.random.default_rng(args.seed)
    eos = 1  # a token id of the vocabulary, the EOS of the TRL worker's tokenizer too
    low = 3  # ids 0..2 are that tokenizer's specials
    pair = {"prompt": rng.integers(low, cfg.vocab_size, args.prompt_len).tolist(),
            "chosen": rng.integers(low, cfg.vocab_size, args.answer_len - 1).tolist() + [eos],
            "rejected": rng.integers(low, cfg.vocab_size, args.answer_len - 1).tolist() + [eos]}
    lora = {"r": args.rank, "alpha": 2.0 * args.rank, "dropout": 0.0, "targets": module_names(cfg)}
    raw: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="zoo-bench-dpo-") as tmp:
        work = Path(tmp)
        manifest = {"config": cfg.model_dump(), "hf_config": config_to_hf(cfg), "pair": pair, "eos": eos,
                    "lora": lora, "beta": args.beta, "optimizer": OPTIMIZER,
                    "trl_checkpointing": args.trl_checkpointing}
        (work / "manifest.json").write_text(json.dumps(manifest))
        common = ["--workdir", str(work), "--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--threads", str(threads)]
        for round_ in range(args.rounds):
            for system in systems:
                if system.startswith("trl"):
                    cmd = [sys.executable, str(Path(__file__).with_name("bench_dpo_trl.py")), "--weights",
                           "fp32" if system == "trl_fp32" else "bf16", *common]
                else:
                    cmd = [sys.executable, "-m", "zoo.tools.bench_dpo", "--worker", "--layout",
                           "apart" if system == "zoo_unshared" else "shared", "--checkpointing",
                           CHECKPOINTING.get(system, "default"), *common]
                raw[system].append(_run_worker(f"{system} (round {round_ + 1})", cmd,
                                               work / f"{system}-{round_}.json", threads))
    out = {}
    for system, runs in raw.items():
        ms = [1000 * s for run in runs for s in run["step_s"]]
        cpu = [s for run in runs for s in run["step_cpu_s"]]
        out[system] = {"step_ms_median": statistics.median(ms), "step_ms_min": min(ms), "step_ms_max": max(ms),
                       "step_ms": ms, "step_cpu_s_median": statistics.median(cpu), "step_cpu_s": cpu,
                       "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
                       "peak_rss_mib_per_round": [r["peak_rss_mib"] for r in runs],
                       "tokens_forward": runs[0]["tokens_forward"], "implementation": runs[0]["implementation"],
                       "losses": runs[0]["losses"], "build_s": runs[0]["build_s"]}
        for key in ("rss_after_import_mib", "rss_built_mib", "arena_mib", "checkpointing"):  # zoo's only
            if key in runs[0]:
                out[system][key] = runs[0][key]
    ratios = {}
    for a in (s for s in out if s.startswith("zoo")):
        for b in (s for s in out if s.startswith("trl")):
            ratios[f"{a}_over_{b}"] = {"step_time": out[a]["step_ms_median"] / out[b]["step_ms_median"],
                                       "step_cpu_time": out[a]["step_cpu_s_median"] / out[b]["step_cpu_s_median"],
                                       "peak_rss": out[a]["peak_rss_mib"] / out[b]["peak_rss_mib"]}
    if "zoo" in out and "zoo_unshared" in out:
        ratios["prompt_sharing"] = {"step_time": out["zoo"]["step_ms_median"] / out["zoo_unshared"]["step_ms_median"],
                                    "step_cpu_time": out["zoo"]["step_cpu_s_median"]
                                    / out["zoo_unshared"]["step_cpu_s_median"],
                                    "peak_rss": out["zoo"]["peak_rss_mib"] / out["zoo_unshared"]["peak_rss_mib"],
                                    "tokens": out["zoo"]["tokens_forward"] / out["zoo_unshared"]["tokens_forward"]}
    command = ["python", "-m", "zoo.tools.bench_dpo", "--preset", args.preset, "--prompt-len", str(args.prompt_len),
               "--answer-len", str(args.answer_len), "--rank", str(args.rank), "--beta", f"{args.beta:g}",
               "--systems", *systems, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--rounds", str(args.rounds), "--threads", str(threads), "--seed", str(args.seed)]
    command += ["--trl-checkpointing"] if args.trl_checkpointing else []
    return {"schema": SCHEMA, "command": shlex.join(command),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": {"preset": args.preset, "n_params": num_parameters(cfg), "matmul_params": matmul_params(cfg)},
            "prompt_len": args.prompt_len, "answer_len": args.answer_len, "lora": lora, "beta": args.beta,
            "optimizer": OPTIMIZER, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "threads": threads, "seed": args.seed, "systems": out, "ratios": ratios, "machine": machine_info()}


def markdown(r: dict) -> str:
    m = r["model"]
    lines = [f"## bench_dpo: {m['preset']} ({m['n_params']:,} parameters), one pair of prompt {r['prompt_len']} + "
             f"answers {r['answer_len']}, LoRA r={r['lora']['r']} on {', '.join(r['lora']['targets'])}, "
             f"{r['threads']} thread{'s' if r['threads'] != 1 else ''}", "",
             f"{r['steps']} timed steps after {r['warmup']} warm-up per process, {r['rounds']} rounds taken in turn; "
             "a step: the reference's forward, the policy's forward and pullback, AdamW over the adapters.", "",
             "| system | step s (median) | min | max | CPU s a step (median) | tokens through the layers | "
             "peak RSS GiB | build s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in r["systems"].items():
        lines.append(f"| {name} | {s['step_ms_median'] / 1000:.2f} | {s['step_ms_min'] / 1000:.2f} | "
                     f"{s['step_ms_max'] / 1000:.2f} | {s['step_cpu_s_median']:.2f} | {s['tokens_forward']} | "
                     f"{s['peak_rss_mib'] / 1024:.2f} | {s['build_s']:.1f} |")
    lines.append("")
    for key, ratio in r["ratios"].items():
        if key == "prompt_sharing":
            lines.append(f"- computing the prompt once (zoo / zoo_unshared): step time {ratio['step_time']:.3f}x "
                         f"(CPU time {ratio['step_cpu_time']:.3f}x), tokens through the layers {ratio['tokens']:.3f}x, "
                         f"peak RSS {ratio['peak_rss']:.3f}x")
        else:
            lines.append(f"- {key.replace('_over_', ' / ')}: step time {ratio['step_time']:.3f}x (CPU time "
                         f"{ratio['step_cpu_time']:.3f}x), peak RSS {ratio['peak_rss']:.3f}x")
    for name, s in r["systems"].items():
        lines.append(f"- {name}: {s['implementation']}")
    for name, s in r["systems"].items():
        if "arena_mib" in s:
            a = s["arena_mib"]
            state = sum(a.get(k, 0.0) for k in ("weights", "gradients", "moments"))
            rest = s["peak_rss_mib"] - s["rss_after_import_mib"] - sum(a.values())
            lines.append(f"- {name}'s peak RSS, MiB: {s['peak_rss_mib']:,.0f} = the process before the model "
                         f"{s['rss_after_import_mib']:,.0f} + the frozen base {a.get('frozen_base', 0.0):,.0f} + the "
                         f"adapters with their gradients and moments {state:,.0f} + the activation arena "
                         f"{a.get('activations', 0.0):,.0f} + the rest {rest:,.0f}")
    lines.append(f"- {r['machine']['cpu']}")
    return "\n".join(lines)


# --- the zoo worker -------------------------------------------------------------------------


def checkpointing_words(k: int, n_layer: int) -> str:
    if k == n_layer:
        return ", activation checkpointing"
    if k:
        return f", activation checkpointing of the first {k} of {n_layer} layers (the others' activations kept)"
    return ", every layer's activations kept"


def worker_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="bench_dpo's zoo worker (run by zoo.tools.bench_dpo)")
    ap.add_argument("--layout", choices=["shared", "apart"], required=True)
    ap.add_argument("--checkpointing", choices=["default", "on", "off"], required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    checkpointing = {"on": True, "off": False}.get(a.checkpointing)
    result = run_zoo(a.workdir, a.layout == "shared", checkpointing, a.steps, a.warmup, a.threads)
    Path(a.out).write_text(json.dumps(result))
    return 0


def run_zoo(workdir: str, share_prompt: bool, checkpointing: Optional[bool], steps: int, warmup: int,
            threads: int) -> dict:
    """Timed steps of zoo's DPO over LoRA; checkpointing None: the method's default, as a run
    without --checkpointing has it."""
    import numpy as np

    import zoo
    from zoo.arch.config import ModelConfig
    from zoo.arch.lora import LoraConfig, default_precision

    from ..arch.memory import partial_checkpoint_layers
    from ..train.config import DEFAULT_CHECKPOINT_GROWTH, default_checkpointing
    from ..train.preference import PairFile, PairSplits
    from ..train.preference_loss import PreferenceLoss
    from ..train.preference_step import PreferenceObjective
    from .bench_torch import _peak_rss_mib, _rss_now_mib, read_manifest, timed_steps

    zoo.set_threads(threads)
    rss_imported = _rss_now_mib()
    manifest = read_manifest(workdir)
    lora, o, pair = manifest["lora"], manifest["optimizer"], manifest["pair"]
    config = ModelConfig(**manifest["config"])
    lora_config = LoraConfig(r=lora["r"], alpha=lora["alpha"], dropout=lora["dropout"], targets=lora["targets"])
    parts = [np.asarray(pair[k], np.int64) for k in ("prompt", "chosen", "rejected")]
    starts = np.cumsum([0] + [len(p) for p in parts])
    pair_file = PairFile(np.concatenate(parts), starts, Path("-"), "", [], [], False)
    P, C, R = map(len, parts)
    # a row of the pair as zoo packs it, or each sequence in a row of its own, as TRL pads them
    seq_len = P - 1 + C + R if share_prompt else P + max(C, R) - 1
    rows = 1 if share_prompt else 2
    precision = default_precision("bf16")  # fp32 products where bf16 ones would not run faster
    if checkpointing is None:  # as the trainer has it (TrainConfig.checkpoint_layers)
        checkpointing = (partial_checkpoint_layers(config, rows, seq_len, DEFAULT_CHECKPOINT_GROWTH, precision,
                                                   lora_config, "bf16")
                         if default_checkpointing("dpo", lora=True) else False)
    t0 = time.perf_counter()
    model = zoo.Model(config, seed=0, base_dtype="bf16", precision=precision, checkpointing=checkpointing,
                      lora=lora_config)
    build_s = time.perf_counter() - t0
    rss_built = _rss_now_mib()
    objective = PreferenceObjective(PreferenceLoss("dpo", beta=manifest["beta"]),
                                    PairSplits(pair_file, 1, seq_len, 0.0, 1, 0), share_prompt=share_prompt)
    batch = objective.pack([0])

    cpu: list[float] = []

    def step() -> float:
        c0 = time.process_time()
        model.zero_grads()
        loss, _ = objective.micro_step(model, [0], 0, 1, 1.0)
        model.adamw_step(o["lr"], o["beta1"], o["beta2"], o["eps"], o["weight_decay"], o["max_grad_norm"])
        cpu.append(time.process_time() - c0)
        return loss

    times, losses = timed_steps(step, steps, warmup)
    # Where the peak goes: the process before the model, the model's arenas (the frozen base, the
    # adapters, their gradients and moments, the activations: Model.arena_bytes), the rest.
    arenas = {k: v / 2**20 for k, v in model.arena_bytes().items() if v}
    return {"step_s": times, "step_cpu_s": cpu[warmup:], "losses": losses, "build_s": build_s,
            "peak_rss_mib": _peak_rss_mib(), "rss_after_import_mib": rss_imported, "rss_built_mib": rss_built,
            "arena_mib": arenas, "checkpointing": model.checkpoint_layers,
            "tokens_forward": int(batch.x.size),
            "implementation": f"zoo {zoo.__version__}: bf16 base, fp32 adapters, {model.precision} products, the "
                              f"reference with the adapters off; the prompt "
                              + ("computed once for both answers" if share_prompt else "in each of two sequences")
                              + checkpointing_words(model.checkpoint_layers, config.n_layer)
                              + f"; {batch.x.shape[0]} row(s) of {batch.x.shape[1]}"}


if __name__ == "__main__":
    sys.exit(main())
