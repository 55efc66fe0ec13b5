"""Gemma 2 (Gemma2ForCausalLM): Gemma, plus four norms per layer (before and after each branch:
`input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`,
`post_feedforward_layernorm`), the softmax scale query_pre_attn_scalar ** -0.5, tanh soft-capping
of the attention scores (`attn_logit_softcapping`, before the mask) and of the final logits
(`final_logit_softcapping`), and a sliding window on alternate layers (`layer_types`; the even
ones in the published models)."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from . import gemma, llama
from .family import Family, Getter

NAMES = replace(llama.NAMES, norm2="pre_feedforward_layernorm", post_norm1="post_attention_layernorm",
                post_norm2="post_feedforward_layernorm")
HF_KEYS = dict(gemma.HF_KEYS, mlp="hidden_activation", attention_scale="query_pre_attn_scalar",
               attention_softcap="attn_logit_softcapping", logit_softcap="final_logit_softcapping",
               sliding_window="sliding_window", sliding_layers="layer_types")
DEFAULTS = {**gemma.DEFAULTS, "hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8,
            "num_key_value_heads": 4, "intermediate_size": 9216}
ARCH = "Gemma2ForCausalLM"


def read_softcaps(get: Getter, attention: Optional[float], logits: Optional[float]) -> dict:
    return {"attention_softcap": get("attn_logit_softcapping", attention, float),
            "logit_softcap": get("final_logit_softcapping", logits, float)}


def read_second_generation(hf: dict, get: Getter, family: str, defaults: dict, pattern: int) -> dict:
    """What Gemma 2 and 3 share: Gemma's, the four norms, the softmax scale, the windows. A
    config.json without layer_types (the published ones) slides on every layer but each
    pattern-th, as the transformers config class derives them (Gemma 2: 2; Gemma 3: its
    sliding_window_pattern, 6)."""
    fields = gemma.read_common(hf, get, family, defaults, "hidden_activation")
    n_layer = fields["n_layer"]
    if hf.get("layer_types") is None:
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                    for i in range(n_layer)]}
    return {**fields, "branch_norms": "both", "attention_scale": get("query_pre_attn_scalar", 256, int) ** -0.5,
            **llama.read_windows({**hf, "sliding_window": hf.get("sliding_window", 4096)}, get, n_layer)}


def read_config(hf: dict, get: Getter) -> dict:
    return {**read_second_generation(hf, get, "gemma2", DEFAULTS, 2), **read_softcaps(get, 50.0, 30.0)}


def query_pre_attn_scalar(cfg) -> Optional[int]:
    """The integer s with s ** -0.5 == cfg's softmax scale (transformers' key is an int), if any."""
    scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.head_dim ** -0.5
    s = round(scale ** -2)
    return s if abs(s ** -0.5 - scale) <= 1e-6 * scale else None


def second_generation_problem(cfg, arch: str) -> Optional[tuple[str, str]]:
    if cfg.branch_norms != "both":
        return "branch_norms", f"{arch} norms both sides of each branch (branch_norms='both'), got {cfg.branch_norms!r}"
    if query_pre_attn_scalar(cfg) is None:
        return "attention_scale", f"{arch} scales scores by an integer's inverse square root, got {cfg.attention_scale}"
    return gemma.embedding_problem(cfg, arch)


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    return second_generation_problem(cfg, ARCH) or llama.cannot_express(
        cfg, ARCH, norm="rmsnorm_1p", activations=gemma.ACTIVATIONS,
        expresses=("embedding_scale", "branch_norms", "attention_scale", "attention_softcap", "logit_softcap",
                   "sliding_window", "sliding_layers"))


def write_second_generation(cfg) -> dict:
    return {**gemma.write_common(cfg), "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": query_pre_attn_scalar(cfg), **llama.write_windows(cfg),
            "sliding_window": cfg.sliding_window, "tie_word_embeddings": cfg.tied_embeddings,
            "attn_logit_softcapping": cfg.attention_softcap, "final_logit_softcapping": cfg.logit_softcap}


def write_config(cfg) -> dict:
    return {"architectures": [ARCH], "model_type": "gemma2", **write_second_generation(cfg)}


def gguf_attention_scale(cfg_or_fields) -> float:
    """The softmax scale llama.cpp's gemma2 and gemma3 compute, which GGUF has no key for: the 27B
    models' (46 and 62 layers) is (d_model / n_head) ** -0.5, the others' head_dim ** -0.5."""
    get = (lambda k: cfg_or_fields[k]) if isinstance(cfg_or_fields, dict) else (lambda k: getattr(cfg_or_fields, k))
    if get("n_layer") in (46, 62):
        return (get("d_model") / get("n_head")) ** -0.5
    return get("head_dim") ** -0.5


def check_gguf_attention_scale(cfg) -> None:
    scale = cfg.attention_scale if cfg.attention_scale is not None else cfg.head_dim ** -0.5
    if abs(scale - gguf_attention_scale(cfg)) > 1e-6 * scale:
        raise ValueError(f"attention_scale: llama.cpp's {cfg.family} fixes the softmax scale at "
                         f"{gguf_attention_scale(cfg):.6g} for this shape (GGUF has no key for it), not {scale:.6g}")


def read_gguf(key, f) -> dict:
    fields = gemma.read_gguf(key, f, "gemma2")
    n_layer, window = key("block_count", int), key("attention.sliding_window", int, None)
    shape = {"n_layer": n_layer, "d_model": key("embedding_length", int), "n_head": key("attention.head_count", int),
             "head_dim": fields["head_dim"]}
    return {**fields, "branch_norms": "both", "attention_scale": gguf_attention_scale(shape),
            "attention_softcap": key("attn_logit_softcapping", float, None),
            "logit_softcap": key("final_logit_softcapping", float, None),
            # llama.cpp's gemma2 slides on the even layers
            **({"sliding_window": window, "sliding_layers": tuple(range(0, n_layer, 2))} if window else {})}


def write_gguf(cfg) -> dict:
    check_gguf_attention_scale(cfg)
    keys = dict(llama.write_gguf(cfg))
    if cfg.sliding_window is not None:
        if cfg.sliding_layers != tuple(range(0, cfg.n_layer, 2)):
            raise ValueError(f"sliding_layers: llama.cpp's gemma2 slides on the even layers, not {cfg.sliding_layers}")
        keys["attention.sliding_window"] = (cfg.sliding_window, "UINT32")
    for name, value in (("attn_logit_softcapping", cfg.attention_softcap),
                        ("final_logit_softcapping", cfg.logit_softcap)):
        if value is not None:
            keys[name] = (value, "FLOAT32")
    return keys


FAMILY = Family(
    name="gemma2", model_types=("gemma2",), architectures=(ARCH, "Gemma2Model"), saves_as=ARCH, names=NAMES,
    activations=gemma.ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config, write_config=write_config,
    cannot_express=cannot_express, gguf_arch="gemma2", read_gguf=read_gguf, write_gguf=write_gguf,
)
