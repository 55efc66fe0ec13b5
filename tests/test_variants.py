"""The options of the Llama variants (ModelConfig: q/k norms, post-branch norms, sliding windows,
NoPE layers, the Granite and Gemma scales, the (1 + w) norm), alone and mixed, against the
independent PyTorch reference (zoo/tools/torch_reference.py): logits in fp32, gradients against
float64, with and without activation checkpointing, and generation against the full forward."""

import math

import numpy as np
import pytest
from helpers import needs, needs_bf16, needs_clad, random_batch, randomize_norms

import zoo
from zoo import ModelConfig

LLAMA = dict(vocab_size=61, max_seq_len=32, d_model=32, n_layer=3, n_head=4, n_kv_head=2, d_ff=48, norm="rmsnorm",
             mlp="swiglu", positions="rope", attention_bias=False, mlp_bias=False, tied_embeddings=False,
             rope_theta=500.0)

VARIANTS = {
    "qkv_bias_only": dict(attention_bias=True, attention_out_bias=False),
    "qk_norm_head_wide_heads": dict(qk_norm="head", head_dim=16),
    "qk_norm_projection_post_norms": dict(qk_norm="projection", branch_norms="post"),
    "window_on_two_layers": dict(sliding_window=5, sliding_layers=(0, 2)),
    "window_everywhere_gqa": dict(sliding_window=3, n_kv_head=1),
    "nope_layer": dict(nope_layers=(1,)),
    "granite_scales": dict(embedding_scale=3.0, residual_scale=0.3, attention_scale=0.2, logit_scale=0.25,
                           tied_embeddings=True),
    "gemma_like": dict(norm="rmsnorm_1p", mlp="geglu", embedding_scale=math.sqrt(32), branch_norms="both",
                       qk_norm="head", sliding_window=4, sliding_layers=(0, 2), head_dim=16, tied_embeddings=True,
                       attention_scale=0.125),
    "post_norms_residual_scale_layernorm": dict(norm="layernorm", branch_norms="both", residual_scale=0.5,
                                                attention_bias=True, mlp_bias=True),
    # Scores and logits large enough that both caps bite (checked below), two RoPE tables.
    "gemma2_like_softcaps": dict(norm="rmsnorm_1p", mlp="geglu", embedding_scale=8.0, branch_norms="both",
                                 attention_softcap=0.3, logit_softcap=0.25, sliding_window=4, sliding_layers=(0, 2),
                                 sliding_rope_theta=10.0, attention_scale=4.0, tied_embeddings=True),
    "partial_rotary": dict(rotary_dim=4, head_dim=16),
    # Every option the fused decode step computes at once (Qwen3's q/k norm per head, a window
    # with its own RoPE table, a NoPE layer, partial rotary, the embedding and attention scales,
    # the score cap).
    "fused_decode_options": dict(qk_norm="head", head_dim=16, rotary_dim=8, sliding_window=5, sliding_layers=(0,),
                                 sliding_rope_theta=10.0, nope_layers=(2,), embedding_scale=2.0, attention_scale=0.2,
                                 attention_softcap=2.0),
    "parallel_one_norm_gelu_erf": dict(layer="parallel", norm="layernorm", mlp="gelu_erf", attention_bias=True,
                                       mlp_bias=True, rotary_dim=2),
    "parallel_two_norms_neox_like": dict(layer="parallel_two_norms", norm="layernorm", mlp="gelu_erf",
                                         attention_bias=True, mlp_bias=True, rotary_dim=2, n_kv_head=4),
}


def config(name: str) -> ModelConfig:
    return ModelConfig(**{**LLAMA, **VARIANTS[name]})


def model_of(name: str, **kw) -> zoo.Model:
    cfg = config(name)
    model = zoo.Model(cfg, seed=1, **kw)
    randomize_norms(model, 2, scale=0.3)
    if cfg.norm == "rmsnorm_1p":  # its weights sit around 0, and near -1 the (1 + w) matters most
        for k, v in model.parameters().items():
            if "norm" in k:
                v[...] -= 1.0 if "q_norm" not in k else 0.5
    return model


