"""ModelConfig: an architecture as a composition of blocks.

Every field names one choice the native executor makes (which norm, which MLP,
which positions, how many heads...). Defaults follow the GPT-2 family; presets.py
holds the real shapes of the GPT-2 and Llama families.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from . import blocks


class RopeScaling(BaseModel):
    """Llama-3 frequency scaling of RoPE (rope_type "llama3" in Hugging Face)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)

    @model_validator(mode="after")
    def _check(self) -> "RopeScaling":
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "rope_scaling.high_freq_factor must be greater than rope_scaling.low_freq_factor "
                f"(got {self.high_freq_factor} <= {self.low_freq_factor})"
            )
        return self


class ModelConfig(BaseModel):
    """A decoder-only transformer. Unset n_kv_head, head_dim and d_ff take their usual defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(gt=0)
    max_seq_len: int = Field(gt=0)
    d_model: int = Field(gt=0)
    n_layer: int = Field(gt=0)
    n_head: int = Field(gt=0)
    n_kv_head: Optional[int] = Field(default=None, gt=0)  # None: = n_head (multi-head attention)
    head_dim: Optional[int] = Field(default=None, gt=0)  # None: = d_model // n_head
    d_ff: Optional[int] = Field(default=None, gt=0)  # None: 4 * d_model
    norm: str = "layernorm"  # a norm of the block registry (zoo/blocks.py): layernorm, rmsnorm, ...
    norm_eps: float = Field(default=1e-5, gt=0)
    mlp: str = "gelu"  # an activation of the registry: gelu, swiglu, relu2 (forward only without Clad), ...
    positions: Literal["learned", "rope"] = "learned"
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: Optional[RopeScaling] = None
    attention_bias: bool = True
    mlp_bias: bool = True
    tied_embeddings: bool = True

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data):
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("n_kv_head") is None and "n_head" in data:
            data["n_kv_head"] = data["n_head"]
        if data.get("head_dim") is None and "n_head" in data and "d_model" in data:
            n_head, d_model = data["n_head"], data["d_model"]
            if isinstance(n_head, int) and isinstance(d_model, int) and n_head > 0:
                if d_model % n_head != 0:
                    raise ValueError(
                        f"head_dim: d_model={d_model} is not divisible by n_head={n_head}; "
                        "set head_dim explicitly"
                    )
                data["head_dim"] = d_model // n_head
        if data.get("d_ff") is None and isinstance(data.get("d_model"), int):
            data["d_ff"] = 4 * data["d_model"]
        return data

    @field_validator("norm", "mlp")
    @classmethod
    def _registered_block(cls, v: str, info) -> str:
        registered, what = (blocks.norms(), "norm") if info.field_name == "norm" else (blocks.activations(),
                                                                                       "MLP activation")
        if v not in registered:
            raise ValueError(f"{v!r} is no {what} of this zoo; registered: {', '.join(registered)}")
        return v

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(
                f"n_kv_head: n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}"
            )
        if self.positions == "rope" and self.head_dim % 2 != 0:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if self.positions != "rope" and self.rope_scaling is not None:
            raise ValueError("rope_scaling: set only with positions='rope'")
        return self

    # --- derived quantities -------------------------------------------------

    @property
    def family(self) -> str:
        """Which Hugging Face naming the parameters follow: 'gpt2' for learned positions, else 'llama'."""
        return "gpt2" if self.positions == "learned" else "llama"

    @property
    def qkv_dim(self) -> int:
        return (self.n_head + 2 * self.n_kv_head) * self.head_dim

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter in zoo's layout, in arena order (2-D weights are (out, in))."""
        from .layout import parameter_shapes

        return parameter_shapes(self)

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in self.parameter_shapes().values())
