"""LoRA: the adapters a finetune trains on a frozen base (docs/lora.md). A config names the
linear layers it adapts by their Hugging Face module names; this module turns that into the
adapters' tensors (named as PEFT names them, laid out in the trainable arena) and the table the
native executor binds them by: which linear layer of which layer (its "slot": the fused q|k|v,
the attention output, the fused gate|up or up, the MLP output), which of the layer's output
columns each adapter adds to, and where its A and B sit."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .. import families
from ..core import blocks
from ..core.gemm import bf16_slower_than_fp32, gemm_info
from .layout import ParamSpec

if TYPE_CHECKING:
    from .config import ModelConfig

# The formats a frozen base's matrices may take (native/kernels/quant.hpp), and what each costs per value.
BASE_DTYPES = ("fp32", "bf16", "int8", "nf4")

class LoraConfig(BaseModel):
    """rank r, alpha (the adapters' output is scaled by alpha / r), dropout on their input, and
    the modules they adapt, by Hugging Face name (q_proj, ..., down_proj; c_attn, c_proj, c_fc
    for GPT-2 naming, where c_proj is both attn.c_proj and mlp.c_proj, and "attn.c_proj"
    names one). None or ["all-linear"]: every linear layer of every layer (not the LM head)."""

    model_config = ConfigDict(extra="forbid")
    r: int = Field(8, ge=1, le=4096)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    targets: Optional[list[str]] = None

    @field_validator("targets")
    @classmethod
    def _nonempty(cls, v):
        if v is not None and not v:
            raise ValueError("name at least one module (or leave targets out for all linear layers)")
        return v

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


@dataclass(frozen=True)
class Adapter:
    """One adapter: on module (its Hugging Face path), in layer, on slot's output columns [o0, o1)."""
    module: str
    layer: int
    slot: str
    o0: int
    o1: int
    d_in: int


def _layer_modules(cfg: "ModelConfig", i: int) -> list[tuple[str, str, int, int, int]]:
    """(module path, slot, o0, o1, in_features) of every linear layer of layer i, named as cfg's
    family names them (a fused tensor, such as GPT-2's c_attn, one module over its whole slot)."""
    names = families.get(cfg.family).names
    d, hd = cfg.d_model, cfg.head_dim
    q, kv, ff = cfg.n_head * hd, cfg.n_kv_head * hd, cfg.d_ff
    gated = blocks.activations()[cfg.mlp]["gate_width"] == 2
    prefix = names.layer.format(i=i)
    out = []

    def linear(parts, slot, rows, d_in):
        if len(parts) == 1:
            rows = [sum(rows)]
        o0 = 0
        for part, n in zip(parts, rows):
            out.append((prefix + part, slot, o0, o0 + n, d_in))
            o0 += n

    linear(names.qkv, "qkv", [q, kv, kv], d)
    linear((names.attn_out,), "attn_out", [d], q)
    linear(names.mlp_in_gated if gated else (names.mlp_in,), "fc", [ff, ff] if gated else [ff], d)
    linear((names.mlp_out,), "proj", [d], ff)
    return out


def _matches(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def module_names(cfg: "ModelConfig") -> list[str]:
    """The module names a target may use for cfg's linear layers, in layer order (q_proj ...
    down_proj as cfg's MLP has them; c_attn, c_proj, c_fc)."""
    names = families.get(cfg.family).lora_modules
    return [n for n in names if any(_matches(m[0], n) for m in _layer_modules(cfg, 0))]


def adapters(cfg: "ModelConfig", lora: LoraConfig) -> list[Adapter]:
    """The adapters lora puts on cfg, in layer order, a slot's in column order. A target that
    matches no module is an error naming the modules there are."""
    targets = lora.targets or ["all-linear"]
    everything = targets == ["all-linear"]
    out, used = [], set()
    for i in range(cfg.n_layer):
        for path, slot, o0, o1, d_in in _layer_modules(cfg, i):
            hit = [t for t in targets if everything or _matches(path, t)]
            used.update(hit)
            if hit:
                out.append(Adapter(path, i, slot, o0, o1, d_in))
    unused = [t for t in targets if t not in used and not everything]
    if unused:
        raise ValueError(f"lora targets {unused} match no module of this model; its linear layers: "
                         f"{', '.join(module_names(cfg))}")
    return out


def with_targets(cfg: "ModelConfig", lora: LoraConfig) -> LoraConfig:
    """lora with its targets spelled out: "every linear layer" (None, ["all-linear"]) becomes
    the module names of cfg's family (q_proj ... down_proj; c_attn, c_proj, c_fc)."""
    if lora.targets and lora.targets != ["all-linear"]:
        return lora
    names: list[str] = []
    for path, *_ in _layer_modules(cfg, 0):
        name = path.rsplit(".", 1)[1]
        if name not in names:
            names.append(name)
    return lora.model_copy(update={"targets": names})


def adapter_layout(cfg: "ModelConfig", lora: LoraConfig) -> tuple[list["ParamSpec"], list[tuple]]:
    """The adapters' tensors in the trainable arena's order (per layer and slot, its A's then its
    B's), named as PEFT names them without its base_model.model. prefix, and the table the
    executor binds: rows of (slot, layer, o0, o1, rank, A offset, B offset)."""
    specs, table = [], []
    at, r = 0, lora.r
    by_slot: dict[tuple[int, str], list[Adapter]] = {}
    for a in adapters(cfg, lora):
        by_slot.setdefault((a.layer, a.slot), []).append(a)
    for (layer, slot), group in by_slot.items():
        a_at = at
        for a in group:
            specs.append(ParamSpec(a.module + ".lora_A.weight", (r, a.d_in), "", layer, False, True, "lora_a"))
            at += r * a.d_in
        b_at = at
        for a in group:
            specs.append(ParamSpec(a.module + ".lora_B.weight", (a.o1 - a.o0, r), "", layer, False, True, "zeros"))
            table.append((slot, layer, a.o0, a.o1, r, a_at, b_at))
            a_at += r * a.d_in
            b_at += (a.o1 - a.o0) * r
        at = b_at
    return specs, table


def widest_slot(table: list[tuple]) -> int:
    """The widest stack of a slot's adapters (segments x rank): what sizes their scratch."""
    width: dict[tuple[int, str], int] = {}
    for slot, layer, _, _, rank, _, _ in table:
        width[(layer, slot)] = width.get((layer, slot), 0) + rank
    return max(width.values(), default=0)


def initial_adapter(spec: "ParamSpec", rng: np.random.Generator) -> np.ndarray:
    """PEFT's default: A kaiming-uniform (a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), B zero."""
    if spec.init == "zeros":
        return np.zeros(spec.shape, np.float32)
    bound = 1.0 / math.sqrt(spec.shape[1])
    return rng.uniform(-bound, bound, spec.shape).astype(np.float32)


def default_precision(base_dtype: str) -> str:
    """The products of a LoRA run by default: bf16 over a base narrower than fp32 where the CPU has
    bf16 dot products (the base is bf16 at best already) that run faster than its fp32 products
    (gemm.bf16_slower_than_fp32), else fp32."""
    return "bf16" if base_dtype != "fp32" and gemm_info()["bf16_native"] and not bf16_slower_than_fp32() else "fp32"


def run_setup(cfg: "ModelConfig", lora: Optional[LoraConfig], base_dtype: str, frozen: bool,
              table: list[tuple], seed: Optional[int]) -> dict:
    """The config as the executor takes it, with the run's setup beside it: whether the base is
    frozen and its matrices' format, and what sizes the adapters' scratch."""
    return {**cfg.model_dump(), "frozen": frozen, "matrix_dtype": base_dtype if frozen else "fp32",
            "lora_width": widest_slot(table), "lora_scale": lora.scaling if lora else 1.0,
            "lora_dropout": lora.dropout if lora else 0.0, "lora_seed": int(seed or 0) % 2**64}