@needs("torch")
@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "checkpointed"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_and_gradients_match_the_reference(name, checkpointing):
    import torch

    from zoo.tools.torch_reference import Reference

    model = model_of(name, checkpointing=checkpointing)
    cfg = model.config
    tokens, targets = random_batch(cfg, B=2, T=20)
    ref32 = Reference(cfg, model.parameters())
    ref_logits = ref32.logits(tokens).detach().numpy()
    logits = model.logits(tokens)
    assert np.abs(logits - ref_logits).max() <= 1e-4 * np.abs(ref_logits).max()

    loss, grads = model.loss_and_grads(tokens, targets)
    ref_loss, ref_grads = Reference(cfg, model.parameters(), dtype=torch.float64).loss_and_grads(tokens, targets)
    _, fp32_grads = ref32.loss_and_grads(tokens, targets)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert set(grads) == set(ref_grads)
    for k in grads:
        # Within 1e-5 of float64, or as close as PyTorch's own float32 gets where the gradient
        # is ill-conditioned (q and k's under a LayerNorm with biases: PyTorch float32 is 1e-4 off;
        # zoo within 8x of it, gcc's and clang's builds rounding differently).
        scale = np.abs(ref_grads[k]).max() + 1e-30
        err, fp32_err = (np.abs(g - ref_grads[k]).max() / scale for g in (grads[k], fp32_grads[k]))
        assert err <= max(1e-5, 8 * fp32_err), f"{k}: relative error {err:.2e} (PyTorch float32: {fp32_err:.2e})"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_generation_with_the_cache_matches_the_full_forward(name):
    model = model_of(name)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, model.config.vocab_size, (2, 14))
    full = model.logits(tokens)
    model.reset_cache(2, 16)
    first = model.forward_cached(tokens[:, :9], 0)  # a prompt longer than the windows
    scale = np.abs(full).max()
    np.testing.assert_allclose(first, full[:, 8], atol=1e-5 * scale)
    for t in range(9, 14):
        np.testing.assert_allclose(model.forward_cached(tokens[:, t:t + 1], t), full[:, t], atol=1e-5 * scale)


def test_window_changes_what_a_query_sees():
    base = zoo.Model(ModelConfig(**LLAMA), seed=3)
    windowed = zoo.Model(ModelConfig(**LLAMA, sliding_window=4), seed=3)
    for k, v in base.parameters().items():
        windowed.parameters()[k][...] = v
    tokens = np.random.default_rng(0).integers(0, 61, (1, 12))
    a, b = base.logits(tokens), windowed.logits(tokens)
    np.testing.assert_allclose(a[:, :4], b[:, :4], atol=1e-5)  # within the window: the same keys
    assert np.abs(a[:, 4:] - b[:, 4:]).max() > 1e-3


@pytest.mark.parametrize("bad, match", [
    (dict(sliding_layers=(0,)), "sliding_layers: set only with a sliding_window"),
    (dict(sliding_window=4, sliding_layers=(3,)), "sliding_layers: layer indices"),
    (dict(nope_layers=(1, 0)), "nope_layers: layer indices"),
    (dict(qk_norm="head", norm="layernorm"), "qk_norm: the q/k norm"),
    (dict(qk_norm="head", layer="parallel"), "layer: 'parallel' computes none"),
    (dict(residual_scale=0.0), "residual_scale"),
])
def test_bad_variant_options_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**LLAMA, **bad})


