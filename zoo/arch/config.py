"""ModelConfig: an architecture as a composition of blocks.

Every field names one choice the native executor makes (which norm, which MLP,
which positions, how many heads...). Defaults follow the GPT-2 family; presets.py
holds the real shapes of the GPT-2 and Llama families.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .. import families
from ..core import blocks
from ..core.native import _native
from ..core.rope import RopeScaling

# Upper bounds on every size, checked here before anything is built from a config (a config.json
# with 10^8 layers or a vocabulary of 2e9 is refused in microseconds, naming the field). They are
# the native core's (native/executor/limits.hpp says why each is chosen: far above every real model, low
# enough that every index the kernels use fits its type), so Python and the bindings agree.
LIMITS: dict[str, int] = dict(_native.limits)
MAX_LAYERS = LIMITS["max_layers"]  # 1024
MAX_WIDTH = LIMITS["max_width"]  # 2^17: d_model, d_ff, head_dim, n_head, n_kv_head
MAX_ROW_FLOATS = LIMITS["max_row_floats"]  # 2^20: one activation row (q|k|v, the MLP's gate|up)
MAX_VOCAB = LIMITS["max_vocab"]  # 2^24
MAX_SEQ_LEN = LIMITS["max_seq_len"]  # 2^21
MAX_TENSOR_FLOATS = LIMITS["max_tensor_floats"]  # 2^36: one weight tensor
MAX_TOKENS = LIMITS["max_tokens"]  # 2^24: batch x seq_len of one micro-batch


class ModelConfig(BaseModel):
    """A decoder-only transformer. Unset n_kv_head, head_dim and d_ff take their usual defaults."""

    # Non-finite floats (a NaN norm_eps, an infinite rope_theta) are refused like any bad value.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    vocab_size: int = Field(gt=0, le=MAX_VOCAB)
    max_seq_len: int = Field(gt=0, le=MAX_SEQ_LEN)
    d_model: int = Field(gt=0, le=MAX_WIDTH)
    n_layer: int = Field(gt=0, le=MAX_LAYERS)
    n_head: int = Field(gt=0, le=MAX_WIDTH)
    n_kv_head: Optional[int] = Field(default=None, gt=0, le=MAX_WIDTH)  # None: = n_head (multi-head attention)
    head_dim: Optional[int] = Field(default=None, gt=0, le=MAX_WIDTH)  # None: = d_model // n_head
    d_ff: Optional[int] = Field(default=None, gt=0, le=MAX_WIDTH)  # None: 4 * d_model
    norm: str = "layernorm"  # a norm of the block registry (zoo/core/blocks.py): layernorm, rmsnorm, ...
    norm_eps: float = Field(default=1e-5, gt=0)
    mlp: str = "gelu"  # an activation of the registry: gelu, swiglu, relu2 (forward only without Clad), ...
    # How a layer arranges its blocks: "sequential" (x + attn(norm1(x)), then + mlp(norm2(.))) or
    # "parallel" (x + attn(norm(x)) + mlp(norm(x)), GPT-J/Falcon) or "parallel_two_norms"
    # (x + attn(norm1(x)) + mlp(norm2(x)), GPT-NeoX).
    layer: str = "sequential"
    positions: Literal["learned", "rope"] = "learned"
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: Optional[RopeScaling] = None
    attention_bias: bool = True
    mlp_bias: bool = True
    tied_embeddings: bool = True
    # The options of the Llama variants (Qwen, Mistral, OLMo-2, SmolLM3, Granite, Gemma), each
    # off by default and usable in any mix with the sequential layer (docs/config.md).
    attention_out_bias: Optional[bool] = None  # the output projection's bias; None: as attention_bias (q, k, v)
    qk_norm: Literal["none", "head", "projection"] = "none"  # q and k normalized after their projection:
    # over each head (Qwen3, Gemma 3) or over all heads at once (OLMo-2), with the model's norm
    branch_norms: Literal["pre", "post", "both"] = "pre"  # norms on each branch's input, output (OLMo-2) or both
    sliding_window: Optional[int] = Field(default=None, gt=0, le=MAX_SEQ_LEN)  # keys a query sees, itself included
    sliding_layers: Optional[tuple[int, ...]] = None  # the layers with the window; None: all (with a window)
    nope_layers: tuple[int, ...] = ()  # layers whose attention rotates nothing (SmolLM3's NoPE layers)
    embedding_scale: float = Field(default=1.0, gt=0)  # token embeddings times this (Gemma: sqrt(d_model))
    residual_scale: float = Field(default=1.0, gt=0)  # each branch's output times this before its add (Granite)
    attention_scale: Optional[float] = Field(default=None, gt=0)  # the softmax scale; None: head_dim ** -0.5
    logit_scale: float = Field(default=1.0, gt=0)  # logits times this (Granite: 1 / logits_scaling)
    attention_softcap: Optional[float] = Field(default=None, gt=0)  # scores -> c tanh(scores / c) (Gemma 2)
    logit_softcap: Optional[float] = Field(default=None, gt=0)  # logits -> c tanh(logits / c) (Gemma 2)
    sliding_rope_theta: Optional[float] = Field(default=None, gt=0)  # the sliding layers' own RoPE base (Gemma 3)
    rotary_dim: Optional[int] = Field(default=None, gt=0, le=MAX_WIDTH)  # values of a head RoPE rotates; None: all
    # The Hugging Face architecture its tensors are named after and it saves as (zoo/families/);
    # None: gpt2 for learned positions, llama for RoPE.
    family: Optional[str] = None

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
        if data.get("attention_out_bias") is None:
            data["attention_out_bias"] = data.get("attention_bias", cls.model_fields["attention_bias"].default)
        if data.get("family") is None:
            data["family"] = families.default_for(data.get("positions", "learned"))
        return data

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        families.get(v)  # a ValueError naming the families
        return v

    @field_validator("norm", "mlp", "layer")
    @classmethod
    def _registered_block(cls, v: str, info) -> str:
        registered, what = {"norm": (blocks.norms(), "norm"), "mlp": (blocks.activations(), "MLP activation"),
                            "layer": (blocks.layers(), "layer arrangement")}[info.field_name]
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
        self._check_variant()
        self._check_products()
        return self

    def _check_variant(self) -> None:
        for field in ("sliding_layers", "nope_layers"):
            layers = getattr(self, field) or ()
            if any(i < 0 or i >= self.n_layer for i in layers) or list(layers) != sorted(set(layers)):
                raise ValueError(f"{field}: layer indices in increasing order within 0..{self.n_layer - 1}, "
                                 f"got {list(layers)}")
        if self.sliding_layers is not None and self.sliding_window is None:
            raise ValueError("sliding_layers: set only with a sliding_window")
        if self.nope_layers and self.positions != "rope":
            raise ValueError("nope_layers: set only with positions='rope'")
        if self.sliding_rope_theta is not None and (self.sliding_window is None or self.positions != "rope"):
            raise ValueError("sliding_rope_theta: set only with a sliding_window and positions='rope'")
        if self.rotary_dim is not None and (self.positions != "rope" or self.rotary_dim % 2
                                            or self.rotary_dim > self.head_dim):
            raise ValueError(f"rotary_dim: an even number up to head_dim={self.head_dim}, with positions='rope'; "
                             f"got {self.rotary_dim}")
        if self.qk_norm != "none" and blocks.norms()[self.norm]["bias"]:
            raise ValueError(f"qk_norm: the q/k norm is the model's norm without a bias; {self.norm!r} has one")
        if self.layer != "sequential" and self.is_variant:
            raise ValueError(f"layer: {self.layer!r} computes none of qk_norm, branch_norms, sliding_window, "
                             "nope_layers, attention_softcap and the embedding, residual and attention scales "
                             "(sequential does)")

    @property
    def is_variant(self) -> bool:
        """Whether any option of the Llama variants beyond Llama's own is on."""
        return (self.qk_norm != "none" or self.branch_norms != "pre" or self.sliding_window is not None
                or bool(self.nope_layers) or self.embedding_scale != 1.0 or self.residual_scale != 1.0
                or self.attention_scale is not None or self.attention_softcap is not None
                or self.sliding_rope_theta is not None)

    def _check_products(self) -> None:
        """The products that size one activation row or one weight tensor, within the bounds (the
        fields alone are, but not their products)."""
        qkv, fc = self.qkv_dim, blocks.activations()[self.mlp]["gate_width"] * self.d_ff
        products = [
            ("head_dim", "(n_head + 2 n_kv_head) x head_dim", qkv, MAX_ROW_FLOATS),
            ("d_ff", "the MLP's width (gate width x d_ff)", fc, MAX_ROW_FLOATS),
            ("vocab_size", "vocab_size x d_model", self.vocab_size * self.d_model, MAX_TENSOR_FLOATS),
            ("max_seq_len", "max_seq_len x d_model", self.max_seq_len * self.d_model, MAX_TENSOR_FLOATS),
            ("head_dim", "(n_head + 2 n_kv_head) x head_dim x d_model", qkv * self.d_model, MAX_TENSOR_FLOATS),
            ("d_ff", "gate width x d_ff x d_model", fc * self.d_model, MAX_TENSOR_FLOATS),
        ]
        for field, what, value, bound in products:
            if value > bound:
                # The message starts with a field name: hf_config maps it to the config.json key.
                raise ValueError(f"{field}: {what} = {value} is above zoo's bound of {bound} floats")

    # --- derived quantities -------------------------------------------------

    @property
    def qkv_dim(self) -> int:
        return (self.n_head + 2 * self.n_kv_head) * self.head_dim
