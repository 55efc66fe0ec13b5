"""Hugging Face config.json <-> ModelConfig, for GPT2LMHeadModel and LlamaForCausalLM.

Every key that changes the math is read; a missing key takes the default of the transformers
config class (transformers omits keys equal to its defaults when it saves). A value zoo cannot
compute exactly (another activation, another rope type, cross-attention...) is an error naming
the file and key, never an approximation. Keys that only matter to training-time dropout,
caching or generation are ignored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from ..core.config import ModelConfig, RopeScaling
from ..core.errors import CheckpointError
from ..core.files import first_field_error, read_json, show_value

CONFIG_FILE = "config.json"
ZOO_MODEL_TYPE = "zoo"  # zoo's own config.json, for configs transformers has no class for

ARCHITECTURES = {"gpt2": ("GPT2LMHeadModel", "GPT2Model"), "llama": ("LlamaForCausalLM", "LlamaModel")}

# GPT-2's tanh-approximated GELU under its transformers names (the same function).
_GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")

# Which Hugging Face key feeds each ModelConfig field, per family (for error messages).
_HF_KEY = {
    "gpt2": {"vocab_size": "vocab_size", "max_seq_len": "n_positions", "d_model": "n_embd", "n_layer": "n_layer",
             "n_head": "n_head", "n_kv_head": "n_head", "head_dim": "n_head", "d_ff": "n_inner",
             "norm_eps": "layer_norm_epsilon",
             "tied_embeddings": "tie_word_embeddings"},
    "llama": {"vocab_size": "vocab_size", "max_seq_len": "max_position_embeddings", "d_model": "hidden_size",
              "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
              "head_dim": "head_dim", "d_ff": "intermediate_size", "norm_eps": "rms_norm_eps",
              "rope_theta": "rope_theta", "rope_scaling": "rope_scaling", "attention_bias": "attention_bias",
              "mlp_bias": "mlp_bias", "tied_embeddings": "tie_word_embeddings"},
}


def config_file(path: str | os.PathLike) -> Path:
    """The config.json of a checkpoint folder, or the path itself when it is not a folder."""
    path = Path(path)
    return path / CONFIG_FILE if path.is_dir() else path


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of a checkpoint folder (or the file itself)."""
    return _read_config_file(config_file(path))


def _read_config_file(file: Path) -> dict[str, Any]:
    """A config.json: a regular file (a FIFO is refused, not opened; a folder in its place too),
    within files.py's size bound, a JSON object. Its fields are typed where they are read
    (config_from_hf), each error naming the key."""
    if not file.exists():
        raise CheckpointError(file, "not found: a checkpoint folder needs its config.json")
    hf = read_json(file, CONFIG_FILE)
    if not isinstance(hf, dict):
        raise CheckpointError(file, f"not a JSON object (a {_json_type(hf)}): a config.json is {{\"model_type\": ...}}")
    return hf


def _json_type(value) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}.get(
        type(value), type(value).__name__)


def read_config(path: str | os.PathLike, max_seq_len: Optional[int] = None) -> ModelConfig:
    """ModelConfig of a checkpoint folder's config.json (max_seq_len: as config_from_hf)."""
    file = config_file(path)
    return config_from_hf(_read_config_file(file), file, max_seq_len)


def _with_context(fields: dict, max_seq_len: Optional[int], source) -> dict:
    """fields with the context capped to max_seq_len, before validation: a RoPE model's positions
    are computed, so its config.json may name a context beyond zoo's bound (a 4M-token Llama)
    that a smaller max_seq_len makes loadable. Learned positions are a fixed table."""
    if max_seq_len is None or fields.get("max_seq_len") == max_seq_len:
        return fields
    if fields.get("positions", "learned") != "rope":
        raise ValueError(f"max_seq_len: {source} has learned positions; its context is fixed at "
                         f"{fields.get('max_seq_len')}")
    return {**fields, "max_seq_len": max_seq_len}