@pytest.mark.parametrize("name", list(VARIANTS))
def test_lora_gradients_are_the_merged_models_pulled_back(name):
    """LoRA over a frozen base of each variant: the adapted model is the base with W + s B A, and
    the adapters' gradients are the merged model's weight gradient G pulled back (dB = s G A^T,
    dA = s B^T G), the merged model being the trainable one checked against PyTorch above."""
    from test_lora import merged, randomize_adapters

    from zoo.arch.lora import adapters

    full = model_of(name)
    cfg = full.config
    model = zoo.Model(cfg, seed=3, lora=zoo.LoraConfig(r=4, alpha=6), base_dtype="fp32")
    for k, v in full.parameters().items():
        model.set_base_tensor(k, v)
    randomize_adapters(model)
    tokens, targets = random_batch(cfg, B=2, T=20)
    reference = merged(model)
    want = reference.logits(tokens)
    assert np.abs(model.logits(tokens) - want).max() <= 1e-4 * np.abs(want).max()
    _, grads = model.loss_and_grads(tokens, targets)
    _, full_grads = reference.loss_and_grads(tokens, targets)
    s, p = model.lora.alpha / model.lora.r, model.parameters()
    for a in adapters(cfg, model.lora):
        G = full_grads[a.module + ".weight"].astype(np.float64)
        A, B = p[a.module + ".lora_A.weight"], p[a.module + ".lora_B.weight"]
        for got, want in ((grads[a.module + ".lora_B.weight"], s * G @ A.T), (grads[a.module + ".lora_A.weight"], s * B.T @ G)):
            assert np.abs(got - want).max() <= 5e-4 * np.abs(want).max(), a.module  # float32 products of G


@needs_clad
@pytest.mark.parametrize("name", list(VARIANTS))
def test_clads_pullbacks_give_the_hand_written_gradients(name):
    """Every block of each variant on Clad's pullbacks (ad="clad"): the gradients equal the
    hand-written pullbacks' to float32 rounding."""
    manual, clad = model_of(name), model_of(name, ad="clad")
    tokens, targets = random_batch(manual.config, B=2, T=20)
    _, want = manual.loss_and_grads(tokens, targets)
    _, got = clad.loss_and_grads(tokens, targets)
    # (Rounding relative to the tensor's gradient, or to the model's largest where the tensor's
    # is a cancellation of larger terms: q and k's under the post-LayerNorm are 1e-5 of it.)
    largest = max(np.abs(g).max() for g in want.values())
    for k in want:
        assert np.abs(got[k] - want[k]).max() <= 1e-4 * np.abs(want[k]).max() + 1e-7 * largest, k


def test_the_soft_caps_bite_in_the_gemma2_like_variant():
    """Scores and logits beyond the caps: without them the model computes something else."""
    model = model_of("gemma2_like_softcaps")
    tokens, _ = random_batch(model.config, B=2, T=20)
    capped = model.logits(tokens)
    assert 0.15 < np.abs(capped).max() < 0.25  # up against the logit cap
    for uncapped in (dict(attention_softcap=None), dict(logit_softcap=None)):
        other = zoo.Model(model.config.model_copy(update=uncapped), seed=None)
        for k, v in model.parameters().items():
            other.parameters()[k][...] = v
        assert np.abs(other.logits(tokens) - capped).max() > 1e-3, (uncapped, np.abs(other.logits(tokens) - capped).max())


