"""RoPE's frequencies: their scaling as a config field (Llama 3's, or linear), and the inverse
frequencies every rotation reads (the executor's tables, the GGUF writer's rope_freqs)."""

from __future__ import annotations

import math
from typing import Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .native import _native

MAX_SEQ_LEN = dict(_native.limits)["max_seq_len"]


class RopeScaling(BaseModel):
    """RoPE's frequency scaling, as Hugging Face's rope_type names it: "llama3" (long wavelengths
    divided by factor, short ones kept, a blend between: the three fields below it) or "linear"
    (every frequency divided by factor: Gemma 3's global layers)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    rope_type: Literal["llama3", "linear"] = "llama3"
    factor: float = Field(gt=0)
    low_freq_factor: Optional[float] = Field(default=None, gt=0)
    high_freq_factor: Optional[float] = Field(default=None, gt=0)
    original_max_position_embeddings: Optional[int] = Field(default=None, gt=0, le=MAX_SEQ_LEN)

    @model_validator(mode="after")
    def _check(self) -> "RopeScaling":
        llama3 = (self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings)
        if self.rope_type == "linear":
            if any(v is not None for v in llama3):
                raise ValueError("rope_scaling: linear scaling takes a factor alone")
            return self
        if any(v is None for v in llama3):
            raise ValueError("rope_scaling: llama3 scaling needs low_freq_factor, high_freq_factor and "
                             "original_max_position_embeddings")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "rope_scaling.high_freq_factor must be greater than rope_scaling.low_freq_factor "
                f"(got {self.high_freq_factor} <= {self.low_freq_factor})"
            )
        return self


def rope_inv_freq(cfg, local: bool = False) -> np.ndarray:
    """RoPE inverse frequencies in float32 (as transformers computes them) over the rotated part
    of a head (rotary_dim), with Llama-3 scaling; local: those of the sliding layers' own table
    (sliding_rope_theta, unscaled)."""
    hd = getattr(cfg, "rotary_dim", None) or cfg.head_dim
    theta = cfg.sliding_rope_theta if local else cfg.rope_theta
    inv = (1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd)))
    inv = inv.astype(np.float32)
    s = cfg.rope_scaling
    if s is None or local:
        return inv
    if s.rope_type == "linear":
        return (inv / np.float32(s.factor)).astype(np.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv).astype(np.float32)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / s.factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
