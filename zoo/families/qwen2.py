"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): a Llama whose q, k and v projections carry biases and
whose o_proj does not, with a large byte-level vocabulary (151,936) and the ChatML template.
Its sliding-window fields (`use_sliding_window`, `sliding_window`, `max_window_layers`, or
`layer_types`) are off in the published models; zoo reads and writes them as they are."""

from __future__ import annotations

from typing import Optional

from . import llama
from .family import Family, Getter

HF_KEYS = {k: v for k, v in llama.HF_KEYS.items() if k not in ("attention_bias", "mlp_bias", "head_dim")}
HF_KEYS.update(sliding_window="sliding_window", sliding_layers="layer_types")
DEFAULTS = {"vocab_size": 151936, "max_position_embeddings": 32768, "intermediate_size": 22016,
            "num_key_value_heads": 32}
ARCH = "Qwen2ForCausalLM"


def read_config(hf: dict, get: Getter) -> dict:
    fields = llama.read_config(hf, get, "qwen2", DEFAULTS)
    return {**fields, "attention_bias": True, "attention_out_bias": False, "mlp_bias": False,
            **llama.read_windows(hf, get, fields["n_layer"])}


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    for field, expected in (("attention_bias", True), ("attention_out_bias", False), ("mlp_bias", False),
                            ("head_dim", cfg.d_model // cfg.n_head)):
        if getattr(cfg, field) != expected:
            return field, f"{ARCH} cannot express {field}={getattr(cfg, field)!r} (it has {expected!r})"
    return llama.cannot_express(cfg, ARCH, expresses=("attention_out_bias", "sliding_window", "sliding_layers"))


def write_config(cfg) -> dict:
    common = {k: v for k, v in llama.write_common(cfg).items() if k not in ("attention_bias", "mlp_bias", "head_dim")}
    return {"architectures": [ARCH], "model_type": "qwen2", **common,
            "hidden_act": llama.FAMILY.activation_name(cfg.mlp), **llama.write_windows(cfg),
            "max_window_layers": cfg.n_layer, "tie_word_embeddings": cfg.tied_embeddings}


def read_gguf(key, f) -> dict:
    return llama.read_gguf(key, f, "qwen2")


# llama.cpp rotates Qwen2's heads in halves (its NEOX rope type), as Hugging Face does: its
# converter writes q and k unpermuted.
FAMILY = Family(
    name="qwen2", model_types=("qwen2",), architectures=(ARCH, "Qwen2Model"), saves_as=ARCH, names=llama.NAMES,
    activations=llama.ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config, write_config=write_config,
    cannot_express=cannot_express, gguf_arch="qwen2", read_gguf=read_gguf, write_gguf=llama.write_gguf,
)
