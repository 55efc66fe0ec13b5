"""How much memory finetuning a config takes, from the config alone (no arena is built, so it
works for models far larger than the machine).

Everything is float32: parameters, gradients, AdamW's two moments (16 bytes per parameter),
plus the activation arena the native planner lays out for one micro-batch of
batch x seq_len tokens (activation_bytes, the same figure a built model uses).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._load_native import _native
from .config import ModelConfig

FLOAT_BYTES = 4


def activation_bytes(cfg: ModelConfig, batch_size: int, seq_len: int, checkpointing: bool = False,
                     clad_blocks: tuple[str, ...] = ()) -> int:
    """The activation arena a training step at (batch_size, seq_len) plans, without building a model."""
    return FLOAT_BYTES * int(_native.activation_floats(cfg.model_dump(), int(batch_size), int(seq_len),
                                                       bool(checkpointing), list(clad_blocks)))


@dataclass(frozen=True)
class FinetuneMemory:
    parameters: int
    gradients: int
    optimizer: int  # AdamW first and second moments
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations


def finetune_memory_bytes(cfg: ModelConfig, batch: int, seq_len: int, checkpointing: bool = False) -> FinetuneMemory:
    """Memory for full finetuning with AdamW at micro-batch (batch, seq_len); checkpointing:
    with activation checkpointing (each layer recomputed in the pullback)."""
    if batch <= 0 or seq_len <= 0:
        raise ValueError(f"batch and seq_len must be positive, got {batch} and {seq_len}")
    n = cfg.num_parameters()
    return FinetuneMemory(parameters=FLOAT_BYTES * n, gradients=FLOAT_BYTES * n, optimizer=2 * FLOAT_BYTES * n,
                          activations=activation_bytes(cfg, batch, seq_len, checkpointing))


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"
