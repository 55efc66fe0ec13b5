"""Mistral (MistralForCausalLM): Llama's computation with Mistral's defaults (8 key-value heads,
d_ff 14336, a 128K context), no biases anywhere, and a sliding attention window.

The window: with `sliding_window` W, a token attends to the W keys ending at itself. On
sequences of at most W tokens that is plain causal attention, which is what zoo computes; so
a model with a window loads with its context capped at W (exact within it; Mistral 7B v0.1:
4,096), and one without (v0.3: null) keeps its whole context. It saves back with the context
it has and no window, which transformers computes the same way within that context."""

from __future__ import annotations

from typing import Optional

from . import llama
from .family import Family, Getter

HF_KEYS = {k: v for k, v in llama.HF_KEYS.items() if k not in ("attention_bias", "mlp_bias")}
HF_KEYS["max_seq_len"] = "max_position_embeddings"


def read_config(hf: dict, get: Getter) -> dict:
    theta, scaling = llama.read_rope(hf, get)
    context = get("max_position_embeddings", 4096 * 32, int)
    window = get("sliding_window", 4096, int)
    return dict(
        family="mistral", vocab_size=get("vocab_size", 32000, int), max_seq_len=min(context, window),
        d_model=get("hidden_size", 4096, int), n_layer=get("num_hidden_layers", 32, int),
        n_head=get("num_attention_heads", 32, int), n_kv_head=get("num_key_value_heads", 8, int),
        head_dim=get("head_dim", None, int), d_ff=get("intermediate_size", 14336, int),
        norm="rmsnorm", norm_eps=get("rms_norm_eps", 1e-6, float),
        mlp=get.activation("hidden_act", "silu", llama.ACTIVATIONS), positions="rope", rope_theta=theta,
        rope_scaling=scaling, attention_bias=False, mlp_bias=False,
        tied_embeddings=get("tie_word_embeddings", False, bool),
    )


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    for field in ("attention_bias", "mlp_bias"):
        if getattr(cfg, field):
            return field, f"MistralForCausalLM has no biases ({field}=True)"
    problem = llama.cannot_express(cfg)
    return (problem[0], problem[1].replace("LlamaForCausalLM", "MistralForCausalLM")) if problem else None


def write_config(cfg) -> dict:
    common = {k: v for k, v in llama.write_common(cfg).items() if k not in ("attention_bias", "mlp_bias")}
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **common,
            "hidden_act": llama.FAMILY.activation_name(cfg.mlp), "sliding_window": None}


# llama.cpp keeps Mistral under its llama architecture: a GGUF of it reads back as a Llama.
FAMILY = Family(
    name="mistral", model_types=("mistral",), architectures=("MistralForCausalLM", "MistralModel"),
    saves_as="MistralForCausalLM", names=llama.NAMES, activations=llama.ACTIVATIONS, hf_keys=HF_KEYS,
    read_config=read_config, write_config=write_config, cannot_express=cannot_express, gguf_arch="llama",
    read_gguf=llama.read_gguf, write_gguf=llama.write_gguf, gguf_rope_heads=llama.gguf_rope_heads,
    notes=("a sliding window caps the context at its width (exact within it); the banded attention that "
           "would compute longer sequences is not built yet",),
)