def config_from_hf(hf: dict[str, Any], source: str | os.PathLike = CONFIG_FILE,
                   max_seq_len: Optional[int] = None) -> ModelConfig:
    """ModelConfig of a parsed config.json; `source` names the file in errors; max_seq_len caps
    the context of a RoPE model (_with_context)."""
    model_type = hf.get("model_type")
    if not isinstance(model_type, str):
        raise CheckpointError(source, f"expected a string (zoo reads: {', '.join(ARCHITECTURES)}, {ZOO_MODEL_TYPE}), "
                                      f"got {_json_type(model_type)} {show_value(model_type)}", key="model_type")
    if model_type == ZOO_MODEL_TYPE:
        return _zoo_config(hf, source, max_seq_len)
    if model_type not in ARCHITECTURES:
        raise CheckpointError(source, f"unsupported model_type {show_value(model_type)} (zoo reads: "
                                      f"{', '.join(ARCHITECTURES)}, {ZOO_MODEL_TYPE})", key="model_type")
    archs = hf.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not all(a in ARCHITECTURES[model_type] for a in archs):
            raise CheckpointError(source, f"unsupported architectures {show_value(archs)} for model_type {model_type!r} "
                                          f"(zoo reads: {', '.join(ARCHITECTURES[model_type])})", key="architectures")
    fields = _gpt2_fields(hf, source) if model_type == "gpt2" else _llama_fields(hf, source)
    fields = _with_context(fields, max_seq_len, source)
    try:
        return ModelConfig(**fields)
    except ValidationError as e:
        field, msg = first_field_error(e)
        raise CheckpointError(source, f"invalid value: {msg}", key=_HF_KEY[model_type].get(field)) from None


