"""Per-block checks of the native blocks in zoo._native.blocks (issue 2, "What it must show").

For every block:
  * forward   == an independent float64 torch implementation (written here from the math
                 definitions, or for the norms and MLP activations the PyTorch reference model's,
                 zoo/tools/torch_reference.py; never zoo's kernels), within fp32 tolerance;
  * pullback  == torch autograd (float64) of that reference, given the same random output
                 adjoint, within 1e-4 relative (max abs err / max abs ref);
  * pullback  == central finite differences of zoo's OWN fp32 forward, accumulated in float64
                 (test_pullback_matches_float64_finite_differences).
Coverage: every norm and MLP activation of the registry (zoo.core.blocks), on each pullback this
build has for it (hand-written; Clad's where built), so a block added there is tested without
an edit here; both position kinds (learned wpe via the embedding block,
RoPE with and without llama3 scaling), attention MHA and GQA with n_kv_head = 1, 2 and n_head
and head_dim that is not a power of two, cross-entropy with ignored targets, linear with and
without bias, the residual add, and AdamW against torch.optim.AdamW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import pytest
from helpers import rel_err

from zoo import ModelConfig, RopeScaling
from zoo.core import blocks
from zoo.core.native import _native
from zoo.core.rope import rope_inv_freq

try:  # the finite-difference checks need no torch; the reference checks skip without it
    import torch
except ImportError:  # pragma: no cover
    torch = None

nb = _native.blocks

FWD_TOL = 1e-5   # fp32 forward vs float64 reference: rounding of O(100)-term fp32 sums is ~1e-6
PULL_TOL = 1e-4  # fp32 pullback vs float64 autograd (the per-block bound)


@pytest.fixture
def needs_torch():
    return pytest.importorskip("torch")


def f32(rng, shape, scale=1.0, shift=0.0):
    return (shift + scale * rng.standard_normal(shape)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Block cases. Each has the continuous inputs (differentiated), zoo's forward (the output that
# the adjoint pairs with), zoo's pullback (re-running zoo's forward for the saved statistics),
# and a float64 torch reference of the forward written from the definition.
# --------------------------------------------------------------------------------------------


@dataclass
class Case:
    inputs: dict[str, np.ndarray]                    # float32, each differentiated
    fwd: Callable[[dict], np.ndarray]                # zoo forward -> output (array or scalar)
    pull: Optional[Callable[[dict, np.ndarray], dict]]  # zoo pullback (inputs, dy) -> {name: grad};
                                                     # None: this build has no pullback for the block
    ref: Callable[[dict], "torch.Tensor"]            # float64 torch forward from the definition
    scalar_out: bool = False                         # output is a scalar (cross-entropy loss)
    fwd_tol: float = FWD_TOL
    extra: dict = field(default_factory=dict)


def pullback_backends(name: str) -> list[Optional[str]]:
    """The pullbacks this build has for a registered block ("manual", "clad"); [None] when it
    has none (a block written as its forward only, in a build without Clad)."""
    info = next(b for b in blocks.blocks() if b["name"] == name)
    return [backend for backend in ("manual", "clad") if info[backend]] or [None]


def torch_reference():
    from zoo.tools import (
        torch_reference as tr,  # imports torch: only where a reference is compared
    )

    return tr


def norm_case(rng, name, backend, C=100, eps=1e-5):  # C=100 spans two of the 64-wide dw/db column blocks
    bias = blocks.norms()[name]["bias"]
    inputs = {"x": f32(rng, (2, 5, C), 1.5, 0.3), "w": f32(rng, C, 0.2, 1.0)}
    if bias:
        inputs["b"] = f32(rng, C, 0.2)

    def fwd(i):
        return nb.norm_forward(name, i["x"], i["w"], i.get("b"), eps)[0]

    def pull(i, dy):
        _, stats = nb.norm_forward(name, i["x"], i["w"], i.get("b"), eps)
        dx, dw, db = nb.norm_pullback(name, i["x"], i["w"], i.get("b"), stats, dy, eps, backend)
        assert (db is None) == (not bias)
        return {"x": dx, "w": dw, **({"b": db} if bias else {})}

    def ref(t):
        return torch_reference().NORMS[name](t["x"], t["w"], t.get("b"), eps)

    return Case(inputs, fwd, pull if backend else None, ref)


def activation_case(rng, name, backend, F=24):
    # x: rows of gate_width * F ([gate | up] for a gated unit); rows of F out
    x = f32(rng, (3, 7, blocks.activations()[name]["gate_width"] * F), 2.0)

    def pull(i, dy):
        return {"x": nb.activation_pullback(name, i["x"], dy, backend)}

    return Case({"x": x}, lambda i: nb.activation_forward(name, i["x"]), pull if backend else None,
                lambda t: torch_reference().MLPS[name](t["x"]))


def linear_case(rng, bias, n_in=24, n_out=70):  # n_out=70: two 64-wide db column blocks
    inputs = {"x": f32(rng, (13, n_in)), "W": f32(rng, (n_out, n_in), 0.3)}
    if bias:
        inputs["b"] = f32(rng, n_out, 0.5)

    def fwd(i):
        return nb.linear_forward(i["x"], i["W"], i.get("b"))

    def pull(i, dy):
        dx, dW, db = nb.linear_pullback(i["x"], i["W"], dy, bias)
        assert (db is None) == (not bias)
        return {"x": dx, "W": dW, **({"b": db} if bias else {})}

    def ref(t):
        y = t["x"] @ t["W"].T
        return y + t["b"] if bias else y

    return Case(inputs, fwd, pull, ref)


def embedding_case(rng, learned_positions, B=2, T=9, V=11, C=70, max_pos=16):
    # V=11 < B*T: tokens repeat, so dwte rows accumulate; some ids never occur (zero rows).
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    inputs = {"wte": f32(rng, (V, C))}
    if learned_positions:
        inputs["wpe"] = f32(rng, (max_pos, C), 0.5)  # rows T..max_pos-1 unused: zero gradient

    def fwd(i):
        return nb.embedding_forward(tokens, i["wte"], i.get("wpe"))

    def pull(i, dy):
        dwte, dwpe = nb.embedding_pullback(tokens, dy, V, max_pos if learned_positions else 0)
        assert (dwpe is None) == (not learned_positions)
        return {"wte": dwte, **({"wpe": dwpe} if learned_positions else {})}

    def ref(t):
        tok = torch.from_numpy(tokens.astype(np.int64))
        x = t["wte"][tok]
        if learned_positions:
            x = x + t["wpe"][torch.arange(T)][None]
        return x.reshape(B * T, C)

    return Case(inputs, fwd, pull, ref)


def rope_config(head_dim: int, llama3: bool) -> ModelConfig:
    # original_max_position_embeddings=64 with theta=500000 and head_dim 12/20 puts frequencies
    # in all three llama3 regimes (unscaled high, smoothed medium, divided-by-factor low);
    # test_llama3_inv_freq_matches_definition asserts that.
    scaling = (RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=64) if llama3 else None)
    return ModelConfig(vocab_size=16, max_seq_len=64, d_model=3 * head_dim, n_layer=1, n_head=3,
                       head_dim=head_dim, norm="rmsnorm", mlp="swiglu", positions="rope",
                       rope_theta=500000.0 if llama3 else 10000.0, rope_scaling=scaling)


def rope_case(rng, head_dim, llama3, B=2, T=24, H=3):
    inv = rope_inv_freq(rope_config(head_dim, llama3))
    x = f32(rng, (B, T, H * head_dim))

    def ref(t):
        half = head_dim // 2
        pos = torch.arange(T, dtype=torch.float64)
        ang = pos[:, None] * torch.from_numpy(inv.astype(np.float64))[None]  # (T, half)
        cos = torch.cat([torch.cos(ang)] * 2, -1)[None, :, None]
        sin = torch.cat([torch.sin(ang)] * 2, -1)[None, :, None]
        xh = t["x"].reshape(B, T, H, head_dim)
        rot = torch.cat([-xh[..., half:], xh[..., :half]], -1)  # rotate_half
        return (xh * cos + rot * sin).reshape(B, T, H * head_dim)

    return Case({"x": x}, lambda i: nb.rope_forward(i["x"], inv, head_dim),
                lambda i, dy: {"x": nb.rope_pullback(dy, inv, head_dim)}, ref)


def attention_reference(qkv, nh, nkv, hd):
    B, T, _ = qkv.shape
    q = qkv[..., : nh * hd].reshape(B, T, nh, hd).transpose(1, 2)
    k = qkv[..., nh * hd: (nh + nkv) * hd].reshape(B, T, nkv, hd).transpose(1, 2)
    v = qkv[..., (nh + nkv) * hd:].reshape(B, T, nkv, hd).transpose(1, 2)
    # query head h reads kv head h // (nh // nkv)
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    masked = scores.masked_fill(~causal, float("-inf"))
    p = torch.softmax(masked, dim=-1)
    return (p @ v).transpose(1, 2).reshape(B, T, nh * hd), torch.logsumexp(masked, dim=-1)


def attention_case(rng, nh, nkv, hd, B=2, T=9):
    qkv = f32(rng, (B, T, (nh + 2 * nkv) * hd), 1.3)

    def pull(i, dy):
        _, lse = nb.attention_forward(i["qkv"], nh, nkv, hd)
        return {"qkv": nb.attention_pullback(i["qkv"], lse, dy, nh, nkv, hd)}

    return Case({"qkv": qkv}, lambda i: nb.attention_forward(i["qkv"], nh, nkv, hd)[0], pull,
                lambda t: attention_reference(t["qkv"], nh, nkv, hd)[0],
                extra=dict(nh=nh, nkv=nkv, hd=hd))


def cross_entropy_case(rng, n_ignored, N=12, V=37):
    logits = f32(rng, (N, V), 2.0)
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[rng.choice(N, n_ignored, replace=False)] = -100

    def fwd(i):
        loss, n_valid = nb.cross_entropy_forward(i["logits"], targets)
        assert n_valid == N - n_ignored
        return np.float64(loss)

    def pull(i, dy):  # the output adjoint of the scalar loss is the pullback's grad_scale
        _, n_valid = nb.cross_entropy_forward(i["logits"], targets)
        return {"logits": nb.cross_entropy_pullback(i["logits"], targets, n_valid, float(dy))}

    def ref(t):
        keep = torch.from_numpy(targets != -100)
        tgt = torch.from_numpy(targets.astype(np.int64))[keep]
        lg = t["logits"][keep]
        return (torch.logsumexp(lg, -1) - lg.gather(1, tgt[:, None])[:, 0]).mean()

    return Case({"logits": logits}, fwd, pull, ref, scalar_out=True)


def residual_case(rng):
    a, b = f32(rng, (3, 5, 17)), f32(rng, (3, 5, 17))

    def pull(i, dy):
        da, db = nb.residual_pullback(dy)
        return {"a": da, "b": db}

    return Case({"a": a, "b": b}, lambda i: nb.residual_forward(i["a"], i["b"]), pull,
                lambda t: t["a"] + t["b"])


# id -> builder(rng). Attention: (n_head, n_kv_head, head_dim); head_dims 12 and 20 are not
# powers of two and unrelated to any d_model / n_head.
CASES: dict[str, Callable] = {
    **{f"norm-{name}-{backend or 'no-pullback'}": (lambda r, n=name, be=backend: norm_case(r, n, be))
       for name in blocks.norms() for backend in pullback_backends(name)},
    **{f"mlp-{name}-{backend or 'no-pullback'}": (lambda r, n=name, be=backend: activation_case(r, n, be))
       for name in blocks.activations() for backend in pullback_backends(name)},
    "linear-bias": lambda r: linear_case(r, bias=True),
    "linear-nobias": lambda r: linear_case(r, bias=False),
    "embedding-token+learned-pos": lambda r: embedding_case(r, learned_positions=True),
    "embedding-token-only": lambda r: embedding_case(r, learned_positions=False),
    "rope-hd12": lambda r: rope_case(r, 12, llama3=False),
    "rope-hd20-llama3": lambda r: rope_case(r, 20, llama3=True),
    "rope-hd12-llama3": lambda r: rope_case(r, 12, llama3=True),
    "attn-mha-nh4-hd12": lambda r: attention_case(r, 4, 4, 12),
    "attn-gqa-nh4-nkv2-hd12": lambda r: attention_case(r, 4, 2, 12),
    "attn-mqa-nh4-nkv1-hd12": lambda r: attention_case(r, 4, 1, 12),
    "attn-mha-nh3-hd20": lambda r: attention_case(r, 3, 3, 20),
    "attn-gqa-nh6-nkv2-hd20": lambda r: attention_case(r, 6, 2, 20),
    # the tiled kernels: blocks of 8 query rows plus single-row tails, key tiles past the last
    # key, head dims that take each tile path at the build's vector width (AVX-512 16 floats,
    # AVX2 8, SSE and NEON 4: one tile or two, and a scalar tail)
    "attn-tiles-gqa-nh4-nkv2-hd64-T37": lambda r: attention_case(r, 4, 2, 64, B=1, T=37),
    "attn-tiles-mha-nh2-hd24-T20": lambda r: attention_case(r, 2, 2, 24, B=2, T=20),
    "attn-tiles-mha-nh2-hd6-T20": lambda r: attention_case(r, 2, 2, 6, B=1, T=20),
    "cross-entropy": lambda r: cross_entropy_case(r, n_ignored=0),
    "cross-entropy-ignored": lambda r: cross_entropy_case(r, n_ignored=4),
    "residual": residual_case,
}


def build(case_id: str) -> Case:
    seed = sum(map(ord, case_id))  # fixed per case, independent of test order
    return CASES[case_id](np.random.default_rng(seed))


def pullback_of(case: Case, case_id: str):
    if case.pull is None:
        pytest.skip(f"{case_id}: this build has no pullback for the block (a block written as its forward "
                    "only trains on the pullback a build with Clad generates)")
    return case.pull


def random_adjoint(case: Case, y, rng):
    if case.scalar_out:
        return np.float32(rng.uniform(0.5, 2.0))  # grad_scale for the loss
    return rng.standard_normal(np.shape(y)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# 1. forward vs float64 reference; pullback vs float64 autograd
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", list(CASES))
def test_forward_matches_float64_torch(case_id, needs_torch):
    case = build(case_id)
    y = case.fwd(case.inputs)
    t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in case.inputs.items()}
    ref = case.ref(t).numpy()
    assert np.shape(y) == ref.shape
    assert np.all(np.isfinite(y))
    err = rel_err(y, ref)
    assert err <= case.fwd_tol, f"{case_id}: forward rel err {err:.2e}"


@pytest.mark.parametrize("case_id", list(CASES))
def test_pullback_matches_float64_autograd(case_id, needs_torch):
    case = build(case_id)
    rng = np.random.default_rng(1)
    pull = pullback_of(case, case_id)
    dy = random_adjoint(case, case.fwd(case.inputs), rng)
    grads = pull(case.inputs, dy)
    t = {k: torch.from_numpy(v.astype(np.float64)).requires_grad_() for k, v in case.inputs.items()}
    out = case.ref(t)
    out.backward(torch.as_tensor(np.asarray(dy, dtype=np.float64)))
    assert set(grads) == set(case.inputs)
    for name, g in grads.items():
        assert g.dtype == np.float32 and g.shape == case.inputs[name].shape
        err = rel_err(g, t[name].grad.numpy())
        assert err <= PULL_TOL, f"{case_id}: d{name} rel err {err:.2e} vs autograd"


# --------------------------------------------------------------------------------------------
# 2. pullback vs float64 finite differences of zoo's own forward
# --------------------------------------------------------------------------------------------

# Central differences along random directions v, one input at a time:
#   FD = <dy, f(x+) - f(x-)>   and   AD = <pullback(dy), x+ - x->,   x+- = fp32(x +- h v),
# both accumulated in float64. Using the actually representable step x+ - x- (not 2hv) removes
# the rounding of the perturbed inputs, so what remains is
#   truncation  ~ h^2 |f'''| / 6            ~ 1e-5..1e-4 relative for h = 1e-2, O(1) inputs, and
#   rounding    ~ eps32 |y| / h             ~ 6e-8 / 1e-2 ~ 1e-5 relative (per output, random
#                                              signs of dy keep the sum at the same relative size).
# Smaller h trades truncation for fp32 rounding (measured worst case: 2.4e-4 at h=1e-2, in the
# nh=6/nkv=2 attention case; 2.9e-4 at h=1e-3, in cross-entropy). FD_TOL = 1e-2 leaves a
# margin of ~40x over that, while a wrong term in a pullback shows up as O(1) relative error
# (a pullback scaled by a mere 1.02 already fails). The autograd test above is the tight one.
# The scale is max(|AD|, |g| |x+ - x-| / sqrt(n)) -- the typical size of a random projection --
# so a direction that happens to be near-orthogonal to the gradient is not judged by an
# accidental tiny denominator.
FD_H = 1e-2
FD_TOL = 1e-2
FD_DIRECTIONS = 3


@pytest.mark.parametrize("case_id", list(CASES))
def test_pullback_matches_float64_finite_differences(case_id):
    case = build(case_id)
    rng = np.random.default_rng(2)
    pull = pullback_of(case, case_id)
    y0 = case.fwd(case.inputs)
    dy = random_adjoint(case, y0, rng)
    dy64 = np.asarray(dy, dtype=np.float64)
    grads = pull(case.inputs, dy)
    for name, x in case.inputs.items():
        g = grads[name].astype(np.float64)
        for k in range(FD_DIRECTIONS):
            v = rng.standard_normal(x.shape)
            xp = (x + FD_H * v).astype(np.float32)
            xm = (x - FD_H * v).astype(np.float32)
            fp = np.asarray(case.fwd({**case.inputs, name: xp}), dtype=np.float64)
            fm = np.asarray(case.fwd({**case.inputs, name: xm}), dtype=np.float64)
            fd = float(np.sum(dy64 * (fp - fm)))
            step = xp.astype(np.float64) - xm.astype(np.float64)
            ad = float(np.sum(g * step))
            scale = max(abs(ad), np.linalg.norm(g) * np.linalg.norm(step) / math.sqrt(x.size))
            assert scale > 0, f"{case_id}: d{name} is identically zero"
            err = abs(fd - ad) / scale
            assert err <= FD_TOL, (f"{case_id}: d{name} direction {k}: finite difference {fd:.6e} "
                                   f"vs pullback {ad:.6e} (rel {err:.2e})")


# --------------------------------------------------------------------------------------------
# Block-specific details the generic checks do not pin down
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nh,nkv,hd", [(4, 4, 12), (4, 2, 12), (4, 1, 20)])
def test_attention_saves_the_causal_log_sum_exp(nh, nkv, hd, needs_torch):
    # all the pullback keeps of the softmax: logsumexp over keys 0..t of the scaled scores
    rng = np.random.default_rng(5)
    qkv = f32(rng, (2, 19, (nh + 2 * nkv) * hd), 1.3)
    _, lse = nb.attention_forward(qkv, nh, nkv, hd)
    _, lse_ref = attention_reference(torch.from_numpy(qkv.astype(np.float64)), nh, nkv, hd)
    assert lse.shape == (2, nh, 19)
    assert rel_err(lse, lse_ref.numpy()) <= FWD_TOL


def test_attention_pullback_names_a_wrong_lse_shape():
    nh, nkv, hd = 2, 1, 8
    qkv = np.zeros((1, 5, (nh + 2 * nkv) * hd), np.float32)
    dout = np.zeros((1, 5, nh * hd), np.float32)
    with pytest.raises(ValueError, match="lse must be"):
        nb.attention_pullback(qkv, np.zeros((1, nh, 5, 5), np.float32), dout, nh, nkv, hd)
    with pytest.raises(ValueError, match="dout must be"):
        nb.attention_pullback(qkv, np.zeros((1, nh, 5), np.float32), dout[:, :4], nh, nkv, hd)


def test_attention_first_token_attends_to_itself_only():
    # causal mask: row 0 of every head is exactly its own v (the kv head of its group)
    nh, nkv, hd = 4, 2, 12
    rng = np.random.default_rng(6)
    qkv = f32(rng, (1, 5, (nh + 2 * nkv) * hd))
    out, _ = nb.attention_forward(qkv, nh, nkv, hd)
    v0 = qkv[0, 0, (nh + nkv) * hd:].reshape(nkv, hd)
    for h in range(nh):
        np.testing.assert_allclose(out[0, 0, h * hd:(h + 1) * hd], v0[h // (nh // nkv)], rtol=1e-6)


def test_cross_entropy_all_targets_ignored():
    rng = np.random.default_rng(7)
    logits = f32(rng, (4, 9))
    targets = np.full(4, -100, dtype=np.int32)
    loss, n_valid = nb.cross_entropy_forward(logits, targets)
    assert (loss, n_valid) == (0.0, 0)
    d = nb.cross_entropy_pullback(logits, targets, 0, 1.0)
    assert np.all(d == 0.0)


def test_cross_entropy_ignored_rows_get_zero_gradient():
    rng = np.random.default_rng(8)
    logits = f32(rng, (6, 9))
    targets = np.array([1, -100, 3, -100, 8, 0], dtype=np.int32)
    _, n_valid = nb.cross_entropy_forward(logits, targets)
    d = nb.cross_entropy_pullback(logits, targets, n_valid, 1.0)
    assert n_valid == 4
    assert np.all(d[targets == -100] == 0.0)
    # each counted row's adjoint (softmax - onehot) / n_valid sums to zero
    np.testing.assert_allclose(d[targets != -100].sum(-1), 0.0, atol=1e-7)


ACTIVATION_PULLBACKS = [(name, backend) for name in blocks.activations() for backend in pullback_backends(name)
                        if backend]


@pytest.mark.parametrize("name,backend", ACTIVATION_PULLBACKS)
def test_activation_pullback_from_the_recompute_equals_the_pullback(name, backend, threads):
    # the executor's MLP step: the recompute's output is the forward's (to rounding: the loops
    # vectorize differently), and its dx is the direct pullback's; rows of 67, not a multiple
    # of the vector width
    rng = np.random.default_rng(10)
    width = blocks.activations()[name]["gate_width"]
    x, dy = f32(rng, (5, width * 67), 3.0), f32(rng, (5, 67))
    y, dx = nb.activation_recompute_and_pullback(name, x, dy, backend)
    assert rel_err(y, nb.activation_forward(name, x)) <= 1e-6
    assert rel_err(dx, nb.activation_pullback(name, x, dy, backend)) <= 1e-6
    with pytest.raises(ValueError, match="activation dy must have the output's shape"):
        nb.activation_recompute_and_pullback(name, x, dy[:, :5], backend)


@pytest.mark.parametrize("name,backend", ACTIVATION_PULLBACKS)
def test_activation_saturated_tails_stay_finite(name, backend, needs_torch):
    # Inputs far out in the tails, where exp overflows a float: every output and derivative stays
    # finite (no inf / inf from a quotient rule) and matches float64 autograd.
    width = blocks.activations()[name]["gate_width"]
    tails = np.array([-200.0, -90.0, -12.0, -1.0, 0.0, 1.0, 12.0, 90.0, 200.0], np.float32)
    if width == 1:
        x = tails[None]
    else:  # one row of [gate | up]: every gate with every up
        gate, up = np.meshgrid(tails, tails, indexing="ij")
        x = np.concatenate([gate.ravel(), up.ravel()])[None]
    dy = np.ones((1, x.shape[1] // width), np.float32)
    y, dx = nb.activation_recompute_and_pullback(name, x, dy, backend)
    assert np.isfinite(y).all() and np.isfinite(dx).all()
    t = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    ref = torch_reference().MLPS[name](t)
    ref.backward(torch.ones_like(ref))
    assert rel_err(y, ref.detach().numpy()) <= FWD_TOL
    assert rel_err(dx, t.grad.numpy()) <= PULL_TOL


def test_fused_cross_entropy_equals_forward_then_pullback():
    # the executor trains with the fused kernel; the generic checks cover the separate pair
    rng = np.random.default_rng(9)
    logits = f32(rng, (7, 301), 3.0)
    targets = np.array([1, -100, 300, 0, 17, -100, 299], dtype=np.int32)
    loss, n_valid = nb.cross_entropy_forward(logits, targets)
    fused_loss, counted, d = nb.cross_entropy_forward_pullback(logits, targets, n_valid, 0.5)
    assert counted == n_valid == 5
    assert abs(fused_loss - loss) <= 1e-6 * abs(loss)
    assert rel_err(d, nb.cross_entropy_pullback(logits, targets, n_valid, 0.5)) <= 1e-6


def test_cross_entropy_names_a_target_outside_the_vocabulary():
    logits = np.zeros((2, 5), np.float32)
    for bad in (5, -1):
        with pytest.raises(ValueError, match=f"target id {bad} outside the vocabulary"):
            nb.cross_entropy_forward_pullback(logits, np.array([0, bad], np.int32), 2, 1.0)
    with pytest.raises(ValueError, match="targets"):
        nb.cross_entropy_forward(logits, np.zeros(3, np.int32))


def test_llama3_inv_freq_matches_definition():
    """zoo.model.rope_inv_freq (float32) against the llama3 rule written here in float64."""
    for hd in (12, 20):
        cfg = rope_config(hd, llama3=True)
        s = cfg.rope_scaling
        base = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
        wavelen = 2 * math.pi / base
        low_wl = s.original_max_position_embeddings / s.low_freq_factor
        high_wl = s.original_max_position_embeddings / s.high_freq_factor
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        ref = np.where(wavelen < high_wl, base,
                       np.where(wavelen > low_wl, base / s.factor,
                                (1 - smooth) * base / s.factor + smooth * base))
        # the case exercises all three regimes
        assert (wavelen < high_wl).any() and (wavelen > low_wl).any()
        assert ((wavelen >= high_wl) & (wavelen <= low_wl)).any()
        got = rope_inv_freq(cfg)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, ref, rtol=1e-6)
        plain = rope_inv_freq(rope_config(hd, llama3=False))
        np.testing.assert_allclose(plain, 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd), rtol=1e-6)


# --------------------------------------------------------------------------------------------
# AdamW against torch.optim.AdamW
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 6])
@pytest.mark.parametrize("weight_decay,decay", [(0.0, True), (0.1, True), (0.1, False)],
                         ids=["wd0", "wd0.1", "wd0.1-nodecay"])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
@pytest.mark.parametrize("eps", [1e-8, 1e-3])
def test_adamw_matches_torch(steps, weight_decay, decay, grad_scale, eps, needs_torch):
    lr, b1, b2 = 1e-2, 0.9, 0.95
    rng = np.random.default_rng(9)
    n = 1000
    p0 = f32(rng, n)
    # gradient magnitudes from 1e-4 to 1 so eps=1e-3 matters for some elements
    mag = 10.0 ** rng.uniform(-4, 0, n)
    grads = [(mag * rng.standard_normal(n)).astype(np.float32) for _ in range(steps)]

    p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    for s, g in enumerate(grads, start=1):
        nb.adamw_update(p, g, m, v, lr, b1, b2, eps, weight_decay, s, decay, grad_scale)

    tp = torch.nn.Parameter(torch.from_numpy(p0.astype(np.float64)))
    opt = torch.optim.AdamW([tp], lr=lr, betas=(b1, b2), eps=eps,
                            weight_decay=weight_decay if decay else 0.0)
    for g in grads:
        tp.grad = torch.from_numpy(g.astype(np.float64)) * grad_scale
        opt.step()
    st = opt.state[tp]
    p_ref = tp.detach().numpy()
    # compare the total update (p - p0), not p itself: an O(lr) error must not hide under |p|
    err = rel_err(p.astype(np.float64) - p0, p_ref - p0)
    assert err <= 1e-4, f"update rel err {err:.2e}"
    assert rel_err(m, st["exp_avg"].numpy()) <= 1e-5
    assert rel_err(v, st["exp_avg_sq"].numpy()) <= 1e-5


# --- any registered block by name (registry.hpp): what a new block's tests call ----------------


def test_exact_gelu_keeps_its_relative_accuracy_in_the_negative_tail():
    # x Phi(x) with Phi from its own tail's erfc: 0.5 x (1 + erf(x / sqrt 2)) cancels to zero
    # (relative error 1) for outputs below about 1e-7 in size, from x = -5.5 on.
    x = np.linspace(-9.0, 9.0, 3601, dtype=np.float32)[None]
    x64 = x.astype(np.float64)
    phi = np.vectorize(lambda v: 0.5 * math.erfc(-v / math.sqrt(2.0)))(x64)
    y = nb.activation_forward("gelu_erf", x).astype(np.float64)
    nonzero = x64 != 0.0
    assert np.max(np.abs(y - x64 * phi)[nonzero] / np.abs(x64 * phi)[nonzero]) <= 1e-4
    dx = nb.activation_pullback("gelu_erf", x, np.ones_like(x)).astype(np.float64)
    assert np.max(np.abs(dx - (phi + x64 * np.exp(-0.5 * x64 * x64) / math.sqrt(2.0 * math.pi)))) <= 1e-6


def test_activations_by_name_check_their_arguments():
    rng = np.random.default_rng(7)
    x, dy = rng.standard_normal((5, 24)).astype(np.float32), rng.standard_normal((5, 24)).astype(np.float32)
    for name, info in blocks.activations().items():
        if pullback_backends(name) == [None]:
            with pytest.raises(ValueError, match=f"block {name} has no manual pullback"):
                nb.activation_pullback(name, x, dy)
        if info["gate_width"] == 2:  # rows of [gate | up]
            with pytest.raises(ValueError, match=rf"activation {name} x: rows of \[gate \| up\], the last dimension "
                                                 "must be even, got 5"):
                nb.activation_forward(name, x[:, :5])
    with pytest.raises(ValueError, match="backend is 'manual' or 'clad'"):
        nb.activation_pullback("gelu", x, dy, "autograd")
    registered = ", ".join(blocks.activations())
    with pytest.raises(ValueError, match=f"mlp='no_such_activation' is no registered block; registered: {registered}$"):
        nb.activation_forward("no_such_activation", x)


def test_geglu_is_gelu_gating_up():
    # Gemma's MLP: down(gelu_tanh(gate) * up), zoo's gelu (GPT-2's tanh approximation) as the gate
    rng = np.random.default_rng(11)
    gate, up = f32(rng, (6, 40), 3.0), f32(rng, (6, 40))
    y = nb.activation_forward("geglu", np.concatenate([gate, up], -1))
    assert rel_err(y, nb.activation_forward("gelu", gate) * up) <= 1e-6


def test_registered_norms_by_name_check_their_arguments():
    rng = np.random.default_rng(8)
    x, w = rng.standard_normal((4, 16)).astype(np.float32), np.ones(16, np.float32)
    y, stats = nb.norm_forward("layernorm", x, w, np.zeros(16, np.float32), 1e-5)
    # the statistics LayerNorm saves, per row: mean and 1 / sqrt(var + eps)
    x64 = x.astype(np.float64)
    mean, rstd = x64.mean(-1), 1 / np.sqrt(x64.var(-1) + 1e-5)
    assert rel_err(stats, np.stack([mean, rstd])) <= 1e-6
    assert rel_err(y, (x64 - mean[:, None]) * rstd[:, None]) <= 1e-6
    with pytest.raises(ValueError, match="norm rmsnorm has no bias"):
        nb.norm_forward("rmsnorm", x, w, w, 1e-5)
    with pytest.raises(ValueError, match=r"norm layernorm stats must be \(2, rows of x\)"):
        nb.norm_pullback("layernorm", x, w, w * 0, stats[:1], x, 1e-5)
    with pytest.raises(ValueError, match="norm dy must have the input's shape"):
        nb.norm_pullback("layernorm", x, w, w * 0, stats, x[:2], 1e-5)
