"""OLMo-2 (Olmo2ForCausalLM): a Llama with no norm before attention or the MLP: an RMSNorm on
each branch's output before its residual add (`post_attention_layernorm`,
`post_feedforward_layernorm`), and an RMSNorm over the whole q and k projections (weights of
n_head x head_dim and n_kv_head x head_dim), not per head, before RoPE."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from . import llama
from .family import Family, Getter

NAMES = replace(llama.NAMES, norm1="", norm2="", post_norm1="post_attention_layernorm",
                post_norm2="post_feedforward_layernorm")
HF_KEYS = {k: v for k, v in llama.HF_KEYS.items() if k not in ("mlp_bias", "head_dim")}
DEFAULTS = {"vocab_size": 50304, "rms_norm_eps": 1e-5}
ARCH = "Olmo2ForCausalLM"


def read_config(hf: dict, get: Getter) -> dict:
    fields = llama.read_config(hf, get, "olmo2", DEFAULTS)
    return {**fields, "mlp_bias": False, "qk_norm": "projection", "branch_norms": "post"}


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    for field, expected in (("qk_norm", "projection"), ("branch_norms", "post"), ("mlp_bias", False),
                            ("head_dim", cfg.d_model // cfg.n_head)):
        if getattr(cfg, field) != expected:
            return field, f"{ARCH} cannot express {field}={getattr(cfg, field)!r} (it has {expected!r})"
    return llama.cannot_express(cfg, ARCH, expresses=("qk_norm", "branch_norms"))


def write_config(cfg) -> dict:
    common = {k: v for k, v in llama.write_common(cfg).items() if k not in ("mlp_bias", "head_dim")}
    return {"architectures": [ARCH], "model_type": "olmo2", **common,
            "hidden_act": llama.FAMILY.activation_name(cfg.mlp), "tie_word_embeddings": cfg.tied_embeddings}


def read_gguf(key, f) -> dict:
    return {**llama.read_gguf(key, f, "olmo2"), "qk_norm": "projection", "branch_norms": "post"}


# llama.cpp rotates halves of each head for OLMo-2 (NEOX): q and k unpermuted.
FAMILY = Family(
    name="olmo2", model_types=("olmo2",), architectures=(ARCH, "Olmo2Model"), saves_as=ARCH, names=NAMES,
    activations=llama.ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config, write_config=write_config,
    cannot_express=cannot_express, gguf_arch="olmo2", read_gguf=read_gguf, write_gguf=llama.write_gguf,
)
