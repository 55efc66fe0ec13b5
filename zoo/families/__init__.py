"""The Hugging Face architectures zoo reads and writes, one module each (docs/adding_a_family.md).

Outside this package no code branches on a family's name: the loaders, writers and tools look
the family up here and read its table.
"""

from __future__ import annotations

from . import (
    gemma,
    gemma2,
    gemma3,
    gpt2,
    gpt_neox,
    granite,
    llama,
    mistral,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    smollm3,
)
from .family import Family, Getter, TensorNames

FAMILIES: dict[str, Family] = {f.name: f for f in (gpt2.FAMILY, llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY,
                                                   olmo2.FAMILY, smollm3.FAMILY, granite.FAMILY, gemma.FAMILY,
                                                   gemma2.FAMILY, gemma3.FAMILY, phi3.FAMILY, gpt_neox.FAMILY)}


def get(name: str) -> Family:
    """The family of that name (ModelConfig.family); an unknown name is a ValueError naming them all."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"family {name!r} is unknown (zoo has: {', '.join(FAMILIES)})") from None


def default_for(positions) -> str:
    """The family a config that names none is named after: GPT-2's with learned positions,
    Llama's with RoPE (as zoo named every config before families were explicit)."""
    return llama.FAMILY.name if positions == "rope" else gpt2.FAMILY.name


def by_model_type(model_type: str) -> Family | None:
    """The family a config.json's model_type names, or None."""
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)


def by_gguf_arch(arch: str) -> Family | None:
    """The family a GGUF file's general.architecture names (the first that writes it: llama for
    Mistral's files too, as llama.cpp keeps them), or None."""
    return next((f for f in FAMILIES.values() if f.gguf_arch == arch), None)


def model_types() -> list[str]:
    return [t for f in FAMILIES.values() for t in f.model_types]


def gguf_archs() -> list[str]:
    return list(dict.fromkeys(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch))


__all__ = ["FAMILIES", "Family", "Getter", "TensorNames", "by_gguf_arch", "by_model_type", "default_for", "get", "gguf_archs",
           "model_types"]
