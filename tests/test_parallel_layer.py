"""The parallel-residual layer (ModelConfig(layer="parallel"), native/layers/parallel.hpp):
out = x + attn(norm(x)) + mlp(norm(x)), one norm per layer, chained by hand by the executor in
every build, and in a Clad build also written as a forward over block calls whose pullback Clad
generates by chaining the blocks' pullbacks (ad={"parallel": "clad"}, or ad="clad").

Its layout has no second norm, it runs forward (logits against an independent PyTorch model
written here, KV-cache generation) and refuses Hugging Face export. It trains: every gradient
against the PyTorch model and against central differences, on each backend the build has (the
hand-written block pullbacks and Clad's, the hand chain and Clad's), with activation
checkpointing and in bf16. The two-norm form (GPT-NeoX) is tested with the other variants
(tests/test_variants.py) and against transformers (tests/test_families.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import BF16, CLAD, installed, needs, rel_err

import zoo
from zoo import ModelConfig
from zoo.arch.layout import num_parameters
from zoo.core.errors import CheckpointError
from zoo.generate import generate
from zoo.io.gguf import save_gguf
from zoo.io.hf_config import config_to_hf, hf_incompatibility
from zoo.model import ADError

if installed("torch"):
    import torch
    import torch.nn.functional as F

TRAINS = zoo.core.blocks.layers()["parallel"]["trainable"]
trains = pytest.mark.skipif(not TRAINS, reason="the parallel layer has no pullback in this build (a Clad build "
                                               "chains one: `make test-clad`, docs/clad.md)")
BACKENDS = ["manual"] + (["clad"] if CLAD else [])

GPT2_PARALLEL = ModelConfig(vocab_size=97, max_seq_len=32, d_model=48, n_layer=2, n_head=4, d_ff=96,
                            layer="parallel")
LLAMA_PARALLEL = ModelConfig(vocab_size=101, max_seq_len=40, d_model=48, n_layer=2, n_head=6, n_kv_head=2,
                             head_dim=12, d_ff=80, norm="rmsnorm", mlp="swiglu", positions="rope",
                             rope_theta=10000.0, attention_bias=False, mlp_bias=False, tied_embeddings=False,
                             layer="parallel")
CONFIGS = pytest.mark.parametrize("cfg", [GPT2_PARALLEL, LLAMA_PARALLEL], ids=["gpt2", "llama"])


def make_model(cfg: ModelConfig, seed: int = 0, **kwargs) -> zoo.Model:
    """Non-trivial norms and biases, and larger weights than the init, so every path carries signal."""
    model = zoo.Model(cfg, seed=seed, **kwargs)
    rng = np.random.default_rng(seed + 100)
    for name, v in model.parameters().items():
        if v.ndim == 1:
            v[...] = (1.0 if ("ln" in name or "norm" in name) else 0.0) + 0.2 * rng.standard_normal(v.shape)
        else:
            v[...] = 0.1 * rng.standard_normal(v.shape)
    return model


def batch(cfg: ModelConfig, B: int = 2, T: int = 24, seed: int = 3):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    targets[0, :3] = -100
    return tokens, targets


# --- the reference: a parallel-residual transformer in PyTorch, float64 -------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_loss(cfg: ModelConfig, params: dict[str, torch.Tensor], tokens, targets) -> torch.Tensor:
    """The mean next-token loss of cfg's parallel-residual model, by Hugging Face names: GPT-2's
    (LayerNorm, GELU-tanh, learned positions, fused c_attn) or Llama's (RMSNorm, SwiGLU, RoPE,
    grouped k/v heads)."""
    p = params
    tok = torch.as_tensor(tokens)
    B, T = tok.shape
    D, H, KV, hd = cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim
    gpt2 = cfg.family == "gpt2"

    def norm(x, prefix):
        if gpt2:
            return F.layer_norm(x, (D,), p[prefix + ".weight"], p[prefix + ".bias"], cfg.norm_eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * p[prefix + ".weight"]

    if gpt2:
        x = p["transformer.wte.weight"][tok] + p["transformer.wpe.weight"][:T]
    else:
        x = p["model.embed_tokens.weight"][tok]
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.n_layer):
        if gpt2:
            pre = f"transformer.h.{i}."
            h = norm(x, pre + "ln_1")
            qkv = h @ p[pre + "attn.c_attn.weight"].T + p[pre + "attn.c_attn.bias"]
            q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
        else:
            pre = f"model.layers.{i}."
            h = norm(x, pre + "input_layernorm")
            q = h @ p[pre + "self_attn.q_proj.weight"].T
            k = h @ p[pre + "self_attn.k_proj.weight"].T
            v = h @ p[pre + "self_attn.v_proj.weight"].T
        q = q.view(B, T, H, hd).transpose(1, 2)
        k = k.view(B, T, KV, hd).transpose(1, 2).repeat_interleave(H // KV, dim=1)
        v = v.view(B, T, KV, hd).transpose(1, 2).repeat_interleave(H // KV, dim=1)
        if not gpt2:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
        att = att.transpose(1, 2).reshape(B, T, H * hd)
        if gpt2:
            attn_out = att @ p[pre + "attn.c_proj.weight"].T + p[pre + "attn.c_proj.bias"]
            fc = h @ p[pre + "mlp.c_fc.weight"].T + p[pre + "mlp.c_fc.bias"]
            mlp_out = F.gelu(fc, approximate="tanh") @ p[pre + "mlp.c_proj.weight"].T + p[pre + "mlp.c_proj.bias"]
        else:
            attn_out = att @ p[pre + "self_attn.o_proj.weight"].T
            gate, up = h @ p[pre + "mlp.gate_proj.weight"].T, h @ p[pre + "mlp.up_proj.weight"].T
            mlp_out = (F.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
        x = x + attn_out + mlp_out  # the parallel residual: both branches read h = norm(x)
    if gpt2:
        logits = norm(x, "transformer.ln_f") @ p["transformer.wte.weight"].T
    else:
        logits = norm(x, "model.norm") @ p["lm_head.weight"].T
    return F.cross_entropy(logits.reshape(B * T, -1), torch.as_tensor(targets).reshape(-1), ignore_index=-100)


def reference_loss_and_grads(model: zoo.Model, tokens, targets):
    params = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in model.parameters().items()}
    loss = reference_loss(model.config, params, tokens, targets)
    loss.backward()
    return loss.item(), {k: t.grad.numpy() for k, t in params.items()}


# --- any build -------------------------------------------------------------------------------


@CONFIGS
def test_layout_has_one_norm_per_layer(cfg):
    names = list(zoo.Model(cfg, seed=0).parameters())
    assert not [n for n in names if "ln_2" in n or "post_attention_layernorm" in n]
    assert sum("ln_1.weight" in n or "input_layernorm.weight" in n for n in names) == cfg.n_layer
    sequential = cfg.model_copy(update={"layer": "sequential"})
    assert num_parameters(cfg) == num_parameters(sequential) - cfg.n_layer * cfg.d_model * (
        2 if cfg.norm == "layernorm" else 1)
    plan = {b["name"] for b in zoo._native.activation_plan(cfg.model_dump(), 2, 8)}
    assert not plan & {"layer0.res_mid", "layer0.ln2_stats"} and "layer0.qkv" in plan


def test_unknown_layer_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"layer\n.*'interleaved' is no layer arrangement of this zoo; "
                                         r"registered: sequential, parallel"):
        ModelConfig(vocab_size=10, max_seq_len=8, d_model=8, n_layer=1, n_head=2, layer="interleaved")


@needs("torch")
@CONFIGS
def test_forward_matches_the_reference(cfg):
    model = make_model(cfg)
    tokens, targets = batch(cfg)
    ref, _ = reference_loss_and_grads(model, tokens, targets)
    assert abs(model.loss(tokens, targets) - ref) <= 1e-5 * abs(ref)


@CONFIGS
def test_generation_with_the_kv_cache_matches_the_full_forward(cfg):
    model = make_model(cfg)
    tokens, _ = batch(cfg, B=2, T=12)
    full = model.logits(tokens)
    model.reset_cache(2, 16)
    prompt = model.forward_cached(tokens[:, :8], 0)  # last-position logits of the prompt
    assert rel_err(prompt, full[:, 7]) <= 1e-5
    for t in range(8, 12):
        step = model.forward_cached(tokens[:, t:t + 1], t)
        assert rel_err(step, full[:, t]) <= 1e-5
    assert len(generate(model, [1, 2, 3], max_new_tokens=5)) == 5


def test_the_block_profile_sees_inside_the_layer():
    model = make_model(GPT2_PARALLEL)
    tokens, targets = batch(GPT2_PARALLEL)
    model.set_profiling(True)
    model.loss(tokens, targets)
    if TRAINS:
        model.forward_backward(tokens, targets)
    profile = model.block_profile()
    for kind in ("norm", "linear", "attention", "activation"):
        forward, pullback = profile[kind]
        assert forward > 0 and (pullback > 0) == TRAINS, (kind, profile[kind])


def test_hugging_face_export_is_refused_naming_the_field(tmp_path):
    for cfg in (GPT2_PARALLEL, LLAMA_PARALLEL):
        assert hf_incompatibility(cfg)[0] == "layer"
        with pytest.raises(CheckpointError, match="layer"):
            config_to_hf(cfg)
    # save_pretrained writes zoo's own config.json (with a warning) and zoo loads it back
    model = make_model(GPT2_PARALLEL)
    with pytest.warns(UserWarning, match="layer='parallel'"):
        model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="layer"):  # llama.cpp's architectures are sequential too
        save_gguf(model, tmp_path / "model.gguf")
    back = zoo.Model.from_pretrained(tmp_path / "ckpt")
    assert back.config == GPT2_PARALLEL
    tokens, _ = batch(GPT2_PARALLEL)
    np.testing.assert_array_equal(back.logits(tokens), model.logits(tokens))


def test_clads_chaining_over_a_frozen_base_is_refused_naming_the_layer():
    """The hand-chained layer trains a frozen base (LoRA: tests/test_variants.py); the Clad-chained
    one reads fp32 weights and knows no adapters, and says so."""
    if not CLAD:
        with pytest.raises(ADError, match="built without the Clad backend"):
            zoo.Model(GPT2_PARALLEL, seed=0, ad={"parallel": "clad"})
        return
    with pytest.raises(ValueError, match=r"layer='parallel' on Clad's chaining runs on a trainable fp32 base only"):
        zoo.Model(GPT2_PARALLEL, seed=0, lora=zoo.LoraConfig(r=2), base_dtype="fp32", ad={"parallel": "clad"})


# --- where it trains ------------------------------------------------------------------------------


@trains
@needs("torch")
@CONFIGS
@pytest.mark.parametrize("ad", BACKENDS)
def test_gradients_match_the_reference(cfg, ad):
    model = make_model(cfg, ad=ad)
    tokens, targets = batch(cfg)
    loss, grads = model.loss_and_grads(tokens, targets)
    ref_loss, ref = reference_loss_and_grads(model, tokens, targets)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert set(grads) == set(ref)
    errs = {k: rel_err(grads[k], ref[k]) for k in ref}
    assert max(errs.values()) <= 1e-3, errs


@trains
@CONFIGS
def test_gradients_match_central_differences(cfg):
    """Directional derivatives, per tensor and over all of them: the loss's central difference
    along a random direction against the gradient's dot product with it. float32 losses: the
    step is sized so rounding (1e-7 of the loss) stays far below the tolerance."""
    model = make_model(cfg)
    tokens, targets = batch(cfg, B=2, T=12)
    _, grads = model.loss_and_grads(tokens, targets)
    params = model.parameters()
    rng = np.random.default_rng(7)
    directions = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    groups = [[k] for k in params] + [list(params)]
    for group in groups:
        dot = sum(float(np.dot(grads[k].ravel().astype(np.float64), directions[k].ravel())) for k in group)
        norm = math.sqrt(sum(float(np.square(directions[k]).sum()) for k in group))
        eps = 3e-3 / norm
        saved = {k: params[k].copy() for k in group}
        losses = []
        for sign in (1, -1):
            for k in group:
                params[k][...] = saved[k] + sign * eps * directions[k]
            losses.append(model.loss(tokens, targets))
        for k in group:
            params[k][...] = saved[k]
        fd = (losses[0] - losses[1]) / (2 * eps)
        scale = max(abs(dot), 1e-2 * math.sqrt(sum(float(np.square(grads[k]).sum()) for k in group)) * norm)
        rounding = 4 * 6e-8 * abs(losses[0]) / (2 * eps)  # the float32 losses' rounding, through the quotient
        assert abs(fd - dot) <= 2e-2 * scale + rounding, (group if len(group) == 1 else "all", fd, dot)


@trains
@CONFIGS
def test_checkpointing_and_backends_give_the_same_gradients(cfg):
    tokens, targets = batch(cfg)
    _, base = make_model(cfg).loss_and_grads(tokens, targets)
    for kwargs in ({"ad": "clad"}, {"ad": {"attention": "clad", "linear": "clad"}}) if CLAD else ():
        _, grads = make_model(cfg, **kwargs).loss_and_grads(tokens, targets)
        assert max(rel_err(grads[k], base[k]) for k in base) <= 1e-4, kwargs
    model = make_model(cfg)
    model.set_checkpointing(True)
    _, ckpt = model.loss_and_grads(tokens, targets)
    assert max(rel_err(ckpt[k], base[k]) for k in base) <= 1e-6


@trains
@CONFIGS
def test_the_plan_keeps_every_buffer_the_layer_reads_live(cfg):
    """Dead activation memory filled with NaN at each phase boundary: a buffer the Clad-chained
    pullback reads outside its declared phases would turn the gradients into NaN."""
    tokens, targets = batch(cfg)
    results = []
    for poison in (False, True):
        model = make_model(cfg)
        model._exec.set_poison_dead_buffers(poison)
        results.append(model.loss_and_grads(tokens, targets))
    (loss, grads), (poisoned_loss, poisoned) = results
    assert poisoned_loss == loss
    for k in grads:
        np.testing.assert_array_equal(poisoned[k], grads[k])


@trains
@CONFIGS
def test_packed_rows_and_accumulation(cfg):
    """Two examples packed in one row (positions restart) train as the same two examples in two
    rows; a second pass without zero_grads adds (the gradient lifecycle's add mode)."""
    model = make_model(cfg)
    tokens, targets = batch(cfg, B=2, T=12)
    packed_loss, packed = model.loss_and_grads(tokens.reshape(1, 24), targets.reshape(1, 24),
                                               positions=np.tile(np.arange(12), 2).reshape(1, 24))
    loss, rows = model.loss_and_grads(tokens, targets)
    assert abs(packed_loss - loss) <= 1e-6 * abs(loss)
    assert max(rel_err(packed[k], rows[k]) for k in rows) <= 1e-5
    model.forward_backward(tokens, targets)  # adds onto the gradients of loss_and_grads
    assert max(rel_err(model.gradients()[k], 2 * rows[k]) for k in rows) <= 1e-6


@trains
@pytest.mark.skipif(not BF16, reason="no bf16 dot products on this CPU")
@CONFIGS
def test_bf16_gradients_stay_near_fp32(cfg):
    tokens, targets = batch(cfg)
    _, base = make_model(cfg).loss_and_grads(tokens, targets)
    _, bf16 = make_model(cfg, precision="bf16").loss_and_grads(tokens, targets)
    errors = {k: rel_err(bf16[k], base[k]) for k in base}
    assert max(errors.values()) <= 3e-2
    assert min(errors.values()) > 1e-4, errors  # bf16's error in every gradient, not fp32's


@trains
@CONFIGS
def test_trains(cfg):
    model = zoo.Model(cfg, seed=0)
    tokens, _ = batch(cfg, B=4, T=16)
    targets = np.roll(tokens, -1, axis=1)
    first = None
    for _ in range(15):
        model.zero_grads()
        loss = model.forward_backward(tokens, targets)
        model.adamw_step(lr=3e-3)
        first = loss if first is None else first
    assert loss < 0.8 * first
    assert zoo.core.blocks.layers()["parallel"] == {"second_norm": False, "parallel": True, "trainable": True}


def test_bench_layer_prints_a_table_and_writes_json(tmp_path, capsys):
    from zoo.tools import bench_layer

    out = tmp_path / "layer.json"
    argv = ["--preset", "tiny-llama", "--n-layer", "1", "--vocab-size", "64", "--batch-size", "2", "--seq-len", "8",
            "--threads", "1", "--rounds", "1", "--json", str(out)]
    assert bench_layer.main(argv) == 0
    table = capsys.readouterr().out
    assert "| parallel (hand-chained) | manual |" in table
    rows = json.loads(out.read_text())["results"][0]["rows"]
    want = [("sequential", "manual", "hand"), ("parallel", "manual", "hand")]
    if CLAD:  # and the Clad-chained layer, over either backend's block pullbacks
        assert "| parallel (chained by Clad) | manual |" in table and "| sequential (hand-chained) | clad |" in table
        want += [("parallel", "manual", "clad"), ("sequential", "clad", "hand"), ("parallel", "clad", "clad")]
    assert [(r["layer"], r["ad"], r["chain"]) for r in rows] == want
    assert all(r["step_ms"] > 0 and r["forward_ms"] > 0 for r in rows)
