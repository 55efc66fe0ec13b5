"""Qwen3 (Qwen3ForCausalLM): a Llama with a head_dim of its own (128 in every published size,
whatever hidden_size / heads is) and an RMSNorm over each head's q and k (`q_norm`, `k_norm`,
weights of head_dim) after the projection and before RoPE; biases on all four attention
projections or none (`attention_bias`)."""

from __future__ import annotations

from typing import Optional

from . import llama
from .family import Family, Getter

HF_KEYS = dict(llama.HF_KEYS, sliding_window="sliding_window", sliding_layers="layer_types")
DEFAULTS = {"vocab_size": 151936, "max_position_embeddings": 32768, "intermediate_size": 22016,
            "num_key_value_heads": 32}
ARCH = "Qwen3ForCausalLM"


def read_config(hf: dict, get: Getter) -> dict:
    fields = llama.read_config(hf, get, "qwen3", DEFAULTS)
    return {**fields, "head_dim": get("head_dim", 128, int), "qk_norm": "head", "mlp_bias": False,
            **llama.read_windows(hf, get, fields["n_layer"])}


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    if cfg.qk_norm != "head":
        return "qk_norm", f"{ARCH} norms q and k over each head (qk_norm='head'), got {cfg.qk_norm!r}"
    if cfg.mlp_bias:
        return "mlp_bias", f"{ARCH} has no MLP biases"
    return llama.cannot_express(cfg, ARCH, expresses=("qk_norm", "sliding_window", "sliding_layers"))


def write_config(cfg) -> dict:
    common = {k: v for k, v in llama.write_common(cfg).items() if k != "mlp_bias"}
    return {"architectures": [ARCH], "model_type": "qwen3", **common,
            "hidden_act": llama.FAMILY.activation_name(cfg.mlp), **llama.write_windows(cfg),
            "max_window_layers": cfg.n_layer, "tie_word_embeddings": cfg.tied_embeddings}


def read_gguf(key, f) -> dict:
    return {**llama.read_gguf(key, f, "qwen3"), "qk_norm": "head"}


def write_gguf(cfg) -> dict:
    # llama.cpp's qwen3 reads key_length always (its head_dim is no function of the width)
    return {**llama.write_gguf(cfg), "attention.key_length": (cfg.head_dim, "UINT32"),
            "attention.value_length": (cfg.head_dim, "UINT32")}


NAMES = llama.NAMES  # q_norm, k_norm: self_attn.q_norm, self_attn.k_norm (TensorNames' defaults)

# As Qwen2's: llama.cpp rotates halves of each head (NEOX), no permutation of q and k.
FAMILY = Family(
    name="qwen3", model_types=("qwen3",), architectures=(ARCH, "Qwen3Model"), saves_as=ARCH, names=NAMES,
    activations=llama.ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config, write_config=write_config,
    cannot_express=cannot_express, gguf_arch="qwen3", read_gguf=read_gguf, write_gguf=write_gguf,
)
