"""LoRA adapters in and out in PEFT's format, and merging one into its base checkpoint.

An adapter folder, as `peft.PeftModel.save_pretrained` writes it and `PeftModel.from_pretrained`
reads it: adapter_config.json (peft_type "LORA", r, lora_alpha, target_modules, ...) and
adapter_model.safetensors, whose tensors are named `base_model.model.<module>.lora_A.weight`
(r, in_features) and `....lora_B.weight` (out_features, r), <module> being the Hugging Face
module path (model.layers.0.self_attn.q_proj, transformer.h.0.attn.c_attn). A module's weight
becomes W + (lora_alpha / r) * B @ A, W in (out, in) orientation; GPT-2's Conv1D modules store
W transposed (fan_in_fan_out), their A and B are the same as a Linear's.

zoo adapts a module type (q_proj, c_attn, ...) in every layer, with one rank and one alpha, and
nothing else. An adapter that needs more (DoRA, rsLoRA's scaling, per-module ranks, biases,
modules_to_save, some layers only, the LM head) is refused by reading: the error names the field
or tensor, rather than loading a model that computes something else.
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

from .atomic import write_json
from .config import ModelConfig
from .errors import CheckpointError
from .files import read_json, parse_model
from .layout import parameter_layout
from .safetensors_io import FLOAT_DTYPES, SafetensorsFile, count_nonfinite, write_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's name for the wrapped model inside a PeftModel: every saved key starts with it.
KEY_PREFIX = "base_model.model."
PEFT_VERSION = "0.21.0"  # the PEFT release whose files these are (written as peft_version)


@dataclass(frozen=True)
class AdaptedModule:
    """One module a LoRA adapter changes: its Hugging Face path and the shapes of its factors."""

    path: str  # e.g. model.layers.0.self_attn.q_proj
    weight: str  # its base weight, by zoo's (the Hugging Face) name
    in_features: int
    out_features: int
    conv1d: bool  # GPT-2's Conv1D: the checkpoint stores the weight (in, out)

    def factor_names(self) -> tuple[str, str]:
        return f"{self.path}.lora_A.weight", f"{self.path}.lora_B.weight"


def target_names(cfg: ModelConfig) -> list[str]:
    """The module types LoRA can target in a model of cfg, in layer order (the last part of the
    module path of every 2-D weight inside a layer: q_proj ... down_proj, or c_attn, c_proj, c_fc)."""
    names: list[str] = []
    for spec in parameter_layout(cfg):
        if spec.layer == 0 and len(spec.shape) == 2:
            kind = spec.name.removesuffix(".weight").rsplit(".", 1)[1]
            if kind not in names:
                names.append(kind)
    return names


def adapted_modules(cfg: ModelConfig, targets) -> list[AdaptedModule]:
    """The modules a LoRA over `targets` (module types) adapts, in layout order; GPT-2's c_proj
    is both attn.c_proj and mlp.c_proj, as in PEFT."""
    targets = set(targets)
    out = []
    for spec in parameter_layout(cfg):
        if spec.layer < 0 or len(spec.shape) != 2:
            continue
        path = spec.name.removesuffix(".weight")
        if path.rsplit(".", 1)[1] in targets:
            out_features, in_features = spec.shape  # zoo stores every weight (out, in)
            out.append(AdaptedModule(path, spec.name, in_features, out_features, spec.hf_transposed))
    return out


# --- reading ------------------------------------------------------------------------------------


class PeftLoraFile(BaseModel):
    """The fields of adapter_config.json that zoo reads. The others PEFT writes are checked by
    _unsupported_fields: harmless ones pass, any other that is set is refused."""

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
class Adapter:
    """An adapter read from a folder and checked against a model config."""

    folder: Path
    r: int
    alpha: float
    dropout: float
    targets: list[str]  # module types, in layer order
    modules: list[AdaptedModule]
    factors: dict[str, np.ndarray]  # zoo name (`<module>.lora_A.weight`) -> float32
    base_model_name_or_path: Optional[str]

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def _is_set(value: Any) -> bool:
    return value not in (None, False, "", 0) and value != {} and value != []


def _candidate_modules(cfg: ModelConfig) -> list[str]:
    """Every Linear/Conv1D module of the transformers model of cfg, as PEFT's matching sees them."""
    return [m.path for m in adapted_modules(cfg, target_names(cfg))] + ["lm_head"]


