"""Parameter layout: the one place that says which tensors a config has, their names,
shapes, order in the parameter arena, and the role the native executor binds them to.

Names: each tensor is named as the config's family (ModelConfig.family, zoo/families/) names
it in its checkpoints; the family says where each role's tensor lives (TensorNames). A config
without a family is named after GPT2LMHeadModel with learned positions and LlamaForCausalLM
with RoPE. A block the family does not have keeps the family's pattern
(e.g. a GPT-2-named model with RMSNorm has ln_1.weight and no ln_1.bias; a parallel-residual
layer has ln_1 (input_layernorm) and no ln_2 (post_attention_layernorm); a Llama-named
model with LayerNorm gets input_layernorm.bias; a Llama-named GELU MLP has up_proj and
down_proj only; a GPT-2-named SwiGLU MLP has mlp.c_fc holding [gate; up]).

2-D weights are stored (out_features, in_features), as torch.nn.Linear. GPT-2's Conv1D
checkpoints store (in, out): those tensors carry hf_transposed=True.

Fused GEMMs need adjacent tensors: q, k, v projections (and their biases) are laid out
next to each other and bound as one "qkv" weight; gate_proj and up_proj likewise as "fc".

Which tensors a norm or an activation needs (a bias, a gated input) comes from the native
block registry (zoo/core/blocks.py). The executor receives the layout as a table of
(role, layer, offset, count) rows (layout_table) and binds it in one loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from .. import families
from ..core import blocks

if TYPE_CHECKING:
    from .config import ModelConfig


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    role: str  # what the executor binds; "" for a tensor bound through its fused neighbour
    layer: int  # -1 for tensors outside the layer stack
    hf_transposed: bool  # stored transposed relative to the Hugging Face checkpoint
    decay: bool  # AdamW weight decay applies by default (2-D matmul weights only)
    init: str  # "ones", "zeros", "normal" (std 0.02) or "residual" (std 0.02 / sqrt(2 n_layer))


def initial_value(spec: ParamSpec, rng: np.random.Generator, n_layer: int, rows: Optional[int] = None) -> np.ndarray:
    """The tensor's GPT-2-style initial value (float32). The one init, used by zoo.Model and
    by zoo bench: normal draws come from rng in layout order, so a seed fixes every weight.
    rows: the next rows of it only (the draws of successive calls are those of one whole call),
    so a frozen base is initialized without a float32 copy of its widest tensor."""
    shape = spec.shape if rows is None else (rows, *spec.shape[1:])
    if spec.init == "ones":
        return np.ones(shape, np.float32)
    if spec.init == "zeros":
        return np.zeros(shape, np.float32)
    std = 0.02 / math.sqrt(2 * n_layer) if spec.init == "residual" else 0.02
    value = rng.standard_normal(shape, dtype=np.float32)
    value *= np.float32(std)
    return value


def parameter_layout(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter of cfg in arena order, named as cfg's family names it."""
    return _layout(cfg)


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter in zoo's layout, in arena order (2-D weights are (out, in))."""
    return {p.name: p.shape for p in parameter_layout(cfg)}


def num_parameters(cfg: ModelConfig) -> int:
    return sum(math.prod(p.shape) for p in parameter_layout(cfg))


def parameter_offsets(layout: list[ParamSpec]) -> tuple[dict[str, int], int]:
    """Each tensor's offset in the parameter arena (floats, in layout order), and the total."""
    offsets, at = {}, 0
    for p in layout:
        offsets[p.name] = at
        at += math.prod(p.shape)
    return offsets, at


def layout_table(layout: list[ParamSpec]) -> list[tuple[str, int, int, int]]:
    """The layout as the executor binds it: (role, layer, offset, count) rows, a fused tensor
    (a role followed by its role-less neighbours) as one row."""
    rows: list[list] = []
    at = 0
    for p in layout:
        n = math.prod(p.shape)
        if p.role:
            rows.append([p.role, p.layer, at, n])
        else:
            rows[-1][3] += n
        at += n
    return [tuple(r) for r in rows]


# Norm weights start at one, biases at zero, matrices at normal(0, 0.02), the projections into
# the residual stream scaled down by depth (GPT-2). A fused neighbour shares its role's init.
_ONES = ("ln1_w", "ln2_w", "lnf_w", "q_norm_w", "k_norm_w", "post_attn_w", "post_mlp_w")
_RESIDUAL = ("attn_out_w", "proj_w")


def _init(role: str, shape, cfg) -> str:
    if role in _ONES:  # (a norm that scales by 1 + w starts at w = 0)
        return "zeros" if cfg.norm == "rmsnorm_1p" else "ones"
    if len(shape) == 1:
        return "zeros"
    return "residual" if role in _RESIDUAL else "normal"


