"""Whole-model parity against the independent PyTorch reference in zoo/tools/torch_reference.py."""

import math

import numpy as np
import pytest
from helpers import (
    GPT2_TINY,
    LLAMA_TINY,
    installed,
    needs,
    random_batch,
    randomize_norms,
    rel_err,
)

import zoo
from zoo import ModelConfig

if installed("torch"):
    from zoo.tools.torch_reference import Reference

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


@needs("torch")
@pytest.mark.parametrize("checkpointing", [False, True, 1], ids=["stored", "checkpointed", "first-layer"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_grads_match_reference(name, checkpointing):
    cfg = CONFIGS[name]
    model = zoo.Model(cfg, seed=1, checkpointing=checkpointing)
    randomize_norms(model, 2)
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


# --- where zoo-only configs put their weights, independently of zoo's layout.py -----------------

# The configs transformers has no class for: their names follow docs/config.md ("Mixed configs
# keep their family's naming pattern"), so the layout the reference reads them with is written
# here from those rules, not taken from zoo.
ZOO_ONLY = {"rope_layernorm_gelu_mqa": MIXED, "learned_rmsnorm_swiglu": GPT2_SWIGLU_RMS,
            "llama_layernorm_nobias_biases": ModelConfig(
                vocab_size=67, max_seq_len=32, d_model=36, n_layer=2, n_head=6, n_kv_head=2, d_ff=48,
                norm="layernorm_nobias", mlp="swiglu", positions="rope", attention_bias=True, mlp_bias=True,
                tied_embeddings=False),
            "gpt2_gelu_no_biases_untied": ModelConfig(vocab_size=61, max_seq_len=32, d_model=32, n_layer=2,
                                                      n_head=4, d_ff=64, attention_bias=False, mlp_bias=False,
                                                      tied_embeddings=False)}


def documented_layout(cfg: ModelConfig) -> list[dict]:
    """The tensors of cfg as docs/config.md names them, each with the executor role it means
    (a fused part follows the tensor whose role it joins: q|k|v, gate|up), in that order."""
    d, hd, nh, nkv, ff = cfg.d_model, cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.d_ff
    norm_bias = cfg.norm == "layernorm"  # RMSNorm and LayerNorm without bias have a weight only
    gated = cfg.mlp == "swiglu"
    out = []

    def add(name, shape, role, layer=-1, when=True):
        if when:
            out.append({"name": name, "shape": list(shape), "role": role, "layer": layer})

    if cfg.positions == "learned":  # GPT2LMHeadModel's names; Conv1D weights held (out, in)
        add("transformer.wte.weight", (cfg.vocab_size, d), "wte")
        add("transformer.wpe.weight", (cfg.max_seq_len, d), "wpe")
        for i in range(cfg.n_layer):
            p = f"transformer.h.{i}."
            add(p + "ln_1.weight", (d,), "ln1_w", i)
            add(p + "ln_1.bias", (d,), "ln1_b", i, norm_bias)
            add(p + "attn.c_attn.weight", ((nh + 2 * nkv) * hd, d), "qkv_w", i)
            add(p + "attn.c_attn.bias", ((nh + 2 * nkv) * hd,), "qkv_b", i, cfg.attention_bias)
            add(p + "attn.c_proj.weight", (d, nh * hd), "attn_out_w", i)
            add(p + "attn.c_proj.bias", (d,), "attn_out_b", i, cfg.attention_bias)
            add(p + "ln_2.weight", (d,), "ln2_w", i)
            add(p + "ln_2.bias", (d,), "ln2_b", i, norm_bias)
            add(p + "mlp.c_fc.weight", ((2 if gated else 1) * ff, d), "fc_w", i)  # [gate; up] when gated
            add(p + "mlp.c_fc.bias", ((2 if gated else 1) * ff,), "fc_b", i, cfg.mlp_bias)
            add(p + "mlp.c_proj.weight", (d, ff), "proj_w", i)
            add(p + "mlp.c_proj.bias", (d,), "proj_b", i, cfg.mlp_bias)
        add("transformer.ln_f.weight", (d,), "lnf_w")
        add("transformer.ln_f.bias", (d,), "lnf_b", -1, norm_bias)
    else:  # LlamaForCausalLM's names
        add("model.embed_tokens.weight", (cfg.vocab_size, d), "wte")
        for i in range(cfg.n_layer):
            p = f"model.layers.{i}."
            add(p + "input_layernorm.weight", (d,), "ln1_w", i)
            add(p + "input_layernorm.bias", (d,), "ln1_b", i, norm_bias)
            for part, rows, role in (("q", nh * hd, "qkv_w"), ("k", nkv * hd, ""), ("v", nkv * hd, "")):
                add(p + f"self_attn.{part}_proj.weight", (rows, d), role, i)
            for part, rows, role in (("q", nh * hd, "qkv_b"), ("k", nkv * hd, ""), ("v", nkv * hd, "")):
                add(p + f"self_attn.{part}_proj.bias", (rows,), role, i, cfg.attention_bias)
            add(p + "self_attn.o_proj.weight", (d, nh * hd), "attn_out_w", i)
            add(p + "self_attn.o_proj.bias", (d,), "attn_out_b", i, cfg.attention_bias)
            add(p + "post_attention_layernorm.weight", (d,), "ln2_w", i)
            add(p + "post_attention_layernorm.bias", (d,), "ln2_b", i, norm_bias)
            if gated:
                add(p + "mlp.gate_proj.weight", (ff, d), "fc_w", i)
                add(p + "mlp.up_proj.weight", (ff, d), "", i)
                add(p + "mlp.gate_proj.bias", (ff,), "fc_b", i, cfg.mlp_bias)
                add(p + "mlp.up_proj.bias", (ff,), "", i, cfg.mlp_bias)
            else:  # a GELU MLP: up_proj and down_proj only
                add(p + "mlp.up_proj.weight", (ff, d), "fc_w", i)
                add(p + "mlp.up_proj.bias", (ff,), "fc_b", i, cfg.mlp_bias)
            add(p + "mlp.down_proj.weight", (d, ff), "proj_w", i)
            add(p + "mlp.down_proj.bias", (d,), "proj_b", i, cfg.mlp_bias)
        add("model.norm.weight", (d,), "lnf_w")
        add("model.norm.bias", (d,), "lnf_b", -1, norm_bias)
    add("lm_head.weight", (cfg.vocab_size, d), "lm_head_w", -1, not cfg.tied_embeddings)
    return out


@needs("torch")
@pytest.mark.parametrize("name", list(ZOO_ONLY))
def test_zoo_only_configs_place_weights_as_documented(name):
    """zoo's tensors are the documented ones (names and shapes), and the model computes what the
    reference computes when it reads each tensor by its documented meaning: a weight the
    executor bound to another role (k read as v, gate as up, a bias dropped) fails it."""
    cfg = ZOO_ONLY[name]
    documented = documented_layout(cfg)
    model = zoo.Model(cfg, seed=1)
    randomize_norms(model, 2)
    assert {k: list(v.shape) for k, v in model.parameters().items()} == {r["name"]: r["shape"] for r in documented}
    ref = Reference(cfg, model.parameters(), layout=documented)
    tokens, targets = random_batch(cfg, B=2, T=16)
    assert np.abs(model.logits(tokens) - ref.logits(tokens).detach().numpy()).max() <= 1e-4
    loss, grads = model.loss_and_grads(tokens, targets)
    ref_loss, ref_grads = ref.loss_and_grads(tokens, targets)
    assert abs(loss - ref_loss) <= 1e-5
    for k in grads:
        assert rel_err(grads[k], ref_grads[k]) <= 1e-3, k


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


def test_rope_tables_grow_with_the_rows_a_pass_runs():
    """The RoPE tables hold the positions the longest pass so far needed (not max_seq_len's at
    once): a short pass, then a longer one and a generation, give what a fresh model gives."""
    from zoo.generate import generate

    cfg = zoo.preset("tiny-llama")
    tok = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 40))
    fresh = zoo.Model(cfg, seed=1)
    want = fresh.logits(tok)
    model = zoo.Model(cfg, seed=1)
    model.logits(tok[:, :3])
    np.testing.assert_array_equal(model.logits(tok), want)
    generated = generate(zoo.Model(cfg, seed=1), tok[0, :5].tolist(), max_new_tokens=30)
    model.logits(tok[:, :2])
    assert generate(model, tok[0, :5].tolist(), max_new_tokens=30) == generated


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
