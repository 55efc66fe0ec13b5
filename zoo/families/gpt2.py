"""GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm with biases, the tanh GELU MLP, biases
on every linear layer, Conv1D weights stored (in, out), a tied head by default."""

from __future__ import annotations

from typing import Optional

from .family import Family, Getter, TensorNames, unexpressed

NAMES = TensorNames(
    embedding="transformer.wte", positions="transformer.wpe", layer="transformer.h.{i}.",
    norm1="ln_1", norm2="ln_2", qkv=("attn.c_attn",), attn_out="attn.c_proj",
    mlp_in_gated=("mlp.c_fc",), mlp_in="mlp.c_fc", mlp_out="mlp.c_proj",
    final_norm="transformer.ln_f", head="lm_head", transposed=True, base_prefix="transformer.",
    buffers=(".attn.bias", ".attn.masked_bias"),  # the causal mask some checkpoints carry
)

# GPT-2's GELU is the tanh approximation; transformers has two names for the same function.
ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}

HF_KEYS = {"vocab_size": "vocab_size", "max_seq_len": "n_positions", "d_model": "n_embd", "n_layer": "n_layer",
           "n_head": "n_head", "n_kv_head": "n_head", "head_dim": "n_head", "d_ff": "n_inner",
           "norm_eps": "layer_norm_epsilon", "tied_embeddings": "tie_word_embeddings"}


def read_config(hf: dict, get: Getter) -> dict:
    # Variants of GPT-2 attention that zoo's blocks do not compute.
    get.require("scale_attn_weights", True, bool)
    get.require("scale_attn_by_inverse_layer_idx", False, bool)
    get.require("add_cross_attention", False, bool)
    mlp = get.activation("activation_function", "gelu_new", ACTIVATIONS)
    d_model = get("n_embd", 768, int)
    n_inner = get("n_inner", None, int)
    return dict(
        family="gpt2", vocab_size=get("vocab_size", 50257, int), max_seq_len=get("n_positions", 1024, int),
        d_model=d_model, n_layer=get("n_layer", 12, int), n_head=get("n_head", 12, int),
        d_ff=n_inner if n_inner is not None else 4 * d_model,
        norm="layernorm", norm_eps=get("layer_norm_epsilon", 1e-5, float), mlp=mlp, positions="learned",
        attention_bias=True, mlp_bias=True, tied_embeddings=get("tie_word_embeddings", True, bool),
    )


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    arch = "GPT2LMHeadModel"
    if cfg.head_dim * cfg.n_head != cfg.d_model:
        return "head_dim", f"{arch} needs head_dim * n_head == d_model, got {cfg.head_dim} * {cfg.n_head}"
    for field, expected in (("layer", "sequential"), ("norm", "layernorm"), ("mlp", "gelu"), ("positions", "learned"),
                            ("attention_bias", True), ("mlp_bias", True), ("n_kv_head", cfg.n_head)):
        if getattr(cfg, field) != expected:
            return field, f"{arch} cannot express {field}={getattr(cfg, field)!r} (it has {expected!r})"
    return unexpressed(cfg, arch)


def write_config(cfg) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
        "n_inner": cfg.d_ff, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
    }


def read_gguf(key, f) -> dict:
    return dict(family="gpt2", norm="layernorm", norm_eps=key("attention.layer_norm_epsilon", float), mlp="gelu",
                positions="learned", attention_bias=True, mlp_bias=True)


def write_gguf(cfg) -> dict:
    # vocab_size: what llama.cpp sizes a file without a vocabulary by
    return {"attention.layer_norm_epsilon": (cfg.norm_eps, "FLOAT32"), "vocab_size": (cfg.vocab_size, "UINT32")}


FAMILY = Family(
    name="gpt2", model_types=("gpt2",), architectures=("GPT2LMHeadModel", "GPT2Model"), saves_as="GPT2LMHeadModel",
    names=NAMES, activations=ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config, write_config=write_config,
    cannot_express=cannot_express, gguf_arch="gpt2", read_gguf=read_gguf, write_gguf=write_gguf,
    gguf_writes_tied_head=True,
    notes=("scale_attn_weights false, scale_attn_by_inverse_layer_idx and cross-attention are refused: zoo's "
           "attention block does not compute them",),
)
