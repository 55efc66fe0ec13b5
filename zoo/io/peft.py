"""LoRA adapters in and out in PEFT's format (loading one over its base, and merging: io/load.py).

An adapter folder, as `peft.PeftModel.save_pretrained` writes it and `PeftModel.from_pretrained`
reads it: adapter_config.json (peft_type "LORA", r, lora_alpha, target_modules, ...) and
adapter_model.safetensors, whose tensors are named `base_model.model.<module>.lora_A.weight`
(r, in_features) and `....lora_B.weight` (out_features, r), <module> being the Hugging Face
module path (model.layers.0.self_attn.q_proj, transformer.h.0.attn.c_attn). A module's weight
becomes W + (lora_alpha / r) * B @ A, W in (out, in) orientation; GPT-2's Conv1D modules store
W transposed (fan_in_fan_out), their A and B are the same as a Linear's.

Which modules an adapter sits on, and their shapes, come from zoo/arch/lora.py (zoo.arch.lora.adapters),
as for zoo's own LoRA runs. zoo adapts the modules its targets name (q_proj, c_attn, attn.c_proj
...) in every layer, with one rank and one alpha, and nothing else. An adapter that needs more
(DoRA, rsLoRA's scaling, per-module ranks, biases, modules_to_save, some layers only, the LM
head) is refused by reading: the error names the field or tensor, rather than loading a model
that computes something else.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .. import families
from ..arch.config import ModelConfig
from ..arch.lora import Adapter, LoraConfig, adapter_layout, adapters, module_names
from ..core.atomic import write_json
from ..core.errors import CheckpointError
from ..core.files import parse_model, read_json
from .safetensors import FLOAT_DTYPES, SafetensorsFile, count_nonfinite, write_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's name for the wrapped model inside a PeftModel: every saved key starts with it.
KEY_PREFIX = "base_model.model."
PEFT_VERSION = "0.21.0"  # the PEFT release whose files these are (written as peft_version)


def factor_names(a: Adapter) -> tuple[str, str]:
    """An adapter's A and B by zoo's names (PEFT's, less its base_model.model. prefix), as
    zoo.arch.lora.adapter_layout names them."""
    return f"{a.module}.lora_A.weight", f"{a.module}.lora_B.weight"


# --- reading ------------------------------------------------------------------------------------


class PeftLoraFile(BaseModel):
    """The fields of adapter_config.json that zoo reads. Of the others PEFT writes, the harmless
    ones pass and any other that is set is refused (read_adapter)."""

    model_config = ConfigDict(extra="allow")
    peft_type: str
    r: int = Field(gt=0, strict=True)
    lora_alpha: float
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: Union[list[str], str]
    fan_in_fan_out: bool = False
    bias: str = "none"
    task_type: Optional[str] = None
    base_model_name_or_path: Optional[str] = None


# Fields that do not change what an adapter computes once its weights are loaded: metadata,
# and how PEFT initialised the factors (the file holds their trained values). Any other field
# beyond PeftLoraFile's must be unset (null, false, empty).
_HARMLESS_FIELDS = {"peft_version", "revision", "inference_mode", "auto_mapping", "init_lora_weights",
                    "megatron_core", "qalora_group_size", "runtime_config", "loftq_config"}
# What each refused field means, for the error.
_FEATURES = {"use_dora": "DoRA", "use_rslora": "rsLoRA scaling (lora_alpha / sqrt(r))",
             "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
             "modules_to_save": "fully trained extra modules", "layers_to_transform": "adapting some layers only",
             "layers_pattern": "adapting some layers only", "exclude_modules": "excluded modules",
             "lora_bias": "a bias on lora_B", "target_parameters": "adapted parameters (not modules)",
             "trainable_token_indices": "trained token embeddings", "layer_replication": "replicated layers",
             "use_qalora": "QALoRA", "use_bdlora": "block-diagonal LoRA", "ensure_weight_tying": "tied adapters"}


@dataclass
class PeftAdapter:
    """An adapter folder, read and checked against a model config."""

    folder: Path
    lora: LoraConfig  # the zoo LoRA that computes what the adapter computes
    adapters: list[Adapter]  # the modules it sits on (zoo.arch.lora.adapters of cfg and lora)
    factors: dict[str, np.ndarray]  # zoo name (`<module>.lora_A.weight`) -> float32
    base_model_name_or_path: Optional[str]


def _is_set(value: Any) -> bool:
    return value not in (None, False, "", 0) and value != {} and value != []


def _peft_matches(target_modules: Union[list[str], str], module: str) -> bool:
    """PEFT's rule: a list names modules by their path's ending, a string is a regular expression
    the whole path must match, "all-linear" is every linear layer but the output layer."""
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return module != "lm_head"
        return re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith("." + t) for t in target_modules)


def _in_layer(module: str) -> str:
    """A module's path inside its layer: model.layers.3.self_attn.q_proj -> self_attn.q_proj."""
    return module.split(".", 3)[3]  # past model.layers.3. or transformer.h.3.


def _zoo_targets(cfg: ModelConfig, selected: list[str]) -> list[str]:
    """zoo targets that name the selected modules: a module name (q_proj, c_proj) where every
    module it names in a layer is selected, else the path inside the layer (attn.c_proj)."""
    paths = list(dict.fromkeys(_in_layer(m) for m in selected))
    every = [_in_layer(a.module) for a in adapters(cfg, LoraConfig(targets=None)) if a.layer == 0]
    targets = []
    for name in module_names(cfg):
        named = [p for p in every if p == name or p.endswith("." + name)]
        chosen = [p for p in named if p in paths]
        targets += [name] if chosen and len(chosen) == len(named) else chosen
    return targets


def read_adapter(folder: Union[str, os.PathLike], cfg: ModelConfig) -> PeftAdapter:
    """Read a PEFT LoRA adapter folder for a model of `cfg`: every field and tensor checked before
    it is used, each error naming the file and the field or tensor at fault."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(folder, f"not an adapter folder (expected {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config_path = folder / ADAPTER_CONFIG
    raw = read_json(config_path, "adapter config")
    if not isinstance(raw, dict):
        raise CheckpointError(config_path, "not a JSON object")
    conf = parse_model(config_path, PeftLoraFile, raw, ADAPTER_CONFIG)
    if conf.peft_type.upper() != "LORA":
        raise CheckpointError(config_path, f"peft_type {conf.peft_type!r}: zoo reads LoRA adapters only",
                              key="peft_type")
    if not (math.isfinite(conf.lora_alpha) and conf.lora_alpha > 0):
        raise CheckpointError(config_path, f"{conf.lora_alpha}: must be a finite number > 0", key="lora_alpha")
    if conf.bias != "none":
        raise CheckpointError(config_path, f"{conf.bias!r}: zoo's adapters train no biases (only 'none')", key="bias")
    for field in sorted(set(raw) - set(PeftLoraFile.model_fields) - _HARMLESS_FIELDS):
        if _is_set(raw[field]):
            what = _FEATURES.get(field, "a PEFT feature zoo does not have")
            raise CheckpointError(config_path, f"{raw[field]!r}: {what}; zoo cannot represent it", key=field)

    every = [a.module for a in adapters(cfg, LoraConfig(targets=None))]
    try:
        selected = [m for m in every + ["lm_head"] if _peft_matches(conf.target_modules, m)]
    except re.error as e:
        raise CheckpointError(config_path, f"{conf.target_modules!r} is not a regular expression ({e})",
                              key="target_modules") from None
    if not selected:
        raise CheckpointError(config_path, f"{conf.target_modules!r} selects no module of this model (its linear "
                                           f"layers: {', '.join(module_names(cfg))})", key="target_modules")
    if "lm_head" in selected:
        raise CheckpointError(config_path, "adapts lm_head; zoo adapts the linear layers inside the blocks only",
                              key="target_modules")
    lora = LoraConfig(r=conf.r, alpha=conf.lora_alpha, dropout=conf.lora_dropout,
                      targets=_zoo_targets(cfg, selected))
    placed = adapters(cfg, lora)
    missed = sorted({a.module for a in placed} - set(selected), key=every.index)
    if missed:
        raise CheckpointError(config_path, f"{conf.target_modules!r} adapts {_in_layer(missed[0])} in some layers "
                                           f"but not {missed[0]}; zoo adapts a module in every layer",
                              key="target_modules")
    fan_in_fan_out = families.get(cfg.family).names.transposed
    if conf.fan_in_fan_out != fan_in_fan_out:
        raise CheckpointError(config_path, f"{conf.fan_in_fan_out} for a {cfg.family} model, whose modules are "
                                           f"{'Conv1D' if fan_in_fan_out else 'Linear'} (expected {fan_in_fan_out})",
                              key="fan_in_fan_out")
    factors = _read_factors(folder / ADAPTER_WEIGHTS, cfg, lora)
    return PeftAdapter(folder, lora, placed, factors, conf.base_model_name_or_path)


def _read_factors(path: Path, cfg: ModelConfig, lora: LoraConfig) -> dict[str, np.ndarray]:
    """Every adapter's A (r, in_features) and B (out_features, r) from the weights file, as
    float32: names, shapes and dtypes checked first, and no tensor left over (one zoo has no place
    for would silently be dropped)."""
    r = lora.r
    expected = {spec.name: spec.shape for spec in adapter_layout(cfg, lora)[0]}
    with SafetensorsFile(path) as f:
        stored = {}
        for name in f.tensors:
            if not name.startswith(KEY_PREFIX):
                raise CheckpointError(path, f"tensor name does not start with {KEY_PREFIX!r}, as PEFT's do", key=name)
            stored[name[len(KEY_PREFIX):]] = name
        for name in stored:
            if name not in expected:
                raise CheckpointError(path, "tensor has no place in a LoRA adapter of the modules "
                                            f"{ADAPTER_CONFIG} targets", key=stored[name])
        factors = {}
        for name, shape in expected.items():
            key = KEY_PREFIX + name
            if name not in stored:
                raise CheckpointError(path, "tensor missing from the adapter", key=key)
            info = f.info(key)
            if info.dtype not in FLOAT_DTYPES:
                raise CheckpointError(path, f"dtype {info.dtype} is not a floating-point tensor", key=key)
            if info.shape != shape:
                raise CheckpointError(path, f"shape {list(info.shape)}, expected {list(shape)} (r={r})", key=key)
            arr = f.read(key)
            bad = count_nonfinite(arr)
            if bad:
                raise CheckpointError(path, f"{bad:,} non-finite values (NaN or Inf)", key=key)
            factors[name] = families.get(cfg.family).rows_from_checkpoint(cfg, name, arr)
    return factors


# --- a zoo model's adapters in and out ----------------------------------------------------------


def save_adapter(model, folder: Union[str, os.PathLike], *, base_model_name_or_path: Optional[str] = None) -> Path:
    """Write a LoRA model's adapters as a PEFT adapter folder (float32), each file atomically,
    adapter_config.json last (a folder with one is complete). base_model_name_or_path defaults to
    the folder the base was loaded from."""
    lora = getattr(model, "lora", None)
    if lora is None:
        raise ValueError("save_adapter: the model has no LoRA adapters (zoo.Model(..., lora=LoraConfig(...)))")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = model.parameters()
    family = families.get(model.config.family)
    tensors = [(KEY_PREFIX + name, family.rows_to_checkpoint(model.config, name, value)) for name, value in params.items()]
    write_file(folder / ADAPTER_WEIGHTS, tensors, "F32", metadata={"format": "pt"})
    if base_model_name_or_path is None:
        pretrained = getattr(model, "pretrained_path", None)
        base_model_name_or_path = str(pretrained) if pretrained is not None else None
    write_json(folder / ADAPTER_CONFIG, peft_config_dict(model.config, lora, base_model_name_or_path))
    return folder


def peft_config_dict(cfg: ModelConfig, lora: LoraConfig, base_model_name_or_path: Optional[str]) -> dict:
    """adapter_config.json as PEFT 0.21 writes it for a plain LoRA (its other fields keep PEFT's
    defaults when it reads the file). PEFT matches target_modules as zoo does (a module whose path
    is, or ends with, a target), so zoo's targets are written as they are."""
    alpha = lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "peft_version": PEFT_VERSION,
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": lora.r,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else float(alpha),
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets) if lora.targets is not None else module_names(cfg),
        "exclude_modules": None,
        "fan_in_fan_out": families.get(cfg.family).names.transposed,  # GPT-2's Conv1D stores weights (in, out)
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "lora_bias": False,
    }


