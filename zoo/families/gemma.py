"""Gemma (GemmaForCausalLM): a Llama with Gemma's norm, RMSNorm scaling by (1 + w) with w stored
around 0 and computed in float32 (rmsnorm_1p); a GeGLU MLP (the tanh GELU, `hidden_act`
"gelu_pytorch_tanh", and the legacy "gelu" read as it, as transformers does); token embeddings
times sqrt(hidden_size) (in float32, zoo's compute type, as transformers computes it in float32);
a head_dim of its own (256); a tied LM head; a 256,000-token vocabulary."""

from __future__ import annotations

import math
from typing import Optional

from . import llama
from .family import Family, Getter

# GemmaMLP computes down(gelu_tanh(gate(x)) * up(x)).
ACTIVATIONS = {"gelu_pytorch_tanh": "geglu", "gelu": "geglu"}
HF_KEYS = dict(llama.HF_KEYS, mlp="hidden_act")
DEFAULTS = {"vocab_size": 256000, "max_position_embeddings": 8192, "hidden_size": 3072, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 24576,
            "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}
ARCH = "GemmaForCausalLM"


def read_common(hf: dict, get: Getter, family: str, defaults: dict, act_key: str) -> dict:
    """What every Gemma generation shares: the Llama keys, Gemma's norm, GeGLU from act_key, the
    embedding scale, head_dim."""
    fields = llama.read_config(hf, get, family, defaults, activations=ACTIVATIONS, act_key=act_key)
    return {**fields, "norm": "rmsnorm_1p", "head_dim": get("head_dim", 256, int),
            "embedding_scale": math.sqrt(fields["d_model"]), "mlp_bias": False}


def read_config(hf: dict, get: Getter) -> dict:
    return read_common(hf, get, "gemma", DEFAULTS, "hidden_act")


def embedding_problem(cfg, arch: str) -> Optional[tuple[str, str]]:
    if cfg.embedding_scale != math.sqrt(cfg.d_model):
        return "embedding_scale", f"{arch} scales its embeddings by sqrt(d_model), got {cfg.embedding_scale}"
    if cfg.mlp_bias:
        return "mlp_bias", f"{arch} has no MLP biases"
    return None


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    return embedding_problem(cfg, ARCH) or llama.cannot_express(cfg, ARCH, expresses=("embedding_scale",),
                                                                norm="rmsnorm_1p", activations=ACTIVATIONS)


def write_common(cfg) -> dict:
    return {k: v for k, v in llama.write_common(cfg).items() if k != "mlp_bias"}


def write_config(cfg) -> dict:
    return {"architectures": [ARCH], "model_type": "gemma", **write_common(cfg), "hidden_act": "gelu_pytorch_tanh",
            "tie_word_embeddings": cfg.tied_embeddings}


def read_gguf(key, f, family: str = "gemma") -> dict:
    fields = llama.read_gguf(key, f, family)
    return {**fields, "norm": "rmsnorm_1p", "mlp": "geglu", "embedding_scale": math.sqrt(key("embedding_length", int))}


# llama.cpp's converter stores Gemma's norm weights as 1 + w (zoo/io/gguf.py adds and takes the 1
# for rmsnorm_1p), and rotates halves of each head (NEOX): q and k unpermuted.
FAMILY = Family(
    name="gemma", model_types=("gemma",), architectures=(ARCH, "GemmaModel"), saves_as=ARCH, names=llama.NAMES,
    activations=ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config, write_config=write_config,
    cannot_express=cannot_express, gguf_arch="gemma", read_gguf=read_gguf, write_gguf=llama.write_gguf,
)
