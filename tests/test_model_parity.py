"""Whole-model parity against the independent PyTorch reference in zoo/tools/torch_reference.py."""

import math

import numpy as np
import pytest

import zoo
from zoo import ModelConfig, RopeScaling

torch = pytest.importorskip("torch")
from zoo.tools.torch_reference import Reference  # noqa: E402

GPT2_TINY = ModelConfig(vocab_size=97, max_seq_len=32, d_model=48, n_layer=2, n_head=4, d_ff=96)
LLAMA_TINY = ModelConfig(
    vocab_size=101, max_seq_len=64, d_model=48, n_layer=2, n_head=6, n_kv_head=2, head_dim=12, d_ff=80,
    norm="rmsnorm", mlp="swiglu", positions="rope", rope_theta=500000.0, attention_bias=False,
    mlp_bias=False, tied_embeddings=False,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16),
)
MIXED = ModelConfig(  # GPT-2 naming with RoPE? no: RoPE => Llama naming; LayerNorm+GELU+biases there
    vocab_size=64, max_seq_len=32, d_model=32, n_layer=2, n_head=4, n_kv_head=1, d_ff=64,
    norm="layernorm", mlp="gelu", positions="rope", attention_bias=True, mlp_bias=True,
    tied_embeddings=True,
)
GPT2_SWIGLU_RMS = ModelConfig(vocab_size=64, max_seq_len=32, d_model=32, n_layer=1, n_head=2, n_kv_head=2,
                              d_ff=40, norm="rmsnorm", mlp="swiglu", positions="learned",
                              attention_bias=False, mlp_bias=True, tied_embeddings=False)

# A vocabulary large enough that the LM head runs in several chunks of rows.
BIG_VOCAB = ModelConfig(vocab_size=300_007, max_seq_len=32, d_model=16, n_layer=1, n_head=2, d_ff=32)

CONFIGS = {"gpt2": GPT2_TINY, "big_vocab_chunked_head": BIG_VOCAB, "llama_gqa_llama3rope": LLAMA_TINY, "rope_layernorm_gelu_mqa": MIXED,
           "learned_rmsnorm_swiglu": GPT2_SWIGLU_RMS}


def _randomize(model: zoo.Model, seed: int):
    # Non-trivial norms and biases so every gradient path is exercised.
    rng = np.random.default_rng(seed)
    for name, v in model.parameters().items():
        if v.ndim == 1:
            v[...] = (1.0 if "norm" in name or "ln" in name else 0.0) + 0.1 * rng.standard_normal(v.shape)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "checkpointed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_grads_match_reference(name, checkpointing):
    cfg = CONFIGS[name]
    model = zoo.Model(cfg, seed=1, checkpointing=checkpointing)
    _randomize(model, 2)
    rng = np.random.default_rng(3)
    B, T = 3, min(cfg.max_seq_len, 20)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    targets[0, :3] = -100  # ignored positions
    ref = Reference(cfg, model.parameters())

    logits = model.logits(tokens)
    ref_logits = ref.logits(tokens).detach().numpy()
    assert np.abs(logits - ref_logits).max() <= 1e-4

    loss, grads = model.loss_and_grads(tokens, targets)
    ref_loss, ref_grads = ref.loss_and_grads(tokens, targets)
    assert abs(loss - ref_loss) <= 1e-5
    assert set(grads) == set(ref_grads)
    for k in grads:
        err = np.abs(grads[k] - ref_grads[k]).max() / (np.abs(ref_grads[k]).max() + 1e-12)
        assert err <= 1e-3, f"{k}: relative error {err:.2e}"


def test_bad_token_ids_are_clear_errors():
    model = zoo.Model(GPT2_TINY, seed=0)
    ok = np.zeros((2, 8), dtype=np.int64)
    for tokens, targets, message in [
        (ok + 97, ok, "tokens hold id 97 outside the vocabulary"),
        (ok - 1, ok, "tokens hold id -1"),
        (ok + 2**32 + 3, ok, "tokens hold id 4294967299"),  # would wrap to 3 as int32
        (ok, ok - 5, "targets hold id -5"),  # only -100 is the ignore index
        (ok, ok + 97, "targets hold id 97"),
    ]:
        with pytest.raises(ValueError, match=message):
            model.loss(tokens, targets)
    with pytest.raises(ValueError, match="2-D"):
        model.logits(np.zeros(8, dtype=np.int64))
    with pytest.raises(TypeError, match="integers"):
        model.logits(np.zeros((2, 8), dtype=np.float32))
    assert np.isfinite(model.loss(ok, ok - 100 * (ok == 0)))  # all ignored: a defined loss


