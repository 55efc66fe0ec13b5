"""Granite (GraniteForCausalLM): a Llama with four scalars: token embeddings times
`embedding_multiplier`, each branch's output times `residual_multiplier` before its residual add,
`attention_multiplier` as the softmax's scale (in place of head_dim ** -0.5), and the logits
divided by `logits_scaling`."""

from __future__ import annotations

from typing import Optional

from . import llama
from .family import Family, Getter

HF_KEYS = dict(llama.HF_KEYS, embedding_scale="embedding_multiplier", residual_scale="residual_multiplier",
               attention_scale="attention_multiplier", logit_scale="logits_scaling")
ARCH = "GraniteForCausalLM"


def read_config(hf: dict, get: Getter) -> dict:
    return {**llama.read_config(hf, get, "granite"), "embedding_scale": get("embedding_multiplier", 1.0, float),
            "residual_scale": get("residual_multiplier", 1.0, float),
            "attention_scale": get("attention_multiplier", 1.0, float),
            "logit_scale": 1.0 / get("logits_scaling", 1.0, float)}


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    return llama.cannot_express(cfg, ARCH, expresses=("embedding_scale", "residual_scale", "attention_scale",
                                                      "logit_scale"))


def attention_scale(cfg) -> float:
    return cfg.attention_scale if cfg.attention_scale is not None else cfg.head_dim ** -0.5


def write_config(cfg) -> dict:
    return {"architectures": [ARCH], "model_type": "granite", **llama.write_common(cfg),
            "hidden_act": llama.FAMILY.activation_name(cfg.mlp), "tie_word_embeddings": cfg.tied_embeddings,
            "embedding_multiplier": cfg.embedding_scale, "residual_multiplier": cfg.residual_scale,
            "attention_multiplier": attention_scale(cfg), "logits_scaling": 1.0 / cfg.logit_scale}


def read_gguf(key, f) -> dict:
    return {**llama.read_gguf(key, f, "granite"), "embedding_scale": key("embedding_scale", float, 1.0),
            "residual_scale": key("residual_scale", float, 1.0), "attention_scale": key("attention.scale", float, 1.0),
            "logit_scale": 1.0 / key("logit_scale", float, 1.0)}


def write_gguf(cfg) -> dict:
    return {**llama.write_gguf(cfg), "embedding_scale": (cfg.embedding_scale, "FLOAT32"),
            "residual_scale": (cfg.residual_scale, "FLOAT32"), "attention.scale": (attention_scale(cfg), "FLOAT32"),
            "logit_scale": (1.0 / cfg.logit_scale, "FLOAT32")}


# llama.cpp's Granite converter is Llama's: q and k permuted as Llama's.
FAMILY = Family(
    name="granite", model_types=("granite",), architectures=(ARCH, "GraniteModel"), saves_as=ARCH,
    names=llama.NAMES, activations=llama.ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config,
    write_config=write_config, cannot_express=cannot_express, gguf_arch="granite", read_gguf=read_gguf,
    write_gguf=write_gguf, gguf_rope_heads=llama.gguf_rope_heads,
)