def _zoo_config(hf: dict, source, max_seq_len: Optional[int] = None) -> ModelConfig:
    fields = hf.get("zoo_config")
    if not isinstance(fields, dict):
        raise CheckpointError(source, "model_type 'zoo' needs a zoo_config object", key="zoo_config")
    fields = _with_context(fields, max_seq_len, source)
    try:
        return ModelConfig(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise CheckpointError(source, f"invalid value: {first['msg']}",
                              key=f"zoo_config.{where}" if where else "zoo_config") from None


def _gpt2_fields(hf: dict, source) -> dict:
    get = _Getter(hf, source)
    # Variants of GPT-2 attention that zoo's blocks do not compute.
    get.require("scale_attn_weights", True, bool)
    get.require("scale_attn_by_inverse_layer_idx", False, bool)
    get.require("add_cross_attention", False, bool)
    activation = get("activation_function", "gelu_new", str)
    if activation not in _GPT2_ACTIVATIONS:
        raise CheckpointError(source, f"unsupported activation {show_value(activation)} (zoo's GELU is the tanh approximation: "
                                      f"{', '.join(_GPT2_ACTIVATIONS)})", key="activation_function")
    d_model = get("n_embd", 768, int)
    n_inner = get("n_inner", None, int)
    return dict(
        vocab_size=get("vocab_size", 50257, int), max_seq_len=get("n_positions", 1024, int), d_model=d_model,
        n_layer=get("n_layer", 12, int), n_head=get("n_head", 12, int),
        d_ff=n_inner if n_inner is not None else 4 * d_model,
        norm="layernorm", norm_eps=get("layer_norm_epsilon", 1e-5, float), mlp="gelu", positions="learned",
        attention_bias=True, mlp_bias=True, tied_embeddings=get("tie_word_embeddings", True, bool),
    )


def _llama_fields(hf: dict, source) -> dict:
    get = _Getter(hf, source)
    get.require("hidden_act", "silu", str)
    theta, scaling = _llama_rope(hf, source, get)
    return dict(
        vocab_size=get("vocab_size", 32000, int), max_seq_len=get("max_position_embeddings", 2048, int),
        d_model=get("hidden_size", 4096, int), n_layer=get("num_hidden_layers", 32, int),
        n_head=get("num_attention_heads", 32, int), n_kv_head=get("num_key_value_heads", None, int),
        head_dim=get("head_dim", None, int), d_ff=get("intermediate_size", 11008, int),
        norm="rmsnorm", norm_eps=get("rms_norm_eps", 1e-6, float), mlp="swiglu", positions="rope",
        rope_theta=theta, rope_scaling=scaling,
        attention_bias=get("attention_bias", False, bool), mlp_bias=get("mlp_bias", False, bool),
        tied_embeddings=get("tie_word_embeddings", False, bool),
    )


def _llama_rope(hf: dict, source, get: "_Getter") -> tuple[float, RopeScaling | None]:
    """rope_theta and Llama-3 scaling, from the newer rope_parameters or the older
    rope_theta + rope_scaling (transformers lets rope_scaling win when both are present)."""
    key = "rope_scaling" if hf.get("rope_scaling") is not None else "rope_parameters"
    params = hf.get(key)
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise CheckpointError(source, f"expected a JSON object, got {show_value(params)}", key=key)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise CheckpointError(source, f"expected a number, got {show_value(theta)}", key=f"{key}.rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial_key = f"{key}.partial_rotary_factor" if "partial_rotary_factor" in params else "partial_rotary_factor"
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial is not None and partial != 1.0:
        raise CheckpointError(source, f"value {show_value(partial)} is not supported (zoo rotates the whole head)",
                              key=partial_key)
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise CheckpointError(source, f"unsupported rope type {show_value(rope_type)} (zoo computes 'default' and 'llama3')",
                              key=f"{key}.rope_type")
    values = {}
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        v = params.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CheckpointError(source, f"llama3 rope scaling needs a number, got {show_value(v)}", key=f"{key}.{name}")
        values[name] = float(v)
    original = params.get("original_max_position_embeddings", get("max_position_embeddings", 2048, int))
    if isinstance(original, bool) or not isinstance(original, int):
        raise CheckpointError(source, f"expected an integer, got {show_value(original)}",
                              key=f"{key}.original_max_position_embeddings")
    try:
        scaling = RopeScaling(original_max_position_embeddings=original, **values)
    except ValidationError as e:
        raise CheckpointError(source, f"invalid llama3 rope scaling: {e.errors()[0]['msg']}", key=key) from None
    return float(theta), scaling


class _Getter:
    """Typed reads from a config dict, with errors naming the file and key."""

    def __init__(self, hf: dict, source):
        self.hf, self.source = hf, source

    def __call__(self, key: str, default, kind: type):
        value = self.hf.get(key, default)
        if value is None:
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CheckpointError(self.source, f"expected {kind.__name__}, got {show_value(value)}", key=key)
        return value

    def require(self, key: str, expected, kind: type) -> None:
        value = self(key, expected, kind)
        if value != expected:
            raise CheckpointError(self.source, f"value {show_value(value)} is not supported by zoo (only {expected!r})", key=key)


# --- writing ---------------------------------------------------------------------------------


def hf_incompatibility(cfg: ModelConfig) -> tuple[str, str] | None:
    """(field, why) when the class of cfg's naming family (GPT2LMHeadModel or LlamaForCausalLM)
    cannot express cfg, else None."""
    if cfg.family == "gpt2":
        arch, wanted = "GPT2LMHeadModel", (("layer", "sequential"), ("norm", "layernorm"), ("mlp", "gelu"),
                                           ("attention_bias", True), ("mlp_bias", True), ("n_kv_head", cfg.n_head))
        if cfg.head_dim * cfg.n_head != cfg.d_model:
            return "head_dim", f"{arch} needs head_dim * n_head == d_model, got {cfg.head_dim} * {cfg.n_head}"
    else:
        arch, wanted = "LlamaForCausalLM", (("layer", "sequential"), ("norm", "rmsnorm"), ("mlp", "swiglu"))
        if cfg.d_model % cfg.n_head != 0:  # transformers' LlamaConfig rejects this even with an explicit head_dim
            return "n_head", f"{arch} needs d_model divisible by n_head, got {cfg.d_model} and {cfg.n_head}"
    for field, expected in wanted:
        if getattr(cfg, field) != expected:
            return field, f"{arch} cannot express {field}={getattr(cfg, field)!r} (it has {expected!r})"
    return None


def config_to_hf(cfg: ModelConfig, *, dtype: str = "float32", bos_token_id: int | list[int] | None = None,
                 eos_token_id: int | list[int] | None = None, target: str | os.PathLike = CONFIG_FILE) -> dict:
    """The config.json for `cfg`, as transformers reads it. A config outside what GPT2LMHeadModel
    or LlamaForCausalLM can express is an error naming the field (`target` names the file)."""
    problem = hf_incompatibility(cfg)
    if problem is not None:
        raise CheckpointError(target, problem[1], key=problem[0])
    hf = _gpt2_to_hf(cfg) if cfg.family == "gpt2" else _llama_to_hf(cfg)
    return {**hf, **_common(cfg, dtype, bos_token_id, eos_token_id)}


def config_to_zoo(cfg: ModelConfig, *, dtype: str = "float32", bos_token_id: int | list[int] | None = None,
                  eos_token_id: int | list[int] | None = None) -> dict:
    """zoo's own config.json (model_type "zoo"), for mixes transformers has no class for
    (e.g. RoPE with LayerNorm and GELU): zoo reads it back, transformers does not."""
    return {"model_type": ZOO_MODEL_TYPE, "zoo_config": cfg.model_dump(mode="json"),
            **_common(cfg, dtype, bos_token_id, eos_token_id)}


def _common(cfg: ModelConfig, dtype: str, bos_token_id, eos_token_id) -> dict:
    return {"tie_word_embeddings": cfg.tied_embeddings, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
            "dtype": dtype, "torch_dtype": dtype}  # torch_dtype: the key transformers 4.x reads


def _gpt2_to_hf(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
        "n_inner": cfg.d_ff, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
    }


def _llama_to_hf(cfg: ModelConfig) -> dict:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **cfg.rope_scaling.model_dump()}
    # Both rope forms: rope_parameters for transformers 5, rope_theta + rope_scaling for older readers.
    old_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling is not None else None
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": old_scaling, "rope_parameters": rope,
        "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias,
    }