def test_checkpointing_shrinks_activation_memory():
    from zoo.model import activation_bytes

    cfg = zoo.preset("gpt2")
    assert activation_bytes(cfg, 4, 64, checkpointing=True) * 3 <= activation_bytes(cfg, 4, 64)


def test_gradient_accumulation_adds():
    model = zoo.Model(GPT2_TINY, seed=0)
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 97, (2, 8))
    _, g = model.loss_and_grads(tok, tok)
    model.zero_grads()
    model.forward_backward(tok, tok, grad_scale=0.5)
    model.forward_backward(tok, tok, grad_scale=0.5)
    for k, v in model.gradients().items():
        np.testing.assert_allclose(v, g[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa_llama3rope", "learned_rmsnorm_swiglu"])
def test_gradients_after_an_optimizer_step_are_fresh(name):
    # After adamw_step the next pullbacks write the gradients instead of adding into zeroed
    # ones: every parameter's gradient must equal a fresh model's at the same weights.
    cfg = CONFIGS[name]
    rng = np.random.default_rng(6)
    tok = rng.integers(0, cfg.vocab_size, (2, 12))
    stepped = zoo.Model(cfg, seed=2)
    stepped.forward_backward(tok, tok)
    stepped.adamw_step(1e-2, weight_decay=0.1, max_grad_norm=1.0)
    fresh = zoo.Model(cfg, seed=None)
    for k, v in stepped.parameters().items():
        fresh.parameters()[k][...] = v
    loss, grads = stepped.loss_and_grads(tok[:, ::-1], tok)
    ref_loss, ref_grads = fresh.loss_and_grads(tok[:, ::-1], tok)
    assert loss == ref_loss
    for k in grads:
        np.testing.assert_array_equal(grads[k], ref_grads[k], err_msg=k)
    # and accumulation after a step: two half-scaled micro-batches add up to one
    stepped.adamw_step(1e-2)
    stepped.forward_backward(tok, tok, grad_scale=0.5)
    stepped.forward_backward(tok, tok, grad_scale=0.5)
    fresh2 = zoo.Model(cfg, seed=None)
    for k, v in stepped.parameters().items():
        fresh2.parameters()[k][...] = v
    _, ref = fresh2.loss_and_grads(tok, tok)
    for k, v in stepped.gradients().items():
        np.testing.assert_allclose(v, ref[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_cached_generation_matches_full_forward():
    for cfg in (GPT2_TINY, LLAMA_TINY):
        model = zoo.Model(cfg, seed=4)
        rng = np.random.default_rng(5)
        tokens = rng.integers(0, cfg.vocab_size, (2, 12))
        full = model.logits(tokens)
        model.reset_cache(2, 16)
        first = model.forward_cached(tokens[:, :7], 0)
        np.testing.assert_allclose(first, full[:, 6], atol=1e-4)
        for t in range(7, 12):
            step = model.forward_cached(tokens[:, t:t + 1], t)
            np.testing.assert_allclose(step, full[:, t], atol=1e-4)


def _numpy_norm(model):
    return math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in model.gradients().values()))


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa_llama3rope", "learned_rmsnorm_swiglu"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_clipping_norm_is_the_norm_of_every_gradient(name, checkpointing):
    # The first forward_backward of a step sums the squared gradients layer by layer as the
    # pullbacks write them; accumulation afterwards falls back to a full pass. Both must be
    # the norm of the whole gradient arena, and adamw_step must clip with it.
    cfg = CONFIGS[name]
    rng = np.random.default_rng(8)
    tok = rng.integers(0, cfg.vocab_size, (2, 11))
    model = zoo.Model(cfg, seed=3, checkpointing=checkpointing)
    model.zero_grads()
    model.forward_backward(tok, tok)
    assert model.grad_norm() == pytest.approx(_numpy_norm(model), rel=1e-5)
    model.forward_backward(tok[:, ::-1], tok)
    accumulated = _numpy_norm(model)
    assert model.grad_norm() == pytest.approx(accumulated, rel=1e-5)
    assert model.adamw_step(1e-3, max_grad_norm=0.5) == pytest.approx(accumulated, rel=1e-5)
    # adamw_step consumed the gradients: they read zero, and the next step adds into them
    assert _numpy_norm(model) == 0.0
    model.forward_backward(tok, tok[:, ::-1])  # a fresh step after the optimizer's
    fresh = _numpy_norm(model)
    assert model.grad_norm() == pytest.approx(fresh, rel=1e-5)
    assert model.adamw_step(1e-3, max_grad_norm=0.5) == pytest.approx(fresh, rel=1e-5)


def test_gradient_views_are_read_only():
    model = zoo.Model(CONFIGS["gpt2"], seed=0)
    grad = next(iter(model.gradients().values()))
    with pytest.raises(ValueError, match="read-only"):
        grad[...] = 0.0
