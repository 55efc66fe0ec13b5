"""Loading is one layer: whatever a user may pass as a model (`--from`, `zoo.Model.from_pretrained`)
is resolved here to one of the forms below, and loaded by the one reader for it. Every verb
takes a Source from `resolve` and either loads it or refuses its form with `refuse`, so a form
is accepted or refused with the same words everywhere.

The readers (checkpoints.py, gguf.py, peft.py) build the model class they are given and import
no model: the model imports this module, not the other way round.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..arch.config import ModelConfig
from ..core.errors import CheckpointError
from ..text.chat_template import ChatTemplate
from ..text.tokenizers import Tokenizer, has_tokenizer
from .checkpoints import check_tensors, load_pretrained, save_pretrained
from .gguf import chat_template_from_gguf, config_from_gguf, is_gguf, load_gguf
from .hf_config import CONFIG_FILE, read_config
from .peft import ADAPTER_CONFIG, adapter_base, factor_names, load_adapter, read_adapter
from .run_folder import checkpoint_dirs, is_checkpoint, latest_checkpoint, run_settings
from .safetensors import INDEX_FILE, CheckpointReader

# Every form a model can be given in, with the words that name it in messages.
FORMS = {
    "checkpoint": "a Hugging Face checkpoint folder",
    "sharded checkpoint": "a sharded Hugging Face checkpoint folder",
    "run": "a zoo run folder",
    "training checkpoint": "a checkpoint of a zoo run",
    "adapter": "a PEFT adapter folder",
    "gguf": "a GGUF file",
}
EXPECTED = ("a Hugging Face checkpoint folder (config.json + model.safetensors, or shards and "
            "model.safetensors.index.json), a zoo run folder or one of its checkpoints, a PEFT adapter folder "
            "(adapter_config.json + adapter_model.safetensors) or a GGUF file")


@dataclass(frozen=True)
class Source:
    """A model as given: `path` as the user wrote it, its `form` (a key of FORMS), and `model`,
    the folder or file the weights are read from (a run folder's final model, or its newest
    checkpoint while it runs)."""

    path: Path
    form: str
    model: Path

    @property
    def described(self) -> str:
        return FORMS[self.form]

    @property
    def is_adapter(self) -> bool:
        """Whether the model is a LoRA adapter over a base (a PEFT folder, or a LoRA run's)."""
        return self.form != "gguf" and _is_adapter_folder(self.model)

    def settings(self) -> dict:
        """The training settings of the run it comes from ({} for a model no zoo run wrote)."""
        return run_settings(self.path) if self.form in ("run", "training checkpoint") else {}


def resolve(path: str | os.PathLike, flag: str = "--from") -> Source:
    """The Source a path names; anything else is a CheckpointError naming the path and the forms."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(p, f"no such file or folder ({flag} takes {EXPECTED})")
    if not p.is_dir():
        if is_gguf(p):
            return Source(p, "gguf", p)
        raise CheckpointError(p, f"not a model file ({flag} takes {EXPECTED})")
    if _is_adapter_folder(p) or (p / CONFIG_FILE).exists():  # a config.json that is no file: its reader says so
        if is_checkpoint(p):
            return Source(p, "training checkpoint", p)
        if checkpoint_dirs(p):
            return Source(p, "run", p)
        if _is_adapter_folder(p):
            return Source(p, "adapter", p)
        return Source(p, "sharded checkpoint" if (p / INDEX_FILE).is_file() else "checkpoint", p)
    newest = latest_checkpoint(p)
    if newest is not None:  # a run that has not finished: its newest checkpoint
        return Source(p, "run", newest)
    raise CheckpointError(p, f"not a model folder: no config.json, adapter_config.json or checkpoints/ ({flag} "
                             f"takes {EXPECTED})")


def refuse(verb: str, source: Source, instead: str) -> ValueError:
    """The one sentence every verb refuses a form with: what it was given and what to do."""
    return ValueError(f"zoo {verb} does not take {source.described} ({source.path}): {instead}")


def load_model(source: Source, model_class, **settings):
    """The model a Source holds, built as model_class (zoo.Model): settings are its arguments
    (max_seq_len, ad, allow_nonfinite, lora, base_dtype, precision, checkpointing, adapter_seed),
    as checkpoints.load_pretrained documents them."""
    if source.form == "gguf":
        return load_gguf(source.model, model_class, **settings)
    if _is_adapter_folder(source.model):
        if settings.get("lora") is not None:
            raise ValueError(f"{source.path}: an adapter folder brings its own LoRA settings; pass no lora=")
        settings = {k: v for k, v in settings.items() if k not in ("lora", "adapter_seed")}
        return load_with_adapter(adapter_base(source.model), source.model, model_class, **settings)
    return load_pretrained(source.model, model_class, **settings)


def config_of(source: Source) -> ModelConfig:
    """The ModelConfig of a Source, from its config.json or GGUF metadata alone (an adapter:
    its base's), no weight read."""
    if source.form == "gguf":
        from .gguf_file import GGUFFile  # the gguf package, imported only for a .gguf

        with GGUFFile(source.model) as f:
            return config_from_gguf(f)
    if _is_adapter_folder(source.model):
        return config_of(resolve(adapter_base(source.model), "the adapter's base_model_name_or_path"))
    return read_config(source.model)


def load_with_adapter(base: str | os.PathLike, adapter_folder: str | os.PathLike, model_class, **settings):
    """model_class of a base (any form) with a PEFT adapter on its frozen base; settings as
    load_model's (base_dtype=, max_seq_len=, ...)."""
    base_source = resolve(base, "the base")
    adapter = read_adapter(adapter_folder, config_of(base_source))
    model = load_model(base_source, model_class, lora=adapter.lora, **settings)
    load_adapter(model, adapter_folder)
    return model


def merge(base: str | os.PathLike, adapter_folder: str | os.PathLike, out: str | os.PathLike, model_class,
          dtype: str = "float32") -> Path:
    """Write base + adapter as one Hugging Face checkpoint (W + scaling * B @ A in every adapted
    module, W in zoo's (out, in) orientation, GPT-2's Conv1D transposed back on saving), with the
    base's tokenizer and generation files, as save_pretrained carries them. Each sum is made in
    float32 and rounded once, to `dtype`, as it is stored.

    The base is held in float32 (4 bytes per parameter), or in bf16 (2 bytes: an 8B model in 16
    GB) where that loses nothing: a bfloat16 merge of a base stored in BF16."""
    base_source = resolve(base, "the base")
    held = "bf16" if dtype == "bfloat16" and _stored_in_bf16(base_source) else "fp32"
    model = load_model(base_source, model_class, base_dtype=held)
    adapter = read_adapter(adapter_folder, model.config)
    scaling = np.float32(adapter.lora.scaling)
    for a in adapter.adapters:
        a_name, b_name = factor_names(a)
        weight = f"{a.module}.weight"
        merged = model.base_tensor(weight)  # a float32 copy, exact from either format
        merged += scaling * (adapter.factors[b_name] @ adapter.factors[a_name])
        model.set_base_tensor(weight, merged)  # bf16: rounded once, as saving as bfloat16 would
    return save_pretrained(model, out, dtype=dtype)


def _stored_in_bf16(source: Source) -> bool:
    """Whether every weight of a checkpoint folder is stored in BF16 (a GGUF file: no)."""
    if source.form == "gguf" or _is_adapter_folder(source.model):
        return False
    with CheckpointReader(source.model) as reader:
        return all(reader.info(m.stored).dtype == "BF16" for m in check_tensors(read_config(source.model), reader))


def tokenizer_folder(source: Source) -> Optional[Path]:
    """The folder whose tokenizer files go with the model: the model's own, else (an adapter) its
    base's; None where neither has one (or for a GGUF file, whose tokenizer is in its metadata)."""
    if source.form == "gguf":
        return None
    if has_tokenizer(source.model):
        return source.model
    if _is_adapter_folder(source.model):
        base = adapter_base(source.model)
        return base if has_tokenizer(base) else None
    return None


def tokenizer_for(source: Source, model, folder: Optional[str | os.PathLike] = None) -> Optional[Tokenizer]:
    """The model's tokenizer: a folder given (--tokenizer), else the source's (a GGUF file's from
    its metadata: model.pretrained_tokenizer); None where there is none."""
    if folder is not None:
        return Tokenizer.from_pretrained(folder)
    if source.form == "gguf":
        return model.pretrained_tokenizer
    own = tokenizer_folder(source)
    return Tokenizer.from_pretrained(own) if own is not None else None


def chat_template_for(source: Source, folder: Optional[str | os.PathLike] = None) -> ChatTemplate:
    """The chat template the model was trained with: a tokenizer folder's given, else the
    source's (a GGUF file's tokenizer.chat_template); zoo's fallback where there is none."""
    if folder is not None:
        return ChatTemplate.for_folder(folder)
    if source.form == "gguf":
        return chat_template_from_gguf(source.model)
    own = tokenizer_folder(source)
    if own is None:
        raise CheckpointError(source.path, "no tokenizer files here, nor in an adapter's base: give a tokenizer "
                                           "folder with --tokenizer")
    return ChatTemplate.for_folder(own)


def _is_adapter_folder(folder: Path) -> bool:
    """A PEFT adapter folder (a LoRA run's output): adapter_config.json, and no model of its own."""
    return folder.is_dir() and (folder / ADAPTER_CONFIG).exists() and not (folder / CONFIG_FILE).exists()