def test_a_windowed_layers_kv_cache_is_a_ring_bounded_by_the_window():
    """With a window, a layer's cache keeps window - 1 + a call's rows positions, not the whole
    length: a 600-token sequence (a prompt of two chunks, then one token at a time, and a
    rewind within what the ring keeps) computes the full forward's logits, with less cache."""
    cfg = ModelConfig(**{**LLAMA, "max_seq_len": 700, "sliding_window": 6, "sliding_layers": (0, 2)})
    model = zoo.Model(cfg, seed=2)
    randomize_norms(model, 3, scale=0.3)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 600))
    full = model.logits(tokens)[0]
    scale = np.abs(full).max()
    unbounded = zoo.Model(cfg.model_copy(update={"sliding_window": None, "sliding_layers": None}), seed=None)
    assert model._exec.cache_floats(1, 600) < unbounded._exec.cache_floats(1, 600)
    model.reset_cache(1, 600)
    np.testing.assert_allclose(model.forward_cached(tokens[:, :530], 0)[0], full[529], atol=1e-5 * scale)
    for t in range(530, 600):
        np.testing.assert_allclose(model.forward_cached(tokens[:, t:t + 1], t)[0], full[t], atol=1e-5 * scale)
    # Rewinding 20 positions stays within the ring; 590 would not, and is refused.
    np.testing.assert_allclose(model.forward_cached(tokens[:, 580:590], 580)[0], full[589], atol=1e-5 * scale)
    with pytest.raises(ValueError, match="rewinds slot 0 .* past what layer 0's windowed KV cache keeps"):
        model.forward_cached(tokens[:, 5:10], 5)


@needs_bf16
@pytest.mark.parametrize("name", list(VARIANTS))
def test_bf16_products_stay_close_to_fp32(name):
    """Each variant with bf16 matrix products (its q|k|v, attention output and MLP input kept in
    bf16 between forward and pullback): loss within 1%, gradients pointing the same way."""
    fp32 = model_of(name)
    bf16 = zoo.Model(fp32.config, seed=None, precision="bf16")
    for k, v in fp32.parameters().items():
        bf16.parameters()[k][...] = v
    tokens, targets = random_batch(fp32.config, B=2, T=20)
    loss, grads = fp32.loss_and_grads(tokens, targets)
    loss16, grads16 = bf16.loss_and_grads(tokens, targets)
    assert abs(loss16 - loss) <= 1e-2 * loss
    flat, flat16 = (np.concatenate([g[k].ravel() for k in sorted(g)]) for g in (grads, grads16))
    assert flat @ flat16 / (np.linalg.norm(flat) * np.linalg.norm(flat16)) > 0.99


# The variants whose new tokens take the fused decode step (native/executor/decode.cpp); the rest
# (q/k norm over the projection, norms on branch outputs, the residual scale, the parallel layers)
# decode one block call at a time.
FUSED = {"qkv_bias_only", "qk_norm_head_wide_heads", "window_on_two_layers", "window_everywhere_gqa", "nope_layer",
         "partial_rotary", "fused_decode_options"}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_which_variants_decode_in_the_fused_step(name):
    model = model_of(name)
    assert model._exec.decodes_fused(1) == (name in FUSED)
    assert model._exec.decodes_fused(8) == (name in FUSED)
    assert not model._exec.decodes_fused(9)  # more rows than the decode products take


@pytest.mark.parametrize("name", sorted(FUSED - {"qkv_bias_only"}))
def test_the_fused_decode_step_matches_the_full_forward(name):
    """Three sequences in one call each step (prompts of 3, 2 and 1 tokens: runs of several rows),
    then one new token each, past the window, against the full forward of each sequence."""
    model = model_of(name)
    rng = np.random.default_rng(8)
    seqs = rng.integers(0, model.config.vocab_size, (3, 16))
    full = model.logits(seqs)
    scale = np.abs(full).max()
    model.reset_cache(3, 16)
    at = [3, 2, 1]
    assert model._exec.decodes_fused(sum(at))
    got = model.forward_segments([0, 1, 2], [seqs[k, :at[k]].tolist() for k in range(3)], [0, 0, 0])
    for k in range(3):
        np.testing.assert_allclose(got[k], full[k, at[k] - 1], atol=1e-5 * scale, err_msg=f"prompt {k}")
    for step in range(12):
        got = model.forward_segments([0, 1, 2], [[int(seqs[k, at[k]])] for k in range(3)], list(at))
        for k in range(3):
            np.testing.assert_allclose(got[k], full[k, at[k]], atol=1e-5 * scale, err_msg=f"step {step}, sequence {k}")
            at[k] += 1
