"""Llama (LlamaForCausalLM): RoPE with optional Llama 3 frequency scaling, RMSNorm, a gated MLP
(SiLU: SwiGLU; the tanh GELU: GeGLU), grouped-query attention, head_dim free of d_model / n_head,
optional biases on the attention and MLP projections, an untied head by default."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import ValidationError

from ..core.errors import CheckpointError
from ..core.files import show_value
from ..core.rope import RopeScaling
from .family import Family, Getter, TensorNames, unexpressed

NAMES = TensorNames(
    embedding="model.embed_tokens", positions="model.embed_positions", layer="model.layers.{i}.",
    norm1="input_layernorm", norm2="post_attention_layernorm",
    qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), attn_out="self_attn.o_proj",
    mlp_in_gated=("mlp.gate_proj", "mlp.up_proj"), mlp_in="mlp.up_proj", mlp_out="mlp.down_proj",
    final_norm="model.norm", head="lm_head", transposed=False, base_prefix="model.",
    buffers=(".rotary_emb.inv_freq",),
)

# LlamaMLP computes down(act(gate(x)) * up(x)): SiLU makes it SwiGLU, the tanh GELU GeGLU.
ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu", "gelu_python_tanh": "geglu"}

HF_KEYS = {"vocab_size": "vocab_size", "max_seq_len": "max_position_embeddings", "d_model": "hidden_size",
           "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
           "head_dim": "head_dim", "d_ff": "intermediate_size", "norm_eps": "rms_norm_eps",
           "rope_theta": "rope_theta", "rope_scaling": "rope_scaling", "attention_bias": "attention_bias",
           "mlp_bias": "mlp_bias", "tied_embeddings": "tie_word_embeddings"}


# LlamaConfig's defaults, for keys a config.json leaves out; the families derived from Llama
# pass their own config class's where they differ.
DEFAULTS = {"vocab_size": 32000, "max_position_embeddings": 2048, "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": None, "intermediate_size": 11008,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False}


def read_config(hf: dict, get: Getter, family: str = "llama", defaults: Optional[dict] = None,
                allow_partial: bool = False, activations: Optional[dict] = None, act_key: str = "hidden_act") -> dict:
    """The ModelConfig fields of a LlamaConfig-shaped config.json (the families derived from
    Llama start from these and set what differs: their defaults, their activations and the key
    naming it; allow_partial: read_rope's)."""
    d = {**DEFAULTS, **(defaults or {})}
    theta, scaling = read_rope(hf, get, allow_partial)
    return dict(
        family=family, vocab_size=get("vocab_size", d["vocab_size"], int),
        max_seq_len=get("max_position_embeddings", d["max_position_embeddings"], int),
        d_model=get("hidden_size", d["hidden_size"], int), n_layer=get("num_hidden_layers", d["num_hidden_layers"], int),
        n_head=get("num_attention_heads", d["num_attention_heads"], int),
        n_kv_head=get("num_key_value_heads", d["num_key_value_heads"], int), head_dim=get("head_dim", None, int),
        d_ff=get("intermediate_size", d["intermediate_size"], int), norm="rmsnorm",
        norm_eps=get("rms_norm_eps", d["rms_norm_eps"], float),
        mlp=get.activation(act_key, d["hidden_act"], ACTIVATIONS if activations is None else activations),
        positions="rope", rope_theta=theta,
        rope_scaling=scaling, attention_bias=get("attention_bias", d["attention_bias"], bool),
        mlp_bias=get("mlp_bias", d["mlp_bias"], bool),
        tied_embeddings=get("tie_word_embeddings", d["tie_word_embeddings"], bool),
    )


def read_windows(hf: dict, get: Getter, n_layer: int) -> dict:
    """sliding_window and sliding_layers from the keys transformers uses: `layer_types` (a
    "sliding_attention" or "full_attention" per layer) where given, else Qwen's
    `use_sliding_window` and `max_window_layers` (the layers from it on slide); a window that is
    null, or off by use_sliding_window, is none."""
    window = get("sliding_window", None, int)
    if "use_sliding_window" in hf and not get("use_sliding_window", False, bool):
        window = None
    if window is None:
        return {}
    types = hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layer or any(
                t not in ("sliding_attention", "full_attention") for t in types):
            raise CheckpointError(get.source, f"expected {n_layer} entries of 'sliding_attention' or "
                                              f"'full_attention', got {show_value(types)}", key="layer_types")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif "max_window_layers" in hf:
        layers = tuple(range(min(get("max_window_layers", 0, int), n_layer), n_layer))
    else:
        layers = tuple(range(n_layer))
    if not layers:
        return {}
    return dict(sliding_window=window, sliding_layers=None if len(layers) == n_layer else layers)


def write_windows(cfg) -> dict:
    """The keys of read_windows for cfg: the window and each layer's type."""
    sliding = set(range(cfg.n_layer) if cfg.sliding_layers is None else cfg.sliding_layers)
    on = cfg.sliding_window is not None
    return {"use_sliding_window": on, "sliding_window": cfg.sliding_window,
            "layer_types": ["sliding_attention" if on and i in sliding else "full_attention" for i in range(cfg.n_layer)]}


def read_rope(hf: dict, get: Getter, allow_partial: bool = False) -> tuple[float, Optional[RopeScaling]]:
    """rope_theta and its scaling (llama3, linear), from the newer rope_parameters or the older
    rope_theta + rope_scaling (transformers lets rope_scaling win when both are present). A
    partial_rotary_factor is refused unless the caller reads it (allow_partial; rotary_dim_of)."""
    source = get.source
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
    partial = 1.0 if partial is None else partial
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
        raise CheckpointError(source, f"expected a number in (0, 1], got {show_value(partial)}", key=partial_key)
    if partial != 1.0 and not allow_partial:
        raise CheckpointError(source, f"value {show_value(partial)} is not supported (zoo rotates the whole head)",
                              key=partial_key)
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        factor = params.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise CheckpointError(source, f"linear rope scaling needs a positive factor, got {show_value(factor)}",
                                  key=f"{key}.factor")
        return float(theta), RopeScaling(rope_type="linear", factor=float(factor))
    if rope_type != "llama3":
        raise CheckpointError(source, f"unsupported rope type {show_value(rope_type)} (zoo computes 'default', "
                                      "'linear' and 'llama3')", key=f"{key}.rope_type")
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


def rotary_dim_of(hf: dict, head_dim: int, default: float = 1.0, old_key: str = "partial_rotary_factor") -> Optional[int]:
    """The rotated values of a head from partial_rotary_factor (in rope_parameters, or the
    config's own key, or old_key: GPT-NeoX's rotary_pct), as transformers rounds it down; None
    for the whole head."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get(old_key, default)))
    factor = default if factor is None else factor
    rotary = int(head_dim * factor)
    return None if rotary == head_dim else rotary


def cannot_express(cfg, arch: str = "LlamaForCausalLM", expresses: tuple[str, ...] = (),
                   norm: str = "rmsnorm", activations: Optional[dict] = None) -> Optional[tuple[str, str]]:
    """What a LlamaConfig-shaped class cannot hold of cfg (the families derived from Llama name
    their class, the variant options it holds, its norm and its activations)."""
    activations = ACTIVATIONS if activations is None else activations
    if cfg.d_model % cfg.n_head != 0:  # transformers' LlamaConfig rejects this even with an explicit head_dim
        return "n_head", f"{arch} needs d_model divisible by n_head, got {cfg.d_model} and {cfg.n_head}"
    if cfg.mlp not in activations.values():
        return "mlp", f"{arch} cannot express mlp={cfg.mlp!r} (it has {', '.join(sorted(set(activations.values())))})"
    for field, expected in (("layer", "sequential"), ("norm", norm), ("positions", "rope")):
        if getattr(cfg, field) != expected:
            return field, f"{arch} cannot express {field}={getattr(cfg, field)!r} (it has {expected!r})"
    return unexpressed(cfg, arch, expresses)


def write_config(cfg) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **write_common(cfg),
            "hidden_act": FAMILY.activation_name(cfg.mlp)}


def write_common(cfg) -> dict[str, Any]:
    """The keys LlamaConfig and the configs derived from it share."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {"rope_theta": cfg.rope_theta, **cfg.rope_scaling.model_dump(exclude_none=True)}
    if cfg.rotary_dim is not None:
        rope["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    # Both rope forms: rope_parameters for transformers 5, rope_theta + rope_scaling for older readers.
    old_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling is not None else None
    return {
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": old_scaling, "rope_parameters": rope,
        "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias,
    }


def read_gguf(key, f, family: str = "llama") -> dict:
    d_model, n_head = key("embedding_length", int), key("attention.head_count", int)
    head_dim = key("attention.key_length", int, d_model // n_head if n_head and d_model % n_head == 0 else None)
    arch = f.value("general.architecture", str)
    if head_dim is None:
        raise CheckpointError(f.path, f"required when embedding_length {d_model} is not a multiple of "
                                      f"head_count {n_head}", key=f"{arch}.attention.key_length")
    if key("attention.value_length", int, head_dim) != head_dim:
        raise CheckpointError(f.path, f"{key('attention.value_length', int)} differs from the head size {head_dim}: "
                                      "zoo's heads use one size for keys and values", key=f"{arch}.attention.value_length")
    rotary = key("rope.dimension_count", int, head_dim)
    if rotary > head_dim or rotary % 2 or rotary <= 0:
        raise CheckpointError(f.path, f"{rotary} rotated values of a head of {head_dim}: zoo rotates an even number "
                              "up to the head size", key=f"{arch}.rope.dimension_count")
    scaling_type, scaling = key("rope.scaling.type", str, "none"), None
    if scaling_type == "linear":
        scaling = RopeScaling(rope_type="linear", factor=key("rope.scaling.factor", float))
    elif scaling_type != "none":
        raise CheckpointError(f.path, f"rope scaling {scaling_type!r} is not supported (zoo computes linear and "
                                      "Llama 3's, which GGUF stores as rope_freqs.weight)", key=f"{arch}.rope.scaling.type")
    if key("rope.scale_linear", float, 1.0) != 1.0:
        raise CheckpointError(f.path, "linear rope scaling is not supported", key=f"{arch}.rope.scale_linear")
    return dict(family=family, n_kv_head=key("attention.head_count_kv", int, n_head), head_dim=head_dim,
                rotary_dim=None if rotary == head_dim else rotary, **({"rope_scaling": scaling} if scaling else {}),
                norm="rmsnorm", norm_eps=key("attention.layer_norm_rms_epsilon", float), mlp="swiglu",
                positions="rope", rope_theta=key("rope.freq_base", float, 10000.0),
                attention_bias="blk.0.attn_q.bias" in f.tensors,
                attention_out_bias="blk.0.attn_output.bias" in f.tensors, mlp_bias="blk.0.ffn_up.bias" in f.tensors)


def write_gguf(cfg) -> dict:
    keys = {"attention.head_count_kv": (cfg.n_kv_head, "UINT32"),
            "attention.layer_norm_rms_epsilon": (cfg.norm_eps, "FLOAT32"),
            "rope.freq_base": (cfg.rope_theta, "FLOAT32"), "rope.dimension_count": (cfg.rotary_dim or cfg.head_dim, "UINT32"),
            "vocab_size": (cfg.vocab_size, "UINT32")}
    if cfg.head_dim * cfg.n_head != cfg.d_model:
        keys["attention.key_length"] = (cfg.head_dim, "UINT32")
        keys["attention.value_length"] = (cfg.head_dim, "UINT32")
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "linear":  # (llama3's: rope_freqs.weight)
        keys["rope.scaling.type"] = ("linear", "STRING")
        keys["rope.scaling.factor"] = (cfg.rope_scaling.factor, "FLOAT32")
    return keys


def gguf_rope_heads(cfg, tensor: str) -> Optional[int]:
    """llama.cpp rotates adjacent pairs of a head, Hugging Face pairs values half a head apart: its
    converter reorders the rows of q and k (weights and biases) within each head."""
    if ".self_attn.q_proj." in tensor:
        return cfg.n_head
    if ".self_attn.k_proj." in tensor:
        return cfg.n_kv_head
    return None


FAMILY = Family(
    name="llama", model_types=("llama",), architectures=("LlamaForCausalLM", "LlamaModel"),
    saves_as="LlamaForCausalLM", names=NAMES, activations=ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config,
    write_config=write_config, cannot_express=cannot_express, gguf_arch="llama", read_gguf=read_gguf,
    write_gguf=write_gguf, gguf_rope_heads=gguf_rope_heads,
    notes=("rope types other than default and llama3, and partial rotary factors, are refused",),
)
