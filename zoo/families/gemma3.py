"""Gemma 3, text (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2 without its soft-caps,
plus an RMSNorm of Gemma's kind over each head's q and k, a local/global layer pattern
(`layer_types`, five sliding layers to one full in the published models) and two RoPE tables:
the sliding layers' (`rope_local_base_freq`, 10,000, unscaled) and the full layers' (`rope_theta`
with `rope_scaling`, linear by 8 in the 4B and larger models). transformers 5 keeps both in
`rope_parameters`, keyed by layer type."""

from __future__ import annotations

from typing import Optional

from ..core.errors import CheckpointError
from ..core.files import show_value
from . import gemma, gemma2, llama
from .family import Family, Getter

HF_KEYS = dict(gemma2.HF_KEYS, sliding_rope_theta="rope_local_base_freq")
DEFAULTS = {**gemma2.DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072}
ARCH = "Gemma3ForCausalLM"


def read_rope(hf: dict, get: Getter) -> dict:
    """The two tables, from rope_parameters keyed by layer type (transformers 5) or from
    rope_theta, rope_scaling and rope_local_base_freq."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        for name, part in (("full_attention", full), ("sliding_attention", local)):
            if not isinstance(part, dict):
                raise CheckpointError(get.source, f"expected a JSON object, got {show_value(part)}",
                                      key=f"rope_parameters.{name}")
        theta, scaling = llama.read_rope({"rope_parameters": {"rope_theta": 1e6, **full}}, get)
        local_theta, local_scaling = llama.read_rope({"rope_parameters": {"rope_theta": 1e4, **local}}, get)
        if local_scaling is not None:
            raise CheckpointError(get.source, "zoo computes unscaled RoPE on the sliding layers",
                                  key="rope_parameters.sliding_attention.rope_type")
    else:
        theta, scaling = llama.read_rope({**hf, "rope_theta": hf.get("rope_theta", 1e6)}, get)
        local_theta = get("rope_local_base_freq", 1e4, float)
    return {"rope_theta": theta, "rope_scaling": scaling, "sliding_rope_theta": local_theta}


def read_config(hf: dict, get: Getter) -> dict:
    fields = gemma2.read_second_generation(hf, get, "gemma3", DEFAULTS, get("sliding_window_pattern", 6, int))
    fields = {**fields, **read_rope(hf, get), "qk_norm": "head", **gemma2.read_softcaps(get, None, None)}
    if fields.get("sliding_window") is None:
        fields.pop("sliding_rope_theta")  # no sliding layers to rotate by it
    return fields


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    if cfg.qk_norm != "head":
        return "qk_norm", f"{ARCH} norms q and k over each head (qk_norm='head'), got {cfg.qk_norm!r}"
    return gemma2.second_generation_problem(cfg, ARCH) or llama.cannot_express(
        cfg, ARCH, norm="rmsnorm_1p", activations=gemma.ACTIVATIONS,
        expresses=("embedding_scale", "branch_norms", "attention_scale", "attention_softcap", "logit_softcap",
                   "sliding_window", "sliding_layers", "qk_norm", "sliding_rope_theta"))


def write_config(cfg) -> dict:
    out = {"architectures": [ARCH], "model_type": "gemma3_text", **gemma2.write_second_generation(cfg)}
    full = out.pop("rope_parameters")
    out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
        "rope_type": "default", "rope_theta": cfg.sliding_rope_theta if cfg.sliding_rope_theta else cfg.rope_theta}}
    out.pop("rope_theta", None)
    out.pop("rope_scaling", None)
    return out


def read_gguf(key, f) -> dict:
    fields = gemma.read_gguf(key, f, "gemma3")
    n_layer, window = key("block_count", int), key("attention.sliding_window", int, None)
    pattern = tuple(i for i in range(n_layer) if (i + 1) % 6)  # llama.cpp's gemma3: five sliding, one full
    shape = {"n_layer": n_layer, "d_model": key("embedding_length", int), "n_head": key("attention.head_count", int),
             "head_dim": fields["head_dim"]}
    return {**fields, "branch_norms": "both", "qk_norm": "head",
            "attention_scale": gemma2.gguf_attention_scale(shape),
            **({"sliding_window": window, "sliding_layers": pattern, "sliding_rope_theta":
                key("rope.freq_base_swa", float, 10000.0)} if window else {})}


def write_gguf(cfg) -> dict:
    gemma2.check_gguf_attention_scale(cfg)
    keys = dict(llama.write_gguf(cfg))
    if cfg.sliding_window is not None:
        pattern = tuple(i for i in range(cfg.n_layer) if (i + 1) % 6)
        if cfg.sliding_layers != pattern:
            raise ValueError(f"sliding_layers: llama.cpp's gemma3 slides on five layers of six {list(pattern)}, "
                             f"not {cfg.sliding_layers}")
        keys["attention.sliding_window"] = (cfg.sliding_window, "UINT32")
        keys["rope.freq_base_swa"] = (cfg.sliding_rope_theta or cfg.rope_theta, "FLOAT32")
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type != "linear":
        raise ValueError(f"rope_scaling: llama.cpp's gemma3 scales RoPE linearly, not by {cfg.rope_scaling.rope_type}")
    return keys


FAMILY = Family(
    name="gemma3", model_types=("gemma3_text",), architectures=(ARCH, "Gemma3TextModel"), saves_as=ARCH,
    names=gemma2.NAMES, activations=gemma.ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config,
    write_config=write_config, cannot_express=cannot_express, gguf_arch="gemma3", read_gguf=read_gguf,
    write_gguf=write_gguf,
)
