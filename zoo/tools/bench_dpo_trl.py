"""The TRL side of `python -m zoo.tools.bench_dpo`: DPO steps of TRL's DPOTrainer over a PEFT
LoRA model, in a process of its own.

Run by path (`python .../zoo/tools/bench_dpo_trl.py ...`), like bench_lora_torch.py: the measured
process holds PyTorch, transformers, PEFT and TRL alone and never imports zoo. It reads the work
folder bench_dpo wrote: manifest.json (the transformers config of the preset, the pair's token
ids, the LoRA, DPO and optimizer settings).

The model is built at the preset's shape in bf16 or fp32 (--weights; transformers' random init,
no download), the adapters by PEFT through the trainer's peft_config (fp32, its
autocast_adapter_dtype default), DPOConfig(bf16=True): the forward under bf16 autocast. The pair's ids are given as words of a
word-level tokenizer whose vocabulary is "t<id>" for every id, so that TRL's own tokenization
yields exactly the manifest's ids (no BOS; EOS is the last answer id). trainer.train() runs
warmup + steps steps of one pair each; a callback times each (the step's forward passes, policy
and reference, its backward, clipping and AdamW).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# this file's folder, sys.path[0] when run by path
from bench_torch import _peak_rss_mib, read_manifest


def tokenizer(vocab_size: int, eos: int):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = {0: "<unk>", 1: "</s>", 2: "<pad>"}
    vocab = {specials.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert specials[eos] == "</s>"
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>")


def run(workdir: str, weights: str, steps: int, warmup: int, threads: int) -> dict:
    import datasets
    import peft
    import torch
    import transformers
    import trl

    torch.set_num_threads(threads)
    manifest = read_manifest(workdir)
    hf, pair, lora, o = manifest["hf_config"], manifest["pair"], manifest["lora"], manifest["optimizer"]
    t0 = time.perf_counter()
    config = transformers.AutoConfig.for_model(**hf)
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16 if weights == "bf16" else torch.float32)
    build_s = time.perf_counter() - t0
    tok = tokenizer(hf["vocab_size"], manifest["eos"])

    def words(ids):
        return " ".join(f"t{i}" for i in ids)

    # TRL appends EOS's text to an answer that lacks it: the answers' last id is EOS already
    record = {"prompt": words(pair["prompt"]), "chosen": " " + words(pair["chosen"][:-1]) + " </s>",
              "rejected": " " + words(pair["rejected"][:-1]) + " </s>"}
    args = trl.DPOConfig(output_dir=f"{workdir}/trl-out", per_device_train_batch_size=1, max_steps=warmup + steps,
                         learning_rate=o["lr"], adam_beta1=o["beta1"], adam_beta2=o["beta2"], adam_epsilon=o["eps"],
                         weight_decay=o["weight_decay"], max_grad_norm=o["max_grad_norm"], lr_scheduler_type="constant",
                         beta=manifest["beta"], loss_type=["sigmoid"], bf16=True, use_cpu=True,
                         gradient_checkpointing=manifest["trl_checkpointing"], max_length=None, report_to=[],
                         save_strategy="no", logging_steps=1, dataloader_num_workers=0, seed=0, disable_tqdm=True)
    peft_config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                  target_modules=lora["targets"], task_type="CAUSAL_LM")
    trainer = trl.DPOTrainer(model=model, args=args, processing_class=tok, peft_config=peft_config,
                             train_dataset=datasets.Dataset.from_list([record] * (warmup + steps)))
    row = trainer.train_dataset[0]
    if (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) != (pair["prompt"], pair["chosen"],
                                                                        pair["rejected"]):
        raise SystemExit("bench_dpo_trl: TRL tokenized the pair into other ids than the manifest's")

    times, cpu, losses, started = [], [], [], []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            started.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - started[-1][0])
            cpu.append(time.process_time() - started[-1][1])

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    trainer.add_callback(Timer())
    trainer.train()
    batch = next(iter(trainer.get_train_dataloader()))
    return {"step_s": times[warmup:], "step_cpu_s": cpu[warmup:], "losses": losses, "build_s": build_s, "peak_rss_mib": _peak_rss_mib(),
            "tokens_forward": int(batch["input_ids"].numel()),
            "implementation": f"TRL {trl.__version__} DPOTrainer + PEFT {peft.__version__} + transformers "
                              f"{transformers.__version__} + PyTorch {torch.__version__}: {weights} weights, fp32 "
                              "adapters, bf16 autocast, the reference with the adapters off"
                              + (", gradient checkpointing" if manifest["trl_checkpointing"] else ""),
            "imported_zoo": "zoo" in sys.modules}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="bench_dpo's TRL worker (run by zoo.tools.bench_dpo)")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--weights", choices=["bf16", "fp32"], required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    result = run(a.workdir, a.weights, a.steps, a.warmup, a.threads)
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
