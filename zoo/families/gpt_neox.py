"""GPT-NeoX and Pythia (GPTNeoXForCausalLM): LayerNorm with biases, linear layers with biases, the
exact GELU (`hidden_act` "gelu"), an untied `embed_out`, partial rotary (`rotary_pct`, or
`partial_rotary_factor`: 0.25 in Pythia; base `rotary_emb_base`), and the parallel residual
(`use_parallel_residual`: x + attn(ln1 x) + mlp(ln2 x), the parallel_two_norms layer; the
sequential one without it). Its fused `query_key_value` holds each head's q, k and v rows
together, head after head; zoo keeps q | k | v, so those rows (and a PEFT adapter's lora_B for
the module) are reordered on load and on save."""

from __future__ import annotations

from typing import Optional

import numpy as np

from . import llama
from .family import Family, Getter, TensorNames, unexpressed

NAMES = TensorNames(
    embedding="gpt_neox.embed_in", positions="gpt_neox.embed_positions", layer="gpt_neox.layers.{i}.",
    norm1="input_layernorm", norm2="post_attention_layernorm", qkv=("attention.query_key_value",),
    attn_out="attention.dense", mlp_in_gated=("mlp.dense_h_to_4h",), mlp_in="mlp.dense_h_to_4h",
    mlp_out="mlp.dense_4h_to_h", final_norm="gpt_neox.final_layer_norm", head="embed_out", transposed=False,
    base_prefix="gpt_neox.", buffers=(".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq"),
)
# GPTNeoXMLP: dense_4h_to_h(act(dense_h_to_4h(x))).
ACTIVATIONS = {"gelu": "gelu_erf", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
HF_KEYS = {"vocab_size": "vocab_size", "max_seq_len": "max_position_embeddings", "d_model": "hidden_size",
           "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "d_ff": "intermediate_size",
           "norm_eps": "layer_norm_eps", "rope_theta": "rotary_emb_base", "rotary_dim": "rotary_pct",
           "layer": "use_parallel_residual", "attention_bias": "attention_bias", "tied_embeddings": "tie_word_embeddings"}
ARCH = "GPTNeoXForCausalLM"


def read_config(hf: dict, get: Getter) -> dict:
    theta, scaling = llama.read_rope({**hf, "rope_theta": hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0))},
                                     get, allow_partial=True)
    d_model, n_head = get("hidden_size", 6144, int), get("num_attention_heads", 64, int)
    head_dim = d_model // n_head if n_head else None
    bias = get("attention_bias", True, bool)
    return dict(
        family="gpt_neox", vocab_size=get("vocab_size", 50432, int),
        max_seq_len=get("max_position_embeddings", 2048, int), d_model=d_model,
        n_layer=get("num_hidden_layers", 44, int), n_head=n_head, d_ff=get("intermediate_size", 24576, int),
        norm="layernorm", norm_eps=get("layer_norm_eps", 1e-5, float),
        mlp=get.activation("hidden_act", "gelu", ACTIVATIONS), positions="rope", rope_theta=theta,
        rope_scaling=scaling, rotary_dim=llama.rotary_dim_of(hf, head_dim, 0.25, "rotary_pct") if head_dim else None,
        layer="parallel_two_norms" if get("use_parallel_residual", True, bool) else "sequential",
        attention_bias=bias, mlp_bias=True, tied_embeddings=get("tie_word_embeddings", False, bool),
    )


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    if cfg.head_dim * cfg.n_head != cfg.d_model:
        return "head_dim", f"{ARCH} needs head_dim * n_head == d_model, got {cfg.head_dim} * {cfg.n_head}"
    for field, expected in (("norm", "layernorm"), ("positions", "rope"), ("mlp_bias", True),
                            ("n_kv_head", cfg.n_head), ("rope_scaling", None)):
        if getattr(cfg, field) != expected:
            return field, f"{ARCH} cannot express {field}={getattr(cfg, field)!r} (it has {expected!r})"
    if cfg.layer not in ("parallel_two_norms", "sequential"):
        return "layer", f"{ARCH} cannot express layer={cfg.layer!r} (it has 'parallel_two_norms' or 'sequential')"
    if cfg.mlp not in ACTIVATIONS.values():
        return "mlp", f"{ARCH} cannot express mlp={cfg.mlp!r} (it has {', '.join(sorted(set(ACTIVATIONS.values())))})"
    return unexpressed(cfg, ARCH, expresses=("rotary_dim",))


def write_config(cfg) -> dict:
    rotary = (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim
    return {"architectures": [ARCH], "model_type": "gpt_neox", "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_seq_len, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "intermediate_size": cfg.d_ff, "layer_norm_eps": cfg.norm_eps,
            "hidden_act": next(hf for hf, block in ACTIVATIONS.items() if block == cfg.mlp),
            "rotary_emb_base": cfg.rope_theta, "rotary_pct": rotary,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": rotary},
            "use_parallel_residual": cfg.layer == "parallel_two_norms", "attention_bias": cfg.attention_bias}


def row_order(cfg, name: str) -> Optional[np.ndarray]:
    """query_key_value's rows, stored (head, q|k|v, head_dim), in zoo's (q|k|v, head, head_dim)."""
    if not name.endswith(".attention.query_key_value.weight") and not name.endswith(".attention.query_key_value.bias"):
        return None
    return np.arange(3 * cfg.n_head * cfg.head_dim).reshape(cfg.n_head, 3, cfg.head_dim).transpose(1, 0, 2).reshape(-1)


def read_gguf(key, f) -> dict:
    n_head, d_model = key("attention.head_count", int), key("embedding_length", int)
    rotary = key("rope.dimension_count", int, d_model // n_head)
    return dict(family="gpt_neox", norm="layernorm", norm_eps=key("attention.layer_norm_epsilon", float),
                mlp="gelu_erf", positions="rope", rope_theta=key("rope.freq_base", float, 10000.0),
                rotary_dim=None if rotary == d_model // n_head else rotary,
                layer="parallel_two_norms" if key("use_parallel_residual", bool, True) else "sequential",
                attention_bias="blk.0.attn_qkv.bias" in f.tensors, mlp_bias=True)


def write_gguf(cfg) -> dict:
    return {"attention.layer_norm_epsilon": (cfg.norm_eps, "FLOAT32"), "rope.freq_base": (cfg.rope_theta, "FLOAT32"),
            "rope.dimension_count": (cfg.rotary_dim or cfg.head_dim, "UINT32"),
            "use_parallel_residual": (cfg.layer == "parallel_two_norms", "BOOL"), "vocab_size": (cfg.vocab_size, "UINT32")}


# llama.cpp's converter writes query_key_value as q | k | v (zoo's order: no reordering in GGUF)
# and rotates halves of the rotated part of each head (NEOX): nothing permuted.
FAMILY = Family(
    name="gpt_neox", model_types=("gpt_neox",), architectures=(ARCH, "GPTNeoXModel"), saves_as=ARCH, names=NAMES,
    activations=ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config, write_config=write_config,
    cannot_express=cannot_express, gguf_arch="gptneox", read_gguf=read_gguf, write_gguf=write_gguf,
    row_order=row_order,
)
