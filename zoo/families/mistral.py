"""Mistral (MistralForCausalLM): Llama's computation with Mistral's defaults (8 key-value heads,
d_ff 14336, a 128K context), no biases anywhere, and a sliding attention window on every layer
(`sliding_window` W: a token attends to the W keys ending at itself; null in v0.3), which zoo
computes as a banded mask in training and in the cached attention of generation."""

from __future__ import annotations

from typing import Optional

from . import llama
from .family import Family, Getter

HF_KEYS = {k: v for k, v in llama.HF_KEYS.items() if k not in ("attention_bias", "mlp_bias")}
HF_KEYS["sliding_window"] = "sliding_window"
DEFAULTS = {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "intermediate_size": 14336}


def read_config(hf: dict, get: Getter) -> dict:
    fields = llama.read_config(hf, get, "mistral", DEFAULTS)
    # A missing key is MistralConfig's default window; null (v0.3) is none.
    window = get("sliding_window", 4096, int) if "sliding_window" in hf and hf["sliding_window"] is not None else (
        None if "sliding_window" in hf else 4096)
    return {**fields, "attention_bias": False, "mlp_bias": False,
            **({"sliding_window": window} if window is not None else {})}


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    arch = "MistralForCausalLM"
    for field in ("attention_bias", "mlp_bias"):
        if getattr(cfg, field):
            return field, f"{arch} has no biases ({field}=True)"
    if cfg.sliding_layers is not None:
        return "sliding_layers", f"{arch} slides its window on every layer, not on {list(cfg.sliding_layers)} only"
    return llama.cannot_express(cfg, arch, expresses=("sliding_window",))


def write_config(cfg) -> dict:
    common = {k: v for k, v in llama.write_common(cfg).items() if k not in ("attention_bias", "mlp_bias")}
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **common,
            "hidden_act": llama.FAMILY.activation_name(cfg.mlp), "sliding_window": cfg.sliding_window}


# llama.cpp keeps Mistral under its llama architecture: a GGUF of it reads back as a Llama (whose
# window llama.cpp does not apply; its converter writes none).
FAMILY = Family(
    name="mistral", model_types=("mistral",), architectures=("MistralForCausalLM", "MistralModel"),
    saves_as="MistralForCausalLM", names=llama.NAMES, activations=llama.ACTIVATIONS, hf_keys=HF_KEYS,
    read_config=read_config, write_config=write_config, cannot_express=cannot_express, gguf_arch="llama",
    read_gguf=llama.read_gguf, write_gguf=llama.write_gguf, gguf_rope_heads=llama.gguf_rope_heads,
    notes=("a GGUF file of a Mistral model reads back as a Llama without the window (llama.cpp keeps none)",),
)