def _peft_matches(target_modules: Union[list[str], str], module: str) -> bool:
    """PEFT's rule: a list names modules by their path's ending, a string is a regular expression
    the whole path must match, "all-linear" is every linear layer but the output layer."""
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return module != "lm_head"
        return re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith("." + t) for t in target_modules)


def read_adapter(folder: Union[str, os.PathLike], cfg: ModelConfig) -> Adapter:
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
        raise CheckpointError(config_path, f"peft_type {conf.peft_type!r}: zoo reads LoRA adapters only", key="peft_type")
    if not math.isfinite(conf.lora_alpha):
        raise CheckpointError(config_path, f"lora_alpha {conf.lora_alpha} is not finite", key="lora_alpha")
    if conf.bias != "none":
        raise CheckpointError(config_path, f"bias {conf.bias!r}: zoo's adapters train no biases (only 'none')",
                              key="bias")
    for field in sorted(set(raw) - set(PeftLoraFile.model_fields) - _HARMLESS_FIELDS):
        if _is_set(raw[field]):
            what = _FEATURES.get(field, "a PEFT feature zoo does not have")
            raise CheckpointError(config_path, f"{raw[field]!r}: {what}; zoo cannot represent it", key=field)

    selected = [m for m in _candidate_modules(cfg) if _peft_matches(conf.target_modules, m)]
    if not selected:
        raise CheckpointError(config_path, f"{conf.target_modules!r} selects no module of this model (it has "
                                           f"{', '.join(target_names(cfg))})", key="target_modules")
    if "lm_head" in selected:
        raise CheckpointError(config_path, "adapts lm_head; zoo adapts the linear layers inside the blocks only",
                              key="target_modules")
    kinds = {m.rsplit(".", 1)[1] for m in selected}
    targets = [t for t in target_names(cfg) if t in kinds]
    modules = adapted_modules(cfg, targets)
    missed = [m.path for m in modules if m.path not in selected]
    if missed:
        raise CheckpointError(config_path, f"{conf.target_modules!r} adapts some {'/'.join(targets)} modules but not "
                                           f"{missed[0]}; zoo adapts a module type in every layer",
                              key="target_modules")
    fan_in_fan_out = cfg.family == "gpt2"
    if conf.fan_in_fan_out != fan_in_fan_out:
        raise CheckpointError(config_path, f"{conf.fan_in_fan_out} for a {cfg.family} model, whose modules are "
                                           f"{'Conv1D' if fan_in_fan_out else 'Linear'} (expected {fan_in_fan_out})",
                              key="fan_in_fan_out")
    factors = _read_factors(folder / ADAPTER_WEIGHTS, modules, conf.r)
    return Adapter(folder, conf.r, float(conf.lora_alpha), conf.lora_dropout, targets, modules, factors,
                   conf.base_model_name_or_path)


def _read_factors(path: Path, modules: list[AdaptedModule], r: int) -> dict[str, np.ndarray]:
    """Every module's A and B from the weights file, as float32: names, shapes and dtypes checked
    first, and no tensor left over (one zoo has no place for would silently be dropped)."""
    expected: dict[str, tuple[int, int]] = {}
    for m in modules:
        a, b = m.factor_names()
        expected[a] = (r, m.in_features)
        expected[b] = (m.out_features, r)
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
            factors[name] = arr
    return factors


# --- a zoo model's adapters in and out ----------------------------------------------------------


def lora_config(adapter: Adapter):
    """The zoo.LoraConfig of an adapter read from a folder."""
    from .lora import LoraConfig

    return LoraConfig(r=adapter.r, alpha=adapter.alpha, dropout=adapter.dropout, targets=adapter.targets)


def save_adapter(model, folder: Union[str, os.PathLike], *, base_model_name_or_path: Optional[str] = None) -> Path:
    """Write a LoRA model's adapters as a PEFT adapter folder (float32), each file atomically,
    adapter_config.json last (a folder with one is complete). base_model_name_or_path defaults to
    the folder the base was loaded from."""
    lora = getattr(model, "lora", None)
    if lora is None:
        raise ValueError("save_adapter: the model has no LoRA adapters (zoo.Model(..., lora=LoraConfig(...)))")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    modules = adapted_modules(model.config, lora.targets)
    params = model.parameters()
    tensors = []
    for m in modules:
        for name in m.factor_names():
            tensors.append((KEY_PREFIX + name, params[name]))
    write_file(folder / ADAPTER_WEIGHTS, tensors, "F32", metadata={"format": "pt"})
    if base_model_name_or_path is None:
        pretrained = getattr(model, "pretrained_path", None)
        base_model_name_or_path = str(pretrained) if pretrained is not None else None
    write_json(folder / ADAPTER_CONFIG, peft_config_dict(model.config, lora.r, lora.alpha, lora.dropout,
                                                         lora.targets, base_model_name_or_path))
    return folder


