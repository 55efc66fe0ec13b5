"""Phi-3 (Phi3ForCausalLM): a Llama whose checkpoints fuse q, k and v into one `qkv_proj` (rows
q | k | v) and gate and up into one `gate_up_proj` (rows gate | up), which is how zoo lays them
out anyway; a `partial_rotary_factor` (1 in Phi-3 itself); a `sliding_window` on every layer
(2047 in the 4K models). The long-context models' "longrope" scaling (short and long factors,
switched by sequence length) is refused, naming the key."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from . import llama
from .family import Family, Getter

NAMES = replace(llama.NAMES, qkv=("self_attn.qkv_proj",), mlp_in_gated=("mlp.gate_up_proj",))
HF_KEYS = {k: v for k, v in llama.HF_KEYS.items() if k not in ("attention_bias", "mlp_bias", "head_dim")}
HF_KEYS.update(sliding_window="sliding_window", rotary_dim="partial_rotary_factor")
DEFAULTS = {"vocab_size": 32064, "max_position_embeddings": 4096, "hidden_size": 3072, "intermediate_size": 8192,
            "rms_norm_eps": 1e-5}
ARCH = "Phi3ForCausalLM"


def read_config(hf: dict, get: Getter) -> dict:
    fields = llama.read_config({k: v for k, v in hf.items() if k != "head_dim"}, get, "phi3", DEFAULTS,
                               allow_partial=True)
    head_dim = fields["d_model"] // fields["n_head"]
    window = get("sliding_window", None, int)
    return {**fields, "attention_bias": False, "mlp_bias": False,
            "rotary_dim": llama.rotary_dim_of(hf, head_dim), **({"sliding_window": window} if window else {})}


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    for field, expected in (("attention_bias", False), ("mlp_bias", False), ("head_dim", cfg.d_model // cfg.n_head)):
        if getattr(cfg, field) != expected:
            return field, f"{ARCH} cannot express {field}={getattr(cfg, field)!r} (it has {expected!r})"
    if cfg.sliding_layers is not None:
        return "sliding_layers", f"{ARCH} slides its window on every layer, not on {list(cfg.sliding_layers)} only"
    return llama.cannot_express(cfg, ARCH, expresses=("sliding_window", "rotary_dim"))


def write_config(cfg) -> dict:
    common = {k: v for k, v in llama.write_common(cfg).items() if k not in ("attention_bias", "mlp_bias", "head_dim")}
    return {"architectures": [ARCH], "model_type": "phi3", **common, "hidden_act": llama.FAMILY.activation_name(cfg.mlp),
            "sliding_window": cfg.sliding_window, "original_max_position_embeddings": cfg.max_seq_len,
            "tie_word_embeddings": cfg.tied_embeddings}


def read_gguf(key, f) -> dict:
    window = key("attention.sliding_window", int, None)
    return {**llama.read_gguf(key, f, "phi3"), **({"sliding_window": window} if window else {})}


def write_gguf(cfg) -> dict:
    keys = dict(llama.write_gguf(cfg))
    if cfg.sliding_window is not None:
        keys["attention.sliding_window"] = (cfg.sliding_window, "UINT32")
    return keys


# llama.cpp keeps Phi-3's fused tensors (attn_qkv, ffn_up holding gate | up) and rotates halves of
# each head (NEOX): nothing permuted.
FAMILY = Family(
    name="phi3", model_types=("phi3",), architectures=(ARCH, "Phi3Model"), saves_as=ARCH, names=NAMES,
    activations=llama.ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config, write_config=write_config,
    cannot_express=cannot_express, gguf_arch="phi3", read_gguf=read_gguf, write_gguf=write_gguf,
    notes=("the long-context models' longrope scaling is refused (rope_scaling.rope_type 'longrope')",),
)
