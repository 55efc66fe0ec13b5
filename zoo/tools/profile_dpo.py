"""Where zoo's DPO step over LoRA spends its time, part by part: the reference's forward (the
adapters off), the policy's forward (the LM head on the answer rows, the head's input adjoint),
the pullback (a checkpointed layer's recompute counts as forward there), AdamW; each with the
per-block profile (Model.set_profiling: seconds in products, adapters, attention, ...), and
beside it zoo's LoRA SFT step of the same rows (every position a target). Random weights of a
preset's shape, bf16 base and products (fp32 ones where the CPU has no bf16 dot products), one
pair of random ids, as bench_dpo's zoo system.

  python -m zoo.tools.profile_dpo --preset llama-3.2-1b --prompt-len 128 --answer-len 128 --rank 16 \\
      --threads 2 --sft
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.tools.profile_dpo", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.2-1b")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--answer-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--checkpointing", default="default",
                   help="default (the method's, as a run has it), on, off, or the number of first layers")
    p.add_argument("--steps", type=int, default=2, help="untimed steps before the profiled one (default 2)")
    p.add_argument("--sft", action="store_true", help="also profile a LoRA SFT step of the same rows")
    p.add_argument("--json", metavar="FILE", default=None)
    a = p.parse_args(argv)
    for name, v, low in (("--prompt-len", a.prompt_len, 1), ("--answer-len", a.answer_len, 2), ("--rank", a.rank, 1),
                         ("--steps", a.steps, 0)):
        if v < low:
            p.error(f"{name} must be at least {low}, got {v}")
    import numpy as np

    import zoo
    from zoo.arch.lora import LoraConfig, default_precision, module_names
    from zoo.arch.memory import partial_checkpoint_layers

    from ..train.config import DEFAULT_CHECKPOINT_GROWTH
    from ..train.data import IGNORE
    from ..train.preference import PairFile, PairSplits
    from ..train.preference_loss import PreferenceLoss
    from ..train.preference_step import PreferenceObjective, answer_sums
    from .bench import default_threads, machine_info, model_config

    threads = a.threads or default_threads()
    zoo.set_threads(threads)
    cfg = model_config(a.preset, None)
    lora = LoraConfig(r=a.rank, alpha=2.0 * a.rank, dropout=0.0, targets=module_names(cfg))
    seq_len = a.prompt_len - 1 + 2 * a.answer_len
    precision = default_precision("bf16")  # fp32 products where bf16 ones would not run faster
    if a.checkpointing == "default":
        ckpt = partial_checkpoint_layers(cfg, 1, seq_len, DEFAULT_CHECKPOINT_GROWTH, precision, lora, "bf16")
    elif a.checkpointing in ("on", "off"):
        ckpt = a.checkpointing == "on"
    else:
        try:
            ckpt = int(a.checkpointing)
        except ValueError:
            p.error(f"--checkpointing {a.checkpointing!r}: give default, on, off or a number of layers")
    rng = np.random.default_rng(0)
    parts = [rng.integers(3, cfg.vocab_size, a.prompt_len),
             np.r_[rng.integers(3, cfg.vocab_size, a.answer_len - 1), 1],
             np.r_[rng.integers(3, cfg.vocab_size, a.answer_len - 1), 1]]
    model = zoo.Model(cfg, seed=0, base_dtype="bf16", precision=precision, checkpointing=ckpt, lora=lora)
    starts = np.cumsum([0] + [len(x) for x in parts])
    pair_file = PairFile(np.concatenate(parts).astype(np.int64), starts, None, "", [], [], False)
    objective = PreferenceObjective(PreferenceLoss("dpo", beta=0.1), PairSplits(pair_file, 1, seq_len, 0.0, 1, 0))
    batch = objective.pack([0])

    def part(out: dict, name: str, call):
        model.set_profiling(True)
        t0 = time.perf_counter()
        result = call()
        out[name] = {"s": time.perf_counter() - t0,
                     "blocks": {k: [f, b] for k, (f, b) in model.block_profile().items() if f + b > 0}}
        model.set_profiling(False)
        return result

    def dpo_step() -> dict:
        # micro_step's calls one by one (preference_step.PreferenceObjective.micro_step)
        out: dict = {}
        t0 = time.perf_counter()
        model.zero_grads()
        answers = np.where(batch.answer >= 0, batch.y, IGNORE)

        def reference():
            model.set_adapters_enabled(False)
            try:
                return model.target_logprobs(batch.x, answers, batch.positions, batch.hidden)
            finally:
                model.set_adapters_enabled(True)

        ref = answer_sums(batch, part(out, "reference_forward", reference))
        lp = part(out, "policy_forward", lambda: model.target_logprobs(batch.x, batch.y, batch.positions,
                                                                       batch.hidden, train=True))
        t1 = time.perf_counter()
        pc, pr = answer_sums(batch, lp)
        terms = objective.loss.pairs(pc, pr, batch.lengths[:, 0], batch.lengths[:, 1], *ref)
        weights = np.zeros(batch.x.shape)
        on = batch.answer >= 0
        weights[on] = np.stack([terms.d_chosen, terms.d_rejected], axis=1).reshape(-1)[batch.answer[on]]
        out["python_loss"] = {"s": time.perf_counter() - t1}
        part(out, "pullback", lambda: model.backward_logprobs(weights))
        part(out, "adamw", lambda: model.adamw_step(5e-6, 0.9, 0.999, 1e-8, 0.0, 1.0))
        out["step_s"] = time.perf_counter() - t0
        return out

    for _ in range(a.steps):
        dpo_step()
    result = {"preset": a.preset, "prompt_len": a.prompt_len, "answer_len": a.answer_len, "rank": a.rank,
              "threads": threads, "precision": model.precision, "checkpoint_layers": model.checkpoint_layers,
              "n_layer": cfg.n_layer, "tokens": int(batch.x.size), "dpo": dpo_step(), "machine": machine_info()}
    if a.sft:
        x = batch.x
        y = np.roll(x, -1, axis=1)

        def sft_step() -> dict:
            out: dict = {}
            t0 = time.perf_counter()
            model.zero_grads()
            part(out, "forward_backward", lambda: model.forward_backward(x, y))
            part(out, "adamw", lambda: model.adamw_step(5e-6, 0.9, 0.999, 1e-8, 0.0, 1.0))
            out["step_s"] = time.perf_counter() - t0
            return out

        for _ in range(a.steps):
            sft_step()
        result["sft"] = sft_step()
    for name in ("dpo", "sft"):
        if name not in result:
            continue
        r = result[name]
        print(f"{name} step: {r['step_s']:.3f} s")
        for key, v in r.items():
            if isinstance(v, dict):
                blocks = ", ".join(f"{k} {f:.3f}+{b:.3f}" for k, (f, b) in v.get("blocks", {}).items())
                print(f"  {key}: {v['s']:.3f} s" + (f" (forward+pullback s: {blocks})" if blocks else ""))
    print(f"checkpointed layers: {model.checkpoint_layers} of {cfg.n_layer}; {result['machine']['cpu']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
