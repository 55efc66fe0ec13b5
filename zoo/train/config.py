"""TrainConfig: everything one training or finetuning run needs, as one Pydantic model.

Every field is also a command-line flag (`zoo train --batch-size 8` sets `batch_size`), so a
run can be described by a YAML/JSON file, by flags, or both (flags win). The CLI builds its
flags from the fields here; add a field and the flag follows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ..arch.config import MAX_SEQ_LEN, MAX_TOKENS, ModelConfig
from ..arch.lora import BASE_DTYPES, LoraConfig, default_precision
from ..arch.memory import partial_checkpoint_layers
from ..arch.presets import PRESETS
from ..core.gemm import PRECISIONS, check_precision
from ..core.native import check_threads
from .records import parse_columns, split_weight

DEFAULT_STEPS = 1000

# The embedded default run (`zoo train` with no model or data, or `zoo demo`): a tiny Llama
# from scratch on a text shipped with the package, byte-level tokenizer, about 15 s on 2 cores.
DEMO_DATA = Path(__file__).parents[1] / "assets" / "demo"  # one short story or poem per file
DEMO = {
    "preset": "tiny-llama", "data": [str(DEMO_DATA)], "out": "runs/demo", "overwrite": True,
    "batch_size": 16, "seq_len": 128, "steps": 600, "lr": 3e-3, "warmup_steps": 30, "weight_decay": 0.01,
    "save_every": 200, "sample_prompt": "The ", "sample_tokens": 300,
    # A 133K-parameter model gives each thread too little work per kernel: one thread is fastest.
    "threads": 1,
}

# Fields that may change between an interrupted run and its --resume without changing the
# trajectory (the losses). Any other field must be the same, or the resume is refused.
RESUMABLE_CHANGES = {
    "resume", "out", "eval_every", "save_every", "keep_checkpoints", "log_every", "print_every", "progress",
    "sample_prompt", "sample_tokens", "cache_dir", "overwrite",
    "threads",  # a different count may change the last bits of sums; the trainer warns
    "ad",  # Clad's pullbacks equal the hand-written ones to rounding, like a thread count
    # Distributed runs: the watchdog's patience changes nothing computed; ZeRO-1 sums the
    # clipping norm in another order (the last bits, like a thread count).
    "rank_timeout", "zero",
    "report_to",  # where the metrics are also written, not what is computed
    "packed_base",  # the same products from a packed copy of the base: the same bits
}

# The budget may grow on --resume: the run is extended (the trainer checks and announces it
# once the data size, and so the step count, is known). It changes the schedule from the
# checkpoint on, not the steps already taken.
BUDGET_FIELDS = ("steps", "epochs", "tokens")

# Fields holding filesystem paths: relative ones in a config file are taken relative to it.
PATH_FIELDS = ("from_dir", "tokenizer", "out", "cache_dir")


# The preference methods whose loss compares with a reference model (preference_loss.py).
REFERENCE_METHODS = ("dpo", "ipo")


def default_checkpointing(method: str, lora: bool) -> bool:
    """Whether a run checkpoints where --checkpointing is not given: for a reference-based
    preference loss under LoRA (as TRL's DPOConfig has gradient checkpointing on by default),
    whose step runs the layers forward twice (the reference, with the adapters off, and the
    policy) before the pullback, the first layers (DEFAULT_CHECKPOINT_GROWTH says how many); not
    otherwise."""
    return lora and method in REFERENCE_METHODS


# The default checkpointing's memory allowance: the layers after the first k keep their
# activations (their recompute saved) as long as the run's memory estimate stays within 4% of
# the estimate with every layer checkpointed (memory.partial_checkpoint_layers). At llama-3.2-1b,
# one pair of 128 + 2 x 128 tokens, that keeps the last 5 of 16 layers: 94 MiB for 0.14 s of a
# 4.2 s step, and the run stays under 0.6x TRL's peak memory with room (docs/preference.md).
DEFAULT_CHECKPOINT_GROWTH = 0.04


# Micro-batches per optimizer step: a million is far beyond any use, and keeps
# batch x seq_len x grad_accum (tokens per step) a modest integer.
MAX_GRAD_ACCUM = 1 << 20


def flag(field: str) -> str:
    """The command-line flag of a field: --batch-size for batch_size, --from for from_dir."""
    return "--from" if field == "from_dir" else "--" + field.replace("_", "-")


class TrainConfig(BaseModel):
    # Every float must be finite: a NaN or infinite --lr, --weight-decay, --max-grad-norm... is
    # refused here, naming the field, instead of turning every weight into NaN at the first step.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    # --- what to train, on what -------------------------------------------------------
    from_dir: Optional[str] = Field(None, alias="from",
                                    description="checkpoint folder (Hugging Face layout) to finetune")
    preset: Optional[str] = Field(None, description="train from scratch: a named preset (default tiny-llama)")
    model: Optional[ModelConfig] = Field(None, description="train from scratch: a model config (config files only)")
    tokenizer: Optional[str] = Field(None, description="tokenizer folder (default: the checkpoint's; "
                                                       "byte-level when training from scratch)")
    data: list[str] = Field(default_factory=list, description="data files or folders of them: text, JSONL, Parquet or "
                                                                 "Arrow records (text, prompt/completion, chat "
                                                                 "messages, ShareGPT conversations, Alpaca), "
                                                                 "datasets.save_to_disk folders, or token ids (.npy, "
                                                                 ".bin); a mixture: PATH:WEIGHT each (a.parquet:0.7 "
                                                                 "b.jsonl:0.3)")
    data_columns: Optional[dict[str, str]] = Field(None, description="the data's column names for zoo's record fields, "
                                                                     "FIELD=COLUMN,... (e.g. prompt=question,"
                                                                     "completion=answer)")
    out: str = Field("runs/train", description="run folder: checkpoints, metrics, plot, final model")
    cache_dir: Optional[str] = Field(None, description="where tokenized data is cached "
                                                       "(default: $ZOO_CACHE or ~/.cache/zoo)")

    # --- batch shape ------------------------------------------------------------------
    # Bounded by the native core's limits (zoo/arch/config.py); batch_size x seq_len too (_check).
    batch_size: int = Field(8, gt=0, le=MAX_TOKENS, description="sequences per micro-batch (pairs under a preference "
                                                                   "--method)")
    seq_len: int = Field(128, gt=0, le=MAX_SEQ_LEN, description="tokens per sequence")
    grad_accum: int = Field(1, gt=0, le=MAX_GRAD_ACCUM, description="micro-batches per optimizer step")

    # --- budget: one of these (default: steps) ----------------------------------------
    steps: Optional[int] = Field(None, gt=0, description=f"optimizer steps (default {DEFAULT_STEPS})")
    epochs: Optional[float] = Field(None, gt=0, description="passes over the training tokens")
    tokens: Optional[int] = Field(None, gt=0, description="training tokens")

    # --- AdamW and its schedule -------------------------------------------------------
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    min_lr: Optional[float] = Field(None, ge=0, description="final learning rate (default lr/10)")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="decay after warmup")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    weight_decay: float = Field(0.1, ge=0, description="decoupled weight decay (2-D matmul weights only)")
    max_grad_norm: Optional[float] = Field(1.0, ge=0, description="global gradient-norm clip (0: off)")

    # --- evaluation, checkpoints, logging ---------------------------------------------
    val_fraction: float = Field(0.1, ge=0, le=0.5, description="tail of the token stream held out")
    eval_every: Optional[int] = Field(None, ge=0, description="evaluate every N steps, besides the start and the end "
                                                              "(default: about 10 times a run, every max(1, steps // 10); "
                                                              "0: start and end only)")
    eval_batches: int = Field(8, gt=0, description="batches per evaluation")
    save_every: int = Field(500, ge=0, description="checkpoint every N steps (0: at the end only)")
    keep_checkpoints: int = Field(2, gt=0, description="how many recent checkpoints to keep")
    log_every: int = Field(1, gt=0, description="write a metrics.jsonl record every N steps")
    print_every: Optional[int] = Field(None, gt=0, description="a line of step, loss, lr, tok/s and val loss every N steps: "
                                                               "printed with --no-progress, always written to train.log "
                                                               "(default: about 20 a run, every max(1, steps // 20))")
    progress: bool = Field(True, description="show a progress bar (--no-progress: a plain line every --print-every steps)")
    report_to: Literal["none", "tensorboard"] = Field("none", description="also write the metrics as TensorBoard event "
                                                                         "files in the run folder (metrics.jsonl is "
                                                                         "always written)")

    # --- run control ------------------------------------------------------------------
    seed: int = Field(0, ge=0, description="seed for initialization and data order")
    threads: Optional[int] = Field(None, description="CPU threads (default: all; in a distributed run, "
                                                                  "the host's cores shared among its ranks)")
    resume: bool = Field(False, description="continue the run in --out from its latest checkpoint; "
                                                "with a larger --steps, --epochs or --tokens, extend it")
    train_on_everything: bool = Field(False, description="loss on every token, prompts and user turns included, "
                                                         "not only on completions and assistant turns")
    checkpointing: Optional[bool] = Field(
        None, description="activation checkpointing (less memory, more compute); unset: on for the first layers "
                          "for dpo and ipo with --lora (their step runs the reference's forward too: the recompute "
                          "is a smaller share of it; the later layers keep their activations while that adds at "
                          f"most {DEFAULT_CHECKPOINT_GROWTH * 100:g} percent to the memory estimate), off otherwise")
    # --- preference tuning: pairs of a prompt, a chosen and a rejected answer (docs/preference.md)
    method: Literal["sft", "dpo", "ipo", "orpo", "simpo"] = Field(
        "sft", description="sft: next-token loss on the data; dpo, ipo, orpo, simpo: preference tuning on JSONL "
                           "records {prompt, chosen, rejected} (or {chosen, rejected}), losses as TRL defines them")
    beta: float = Field(0.1, gt=0, description="preference methods: the loss's beta (IPO's tau, ORPO's lambda)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo, simpo: the probability that a pair's "
                                                                  "preference is flipped (conservative DPO)")
    simpo_gamma: float = Field(0.5, description="simpo: the target reward margin gamma")
    cpo_alpha: float = Field(0.0, ge=0, description="simpo: the weight of the chosen answers' NLL added to the "
                                                   "loss (CPO; 0: SimPO)")
    # --- distributed runs (several processes under mpirun, srun or zoo launch) ------------
    zero: int = Field(0, ge=0, le=1, description="ZeRO stage of a distributed run: 0, every rank keeps all AdamW "
                                                 "moments; 1, each of N ranks keeps 1/N of them")
    rank_timeout: float = Field(300.0, gt=0, description="distributed runs: seconds a rank waits for the others at an "
                                                         "exchange before it names the missing ones and stops every rank")
    precision: Optional[Literal[PRECISIONS]] = Field(
        None, description="of the matrix products: fp32, or bf16 (bf16 operands, fp32 sums; weights, "
                          "gradients and AdamW stay fp32; needs a CPU with bf16 dot products). Default fp32; "
                          "under --lora with a bf16, int8 or nf4 base, bf16 where the CPU has bf16 dot products")
    # --- LoRA: adapters over a frozen base (docs/lora.md) ---------------------------------
    lora: bool = Field(False, description="train LoRA adapters over a frozen base instead of every weight")
    lora_r: int = Field(8, ge=1, le=4096, description="LoRA rank")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA alpha: the adapters' output is scaled by alpha / r")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    lora_targets: Optional[list[str]] = Field(None, description="modules to adapt, by Hugging Face name: q_proj k_proj "
                                                                "v_proj o_proj gate_proj up_proj down_proj (Llama), "
                                                                "c_attn c_proj c_fc (GPT-2); default: every linear layer")
    base_dtype: Optional[Literal[BASE_DTYPES]] = Field(
        None, description="format of the frozen base under --lora: bf16 (default), int8 (a scale per output "
                          "channel), nf4 (4 bits, a scale per 64 values) or fp32")
    packed_base: bool = Field(False, description="under --lora with a bf16 base and bf16 products: keep a second "
                                                 "copy of the base's matrices packed for the bf16 kernels, so the "
                                                 "step's input gradients run faster (docs/lora.md); costs the "
                                                 "memory of that copy")
    ad: Union[Literal["manual", "clad"], dict[str, Literal["manual", "clad"]]] = Field(
        "manual", description="pullbacks: manual (hand-written), clad (generated by Clad; a Clad build), "
                              "or per block in a config file, e.g. {attention: clad}")
    sample_prompt: str = Field("", description="prompt for the sample printed at the end")
    sample_tokens: int = Field(200, ge=0, description="tokens to sample at the end (0: none)")
    overwrite: bool = Field(False, description="replace a run already in --out instead of refusing")

    @field_validator("data_columns", mode="before")
    @classmethod
    def _columns(cls, value):
        return parse_columns(value) or None

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: Optional[str]) -> Optional[str]:
        known = [p.name for p in PRESETS]
        if name is not None and name not in known:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(known)}")
        return name

    # The thread count and the precision are checked where they enter, here: a run that cannot
    # start is refused before it touches its run folder (check_precision: bf16 needs a CPU with
    # bf16 dot products).
    @field_validator("threads")
    @classmethod
    def _thread_count(cls, n: Optional[int]) -> Optional[int]:
        return None if n is None else check_threads(n)

    @field_validator("precision")
    @classmethod
    def _precision_runs_here(cls, precision: Optional[str]) -> Optional[str]:
        if precision is not None:
            check_precision(precision)
        return precision

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        sources = [n for n, v in (("from", self.from_dir), ("preset", self.preset), ("model", self.model))
                   if v is not None]
        if len(sources) > 1:
            raise ValueError(f"set only one of from, preset, model (got {', '.join(sources)})")
        budgets = [n for n in ("steps", "epochs", "tokens") if getattr(self, n) is not None]
        if len(budgets) > 1:
            raise ValueError(f"set only one budget of steps, epochs, tokens (got {', '.join(budgets)})")
        # Set away from their defaults without --lora: a mistake (a saved config holds the defaults).
        lora_fields = sorted(f for f in ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "base_dtype",
                                                "packed_base")
                             if getattr(self, f) != TrainConfig.model_fields[f].default)
        if lora_fields and not self.lora:
            raise ValueError(f"{', '.join(flag(f) for f in lora_fields)} apply to a LoRA run: add {flag('lora')}")
        # Preference settings away from their defaults: each belongs to the methods that use it.
        for names, methods in ((("beta",), ("dpo", "ipo", "orpo", "simpo")), (("label_smoothing",), ("dpo", "simpo")),
                               (("simpo_gamma", "cpo_alpha"), ("simpo",))):
            given = [f for f in names if getattr(self, f) != TrainConfig.model_fields[f].default]
            if given and self.method not in methods:
                raise ValueError(f"{', '.join(flag(f) for f in given)} apply to {flag('method')} "
                                 f"{' or '.join(methods)}, not {self.method}")
        weighted = [d for d in self.data if split_weight(d)[1] is not None]
        if self.method != "sft" and weighted:
            raise ValueError(f"{flag('data')} {' '.join(weighted)}: a mixture (PATH:WEIGHT) is for {flag('method')} sft; "
                             "give the preference data without weights")
        if self.method != "sft" and self.train_on_everything:
            raise ValueError(f"{flag('train_on_everything')} is for {flag('method')} sft: a preference method's loss "
                             "is on the answers")
        if self.lora and self.base_dtype is None:
            self.base_dtype = "bf16"
        if self.precision is None:  # a narrow frozen base runs its products in bf16 where the CPU has them
            self.precision = default_precision(self.base_dtype) if self.lora else "fp32"
        if self.packed_base and (self.base_dtype != "bf16" or self.precision != "bf16"):
            raise ValueError(f"{flag('packed_base')} packs a bf16 base for bf16 products; this run has its base "
                             f"in {self.base_dtype} and its products in {self.precision}")
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"min_lr: {self.min_lr} is above lr {self.lr}")
        if self.batch_size * self.seq_len > MAX_TOKENS:
            # The native core counts a micro-batch's tokens with int (products of 2^31 or more
            # once crashed it with SIGFPE); its bound is far above what one machine trains on.
            raise ValueError(
                f"batch_size x seq_len ({flag('batch_size')} {self.batch_size} x {flag('seq_len')} {self.seq_len}"
                f" = {self.batch_size * self.seq_len} tokens per micro-batch) is above zoo's bound of {MAX_TOKENS}; "
                f"use a smaller {flag('batch_size')} or {flag('seq_len')}, and {flag('grad_accum')} for larger steps")
        return self

    # --- derived ----------------------------------------------------------------------

    def lora_config(self):
        """The run's zoo.LoraConfig (None without --lora)."""
        if not self.lora:
            return None
        return LoraConfig(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout, targets=self.lora_targets)

    @property
    def uses_checkpointing(self) -> bool:
        """Whether the run checkpoints: --checkpointing as given, else the default of its method
        (on for a reference-based preference loss under LoRA, docs/preference.md)."""
        return self.checkpointing if self.checkpointing is not None else default_checkpointing(self.method, self.lora)

    def checkpoint_layers(self, model: ModelConfig, rows: int, ranks: int = 1) -> bool | int:
        """The run's activation checkpointing for its model at micro-batches of rows x seq_len
        (ranks: the processes sharing AdamW's moments under --zero 1): --checkpointing as given
        (every layer or none), else the method's default: none, or the first k layers of
        partial_checkpoint_layers with DEFAULT_CHECKPOINT_GROWTH."""
        if not self.uses_checkpointing or self.checkpointing is not None:
            return self.uses_checkpointing
        return partial_checkpoint_layers(model, rows, self.seq_len, DEFAULT_CHECKPOINT_GROWTH, self.precision,
                                         self.lora_config(), self.base_dtype, zero_ranks=ranks if self.zero else 1)

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def total_steps(self, train_tokens: int) -> int:
        """Optimizer steps this budget buys, given the size of the training split."""
        per_step = self.batch_size * self.seq_len * self.grad_accum
        if self.epochs is not None:
            return max(1, round(self.epochs * train_tokens / per_step))
        if self.tokens is not None:
            return max(1, -(-self.tokens // per_step))
        return self.steps if self.steps is not None else DEFAULT_STEPS

    def eval_interval(self, total_steps: int) -> int:
        """Steps between evaluations (0: only at the start and the end)."""
        return self.eval_every if self.eval_every is not None else max(1, total_steps // 10)

    def print_interval(self, total_steps: int) -> int:
        """Steps between progress lines (console with --no-progress, and train.log)."""
        return self.print_every if self.print_every is not None else max(1, total_steps // 20)

    def trajectory_diff(self, other: "TrainConfig") -> list[str]:
        """Fields that differ and would change the losses of a resumed run."""
        a, b = self.model_dump(), other.model_dump()
        return [k for k in a if k not in RESUMABLE_CHANGES and a[k] != b[k]]


def lr_at(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then the schedule
    from lr down to the final lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - 1 - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    coeff = 0.5 * (1.0 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1.0 - frac
    return cfg.final_lr + (cfg.lr - cfg.final_lr) * coeff


def read_config_file(path: str | Path) -> dict:
    """A YAML or JSON training config as a dict, with relative paths made relative to the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"config file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"config file {path}: cannot read it ({e})") from None
    try:
        if path.suffix.lower() == ".json":
            raw = json.loads(text)
        else:
            raw = yaml.safe_load(text)
    except Exception as e:  # json.JSONDecodeError or yaml.YAMLError, with line and column
        raise ValueError(f"config file {path}: not valid {path.suffix.lstrip('.').upper() or 'YAML'}: {e}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path}: expected a mapping of field names to values")
    base = path.resolve().parent
    raw = dict(raw)
    if "from" in raw:  # the file may use the flag's name; one spelling from here on
        raw["from_dir"] = raw.pop("from")
    for key in PATH_FIELDS:
        if isinstance(raw.get(key), str):
            raw[key] = str(base / raw[key])
    if isinstance(raw.get("data"), list):
        raw["data"] = [str(base / p) if isinstance(p, str) else p for p in raw["data"]]
    elif isinstance(raw.get("data"), str):
        raw["data"] = [str(base / raw["data"])]
    return raw


def validate(fields: dict, where: str) -> TrainConfig:
    """TrainConfig from a dict, with a validation error turned into one readable message."""
    try:
        return TrainConfig.model_validate(fields)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if loc in TrainConfig.model_fields:  # a top-level field: name its flag too
                loc = f"{loc} ({flag(loc)})"
            problems.append(f"{loc}: {msg}" if loc else msg)
        raise ValueError(f"{where}: " + "; ".join(problems)) from None
