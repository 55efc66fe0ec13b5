"""What a run trains and reads its data with: the model (from a checkpoint it resumes, --from,
a preset or a model config), its tokenizer and chat template; and the checks made before any of
it costs memory: the run's memory estimate, and whether the tokenizer and --seq-len fit the model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..arch.memory import (
    available_memory_bytes,
    check_finetune_fits,
    checkpoint_layers,
    describe,
    human_bytes,
)
from ..arch.presets import preset
from ..core.errors import TrainError
from ..io import load
from ..io.load import load_model
from ..io.peft import load_adapter
from ..model import Model
from ..text.chat_template import FALLBACK_TEMPLATE, ChatTemplate
from ..text.tokenizers import Tokenizer, has_tokenizer
from .config import TrainConfig
from .data import all_token_ids


@dataclass
class RunModel:
    """The model a run trains, its tokenizer (None: the data are token ids), the folder or file the
    tokenizer came from (None: the byte-level one, or none) and the chat template chats in the
    data are rendered with (None without a tokenizer)."""

    model: Model
    tokenizer: Optional[Tokenizer]
    tokenizer_dir: Optional[Path]
    chat_template: Optional[ChatTemplate]


def finetune_source(path) -> load.Source:
    """What a run starts from (--from): a model whose weights it trains. A GGUF file and a LoRA
    adapter are refused, saying what to do instead."""
    source = load.resolve(path)
    if source.form == "gguf":
        raise load.refuse("finetune", source, f"convert it to a folder first: zoo convert {source.path} DIR, then "
                                              "--from DIR")
    if source.is_adapter:
        raise load.refuse("finetune", source, "finetune its base with --lora, or merge the adapter into it first "
                                              "(zoo merge BASE ADAPTER OUT_DIR) and finetune that")
    return source


def load_run_model(cfg: TrainConfig, resume_from: Optional[Path]) -> RunModel:
    """The model, tokenizer and chat template of a resumed, finetuned or new run."""
    model, tokenizer, tokenizer_dir = _load_model(cfg, resume_from)
    return RunModel(model, tokenizer, tokenizer_dir, _chat_template(tokenizer, tokenizer_dir))


def _load_model(cfg: TrainConfig, resume_from: Optional[Path]):
    """(model, tokenizer, tokenizer folder or None) for a resumed, finetuned or new run."""
    if cfg.lora:
        return load_lora_model(cfg, resume_from)
    if resume_from is not None or cfg.from_dir is not None:
        src = resume_from if resume_from is not None else finetune_source(cfg.from_dir).model
        model = load_model(load.resolve(src), Model, ad=cfg.ad)
        tok_dir = Path(cfg.tokenizer) if cfg.tokenizer and resume_from is None else src
        if not cfg.tokenizer and not has_tokenizer(tok_dir) and cfg.data and all_token_ids(cfg.data):
            return model, None, None  # token ids need no tokenizer, and this checkpoint has none
        return model, Tokenizer.from_pretrained(tok_dir), tok_dir
    if cfg.model is not None:
        model_cfg = cfg.model
    else:
        model_cfg = preset(cfg.preset or "tiny-llama")
    model = Model(model_cfg, seed=cfg.seed, ad=cfg.ad)
    if cfg.tokenizer:
        return model, Tokenizer.from_pretrained(cfg.tokenizer), Path(cfg.tokenizer)
    return model, Tokenizer.byte_level(), None


def load_lora_model(cfg: TrainConfig, resume_from: Optional[Path]):
    """A LoRA run: the frozen base from --from (or a new model from the preset or config, seeded),
    its adapters new or, on --resume, the checkpoint's (which also holds the tokenizer).
    (model, tokenizer, tokenizer folder or None), as _load_model."""
    settings = dict(ad=cfg.ad, lora=cfg.lora_config(), base_dtype=cfg.base_dtype, precision=cfg.precision,
                    checkpointing=cfg.uses_checkpointing)
    if cfg.from_dir is not None:
        src = finetune_source(cfg.from_dir).model
        model = load_model(load.resolve(src), Model, adapter_seed=cfg.seed, **settings)
    else:
        model = Model(cfg.model or preset(cfg.preset or "tiny-llama"), seed=cfg.seed, **settings)
        src = None
    if resume_from is not None:
        load_adapter(model, resume_from)
    tok_dir = resume_from if resume_from is not None and has_tokenizer(resume_from) else (
        Path(cfg.tokenizer) if cfg.tokenizer else src)
    if tok_dir is None:
        return model, Tokenizer.byte_level(), None
    if not cfg.tokenizer and not has_tokenizer(tok_dir) and cfg.data and all_token_ids(cfg.data):
        return model, None, None
    return model, Tokenizer.from_pretrained(tok_dir), tok_dir


def _chat_template(tokenizer: Optional[Tokenizer], tokenizer_dir: Optional[Path]) -> Optional[ChatTemplate]:
    """What chats in the data are rendered with: the tokenizer folder's template, else zoo's
    fallback (docs/chat_templates.md); none where there is no tokenizer (token ids)."""
    if tokenizer_dir is not None:  # a folder, or a tokenizer file (tokenizer.model) in one
        folder = Path(tokenizer_dir)
        return ChatTemplate.for_folder(folder if folder.is_dir() else folder.parent)
    if tokenizer is None:
        return None
    return ChatTemplate(FALLBACK_TEMPLATE, "zoo's fallback chat template (training from scratch)",
                        tokenizer.bos_token, tokenizer.eos_token)


def check_memory_up_front(cfg: TrainConfig, ranks: int, say) -> None:
    """The run's memory estimate against what the machine has, from the model's config alone,
    before any weight is read or arena mapped (memory.check_finetune_fits). ranks: the processes
    of the run (1: one process); say: where the estimate is told."""
    if cfg.from_dir is not None:
        model_cfg, what = load.config_of(finetune_source(cfg.from_dir)), f"finetuning {cfg.from_dir}"
    else:
        model_cfg = cfg.model or preset(cfg.preset or "tiny-llama")
        what = f"training {cfg.preset or 'the model config'}"
    rows = -(-cfg.batch_size // ranks)
    checkpointing = cfg.checkpoint_layers(model_cfg, rows, ranks)
    need = check_finetune_fits(model_cfg, rows, cfg.seq_len, checkpointing, cfg.precision,
                               cfg.lora_config(), cfg.base_dtype, what, zero_ranks=ranks if cfg.zero else 1,
                               packed_base=cfg.packed_base)
    have = available_memory_bytes()
    say(f"memory{' per rank' if ranks > 1 else ''}: {describe(need, cfg.base_dtype)} at batch "
        f"{rows} x {cfg.seq_len}{checkpointing_words(model_cfg, checkpointing)}"
        + (f"; {human_bytes(have[0])} available" if have else ""))


def checkpointing_words(model_cfg, checkpointing: bool | int) -> str:
    """' with activation checkpointing' (of the first k of n layers), or nothing."""
    k = checkpoint_layers(model_cfg, checkpointing)
    if not k:
        return ""
    return " with activation checkpointing" + (f" of the first {k} of {model_cfg.n_layer} layers"
                                               if k < model_cfg.n_layer else "")


def check_fit(cfg: TrainConfig, run: RunModel) -> None:
    """The tokenizer's vocabulary and --seq-len against the model's."""
    mc = run.model.config
    where = cfg.from_dir or cfg.preset or "the model config"
    if run.tokenizer is not None and run.tokenizer.vocab_size > mc.vocab_size:
        tok = cfg.tokenizer or run.tokenizer_dir or "the byte-level tokenizer"
        raise TrainError(f"tokenizer {tok}: its vocabulary has {run.tokenizer.vocab_size} tokens but the model "
                         f"({where}) has vocab_size {mc.vocab_size}; use the tokenizer the model was trained with")
    if cfg.seq_len > mc.max_seq_len:
        raise TrainError(f"seq_len: {cfg.seq_len} is beyond the model's max_seq_len {mc.max_seq_len} ({where})")
