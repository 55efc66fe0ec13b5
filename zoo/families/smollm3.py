"""SmolLM3 (SmolLM3ForCausalLM): a Llama whose attention skips RoPE on the layers `no_rope_layers`
marks with 0 (NoPE layers: every fourth in the published 3B, from `no_rope_layer_interval`),
with tied embeddings by default and an optional sliding window on the NoPE layers."""

from __future__ import annotations

from typing import Optional

from ..core.errors import CheckpointError
from ..core.files import show_value
from . import llama
from .family import Family, Getter

HF_KEYS = dict(llama.HF_KEYS, nope_layers="no_rope_layers", sliding_window="sliding_window",
               sliding_layers="layer_types")
DEFAULTS = {"vocab_size": 128256, "max_position_embeddings": 32768, "hidden_size": 2048, "num_hidden_layers": 36,
            "num_attention_heads": 16, "num_key_value_heads": 4, "tie_word_embeddings": True}
ARCH = "SmolLM3ForCausalLM"
GGUF_NOPE_INTERVAL = 4  # llama.cpp's smollm3 fixes its NoPE layers at every fourth


def read_config(hf: dict, get: Getter) -> dict:
    fields = llama.read_config(hf, get, "smollm3", DEFAULTS)
    n = fields["n_layer"]
    uses_rope = hf.get("no_rope_layers")
    if uses_rope is None:
        interval = get("no_rope_layer_interval", 4, int)
        uses_rope = [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(uses_rope, list) or len(uses_rope) != n or any(v not in (0, 1) for v in uses_rope):
        raise CheckpointError(get.source, f"expected {n} entries of 0 or 1, got {show_value(uses_rope)}",
                              key="no_rope_layers")
    return {**fields, "nope_layers": tuple(i for i, v in enumerate(uses_rope) if not v),
            **llama.read_windows(hf, get, n)}


def cannot_express(cfg) -> Optional[tuple[str, str]]:
    return llama.cannot_express(cfg, ARCH, expresses=("nope_layers", "sliding_window", "sliding_layers"))


def write_config(cfg) -> dict:
    return {"architectures": [ARCH], "model_type": "smollm3", **llama.write_common(cfg),
            "hidden_act": llama.FAMILY.activation_name(cfg.mlp), **llama.write_windows(cfg),
            "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.n_layer)],
            "tie_word_embeddings": cfg.tied_embeddings}


def gguf_nope_layers(n_layer: int) -> tuple[int, ...]:
    return tuple(i for i in range(n_layer) if (i + 1) % GGUF_NOPE_INTERVAL == 0)


def read_gguf(key, f) -> dict:
    n_layer = key("block_count", int)
    return {**llama.read_gguf(key, f, "smollm3"), "nope_layers": gguf_nope_layers(n_layer)}


def write_gguf(cfg) -> dict:
    if tuple(cfg.nope_layers) != gguf_nope_layers(cfg.n_layer):
        raise ValueError(f"nope_layers: llama.cpp's smollm3 skips RoPE on every fourth layer "
                         f"{list(gguf_nope_layers(cfg.n_layer))}, not {list(cfg.nope_layers)}")
    return llama.write_gguf(cfg)


FAMILY = Family(
    name="smollm3", model_types=("smollm3",), architectures=(ARCH, "SmolLM3Model"), saves_as=ARCH,
    names=llama.NAMES, activations=llama.ACTIVATIONS, hf_keys=HF_KEYS, read_config=read_config,
    write_config=write_config, cannot_express=cannot_express, gguf_arch="smollm3", read_gguf=read_gguf,
    write_gguf=write_gguf, gguf_rope_heads=llama.gguf_rope_heads,
    notes=("a GGUF file holds NoPE layers at every fourth layer only (llama.cpp fixes them there)",),
)