def peft_config_dict(cfg: ModelConfig, r: int, alpha: float, dropout: float, targets,
                     base_model_name_or_path: Optional[str]) -> dict:
    """adapter_config.json as PEFT 0.21 writes it for a plain LoRA (its other fields keep PEFT's
    defaults when it reads the file)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "peft_version": PEFT_VERSION,
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else float(alpha),
        "lora_dropout": dropout,
        "target_modules": [t for t in target_names(cfg) if t in set(targets)],
        "exclude_modules": None,
        "fan_in_fan_out": cfg.family == "gpt2",  # GPT-2's Conv1D stores weights (in, out)
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


def load_adapter(model, folder: Union[str, os.PathLike]) -> Adapter:
    """Copy a PEFT adapter's factors into a LoRA model whose rank, alpha and targets are the
    adapter's (errors name the field that differs)."""
    lora = getattr(model, "lora", None)
    if lora is None:
        raise ValueError("load_adapter: the model has no LoRA adapters; make it with "
                         "lora=peft_io.lora_config(peft_io.read_adapter(folder, config)), or use load_with_adapter")
    adapter = read_adapter(folder, model.config)
    config_path = adapter.folder / ADAPTER_CONFIG
    if adapter.r != lora.r:
        raise CheckpointError(config_path, f"{adapter.r}, but the model's LoRA has r={lora.r}", key="r")
    if not math.isclose(adapter.scaling, lora.scaling, rel_tol=1e-6):
        raise CheckpointError(config_path, f"{adapter.alpha:g} (scaling {adapter.scaling:g}), but the model's "
                                           f"LoRA has alpha={lora.alpha:g} (scaling {lora.scaling:g})",
                              key="lora_alpha")
    if set(adapter.targets) != set(lora.targets):
        raise CheckpointError(config_path, f"adapts {', '.join(adapter.targets)}, but the model's LoRA targets "
                                           f"{', '.join(lora.targets)}", key="target_modules")
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
                                           "(zoo.peft_io.load_with_adapter(base, adapter))", key="base_model_name_or_path")
    path = Path(base) if os.path.isabs(base) else Path(folder) / base
    if not path.is_dir():
        raise CheckpointError(config_path, f"{base!r} is not a checkpoint folder on this machine (a Hub name? "
                                           "download it, then zoo.peft_io.load_with_adapter(base, adapter))",
                              key="base_model_name_or_path")
    return path


def load_with_adapter(base: Union[str, os.PathLike], adapter_folder: Union[str, os.PathLike], **kwargs):
    """A zoo.Model of a Hugging Face checkpoint with a PEFT adapter on its frozen base; kwargs
    (base_dtype=, max_seq_len=, ...) go to zoo.Model.from_pretrained."""
    from .hf_config import read_config
    from .model import Model

    adapter = read_adapter(adapter_folder, read_config(base))
    model = Model.from_pretrained(base, lora=lora_config(adapter), **kwargs)
    load_adapter(model, adapter_folder)
    return model


# --- zoo merge --------------------------------------------------------------------------------


def merge_adapter(base: Union[str, os.PathLike], adapter_folder: Union[str, os.PathLike],
                  out: Union[str, os.PathLike], dtype: str = "float32") -> Path:
    """Write base + adapter as one Hugging Face checkpoint (W + scaling * B @ A in every adapted
    module), tokenizer and generation files carried over from the base, as save_pretrained does.
    The base is loaded in float32 (4 bytes per parameter) and each sum made in float32, then
    stored as `dtype`."""
    from .checkpoints import load_pretrained, save_pretrained

    model = load_pretrained(base)
    adapter = read_adapter(adapter_folder, model.config)
    params = model.parameters()
    scaling = np.float32(adapter.scaling)
    for m in adapter.modules:
        a_name, b_name = m.factor_names()
        params[m.weight] += scaling * (adapter.factors[b_name] @ adapter.factors[a_name])
    return save_pretrained(model, out, dtype=dtype)