def _layout(cfg: ModelConfig) -> list[ParamSpec]:
    names = families.get(cfg.family).names
    d, hd = cfg.d_model, cfg.head_dim
    q_out, kv_out = cfg.n_head * hd, cfg.n_kv_head * hd
    gated = blocks.activations()[cfg.mlp]["gate_width"] == 2
    norm_bias = blocks.norms()[cfg.norm]["bias"]
    second_norm = blocks.layers()[cfg.layer]["second_norm"]
    out: list[ParamSpec] = []

    def add(name, shape, role, layer=-1, transposed=False, decay=False):
        out.append(ParamSpec(name, tuple(shape), role, layer, transposed, decay, _init(role, shape, cfg)))

    def norm(name, role, layer=-1, width=d, bias=True):
        add(name + ".weight", (width,), role + "_w", layer)
        if norm_bias and bias:
            add(name + ".bias", (width,), role + "_b", layer)

    pre_norms, post_norms = cfg.branch_norms != "post", cfg.branch_norms != "pre"
    qk_widths = {"head": (hd, hd), "projection": (q_out, kv_out)}.get(cfg.qk_norm)

    def linear(prefix, parts, rows, d_in, role, bias, layer):
        """One GEMM's weight (and bias): its parts next to each other, the first bound to role."""
        if len(parts) == 1:
            rows = [sum(rows)]
        for k, (part, n) in enumerate(zip(parts, rows)):
            add(prefix + part + ".weight", (n, d_in), role + "_w" if k == 0 else "", layer, names.transposed, True)
        if bias:
            for k, (part, n) in enumerate(zip(parts, rows)):
                add(prefix + part + ".bias", (n,), role + "_b" if k == 0 else "", layer)

    add(names.embedding + ".weight", (cfg.vocab_size, d), "wte")
    if cfg.positions == "learned":
        add(names.positions + ".weight", (cfg.max_seq_len, d), "wpe")
    for i in range(cfg.n_layer):
        p = names.layer.format(i=i)
        if pre_norms:
            norm(p + names.norm1, "ln1", i)
        # q, k and v adjacent: one (q_out + 2 kv_out, d) GEMM; gate and up likewise
        linear(p, names.qkv, [q_out, kv_out, kv_out], d, "qkv", cfg.attention_bias, i)
        if qk_widths:
            norm(p + names.q_norm, "q_norm", i, qk_widths[0], bias=False)
            norm(p + names.k_norm, "k_norm", i, qk_widths[1], bias=False)
        linear(p, (names.attn_out,), [d], q_out, "attn_out", cfg.attention_out_bias, i)
        if post_norms:
            norm(p + names.post_norm1, "post_attn", i)
        if second_norm and pre_norms:
            norm(p + names.norm2, "ln2", i)
        if gated:
            linear(p, names.mlp_in_gated, [cfg.d_ff, cfg.d_ff], d, "fc", cfg.mlp_bias, i)
        else:
            linear(p, (names.mlp_in,), [cfg.d_ff], d, "fc", cfg.mlp_bias, i)
        linear(p, (names.mlp_out,), [d], cfg.d_ff, "proj", cfg.mlp_bias, i)
        if post_norms:
            norm(p + names.post_norm2, "post_mlp", i)
    norm(names.final_norm, "lnf")
    if not cfg.tied_embeddings:
        add(names.head + ".weight", (cfg.vocab_size, d), "lm_head_w", decay=True)
    return out


def frozen_table(layout: list[ParamSpec], matrix_dtype: str) -> tuple[list[tuple], dict[str, tuple[int, int, int, int]]]:
    """A frozen base as the executor binds it: rows of (role, layer, rows, cols, format), a fused
    tensor's parts as consecutive rows of one row (a vector of n: n rows of 1), the matrix roles
    in matrix_dtype and the rest in fp32; and where each tensor is: name -> (row of the table,
    first row, rows, cols)."""
    matrices = set(blocks.matrix_roles())
    rows: list[list] = []
    where: dict[str, tuple[int, int, int, int]] = {}
    for p in layout:
        r, c = (p.shape[0], p.shape[1]) if len(p.shape) == 2 else (p.shape[0], 1)
        if p.role:
            rows.append([p.role, p.layer, 0, c, matrix_dtype if p.role in matrices else "fp32"])
        elif rows[-1][3] != c:
            raise ValueError(f"{p.name} ({c} columns) cannot be fused with its neighbour ({rows[-1][3]} columns)")
        where[p.name] = (len(rows) - 1, rows[-1][2], r, c)
        rows[-1][2] += r
    return [tuple(x) for x in rows], where