def load_adapter(model, folder: Union[str, os.PathLike]) -> PeftAdapter:
    """Copy a PEFT adapter's factors into a LoRA model with the adapter's rank, scaling and
    modules (errors name the field that differs)."""
    lora = getattr(model, "lora", None)
    if lora is None:
        raise ValueError("load_adapter: the model has no LoRA adapters; make it with "
                         "lora=read_adapter(folder, config).lora, or load the adapter folder itself: "
                         "zoo.Model.from_pretrained(folder)")
    adapter = read_adapter(folder, model.config)
    config_path = adapter.folder / ADAPTER_CONFIG
    if adapter.lora.r != lora.r:
        raise CheckpointError(config_path, f"{adapter.lora.r}, but the model's LoRA has r={lora.r}", key="r")
    if not math.isclose(adapter.lora.scaling, lora.scaling, rel_tol=1e-6):
        raise CheckpointError(config_path, f"{adapter.lora.alpha:g} (scaling {adapter.lora.scaling:g}), but the "
                                           f"model's LoRA has alpha={lora.alpha:g} (scaling {lora.scaling:g})",
                              key="lora_alpha")
    theirs = [a.module for a in adapter.adapters]
    ours = [a.module for a in adapters(model.config, lora)]
    if theirs != ours:
        extra = next(iter([m for m in theirs if m not in ours] + [m for m in ours if m not in theirs]))
        raise CheckpointError(config_path, f"adapts {', '.join(adapter.lora.targets)}, but the model's LoRA "
                                           f"targets {', '.join(lora.targets or module_names(model.config))} "
                                           f"({extra} is in one and not the other)", key="target_modules")
    params = model.parameters()
    for name, value in adapter.factors.items():
        params[name][...] = value
    return adapter


def adapter_base(folder: Union[str, os.PathLike]) -> Path:
    """The base checkpoint folder an adapter folder names (base_model_name_or_path, relative to
    the adapter folder when not absolute); an error naming the field if it is not a folder here."""
    config_path = Path(folder) / ADAPTER_CONFIG
    raw = read_json(config_path, "adapter config")
    base = raw.get("base_model_name_or_path") if isinstance(raw, dict) else None
    if not base:
        raise CheckpointError(config_path, "names no base model; give the base folder and the adapter folder "
                                           "(zoo.io.load.load_with_adapter(base, adapter, zoo.Model))", key="base_model_name_or_path")
    path = Path(base) if os.path.isabs(base) else Path(folder) / base
    if not path.is_dir():
        raise CheckpointError(config_path, f"{base!r} is not a checkpoint folder on this machine (a Hub name? "
                                           "download it, then zoo.io.load.load_with_adapter(base, adapter, zoo.Model))",
                              key="base_model_name_or_path")
    return path
