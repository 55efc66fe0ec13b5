"""The worked example of docs/adding_a_block.md: LayerNorm without a bias, added as one header
and one registry line. Its gradients against finite differences and (with Clad) the generated
pullback, and whole models against the PyTorch reference."""

import numpy as np
import pytest
from helpers import CLAD, needs, needs_clad, randomize_norms, rel_err

import zoo
from zoo import ModelConfig
from zoo.arch.layout import parameter_layout
from zoo.core import blocks
from zoo.core.native import _native

B = _native.blocks
EPS = 1e-5

GPT2_NAMED = ModelConfig(vocab_size=61, max_seq_len=32, d_model=32, n_layer=2, n_head=4, d_ff=64,
                         norm="layernorm_nobias")
LLAMA_NAMED = ModelConfig(vocab_size=67, max_seq_len=32, d_model=36, n_layer=2, n_head=6, n_kv_head=2, d_ff=48,
                          norm="layernorm_nobias", mlp="swiglu", positions="rope", attention_bias=False,
                          mlp_bias=False, tied_embeddings=False)


def rows(n, C, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, C)) * 2 + 0.5).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(C)).astype(np.float32)
    dy = rng.standard_normal((n, C)).astype(np.float32)
    return x, w, dy


def test_registered_and_known_to_python():
    assert zoo.build_info()["norms"]["layernorm_nobias"] == {"bias": False, "stats_per_row": 2}
    assert "layernorm_nobias" in blocks.norms()
    names = {p.name for p in parameter_layout(GPT2_NAMED)}
    assert "transformer.h.0.ln_1.weight" in names and "transformer.h.0.ln_1.bias" not in names
    with pytest.raises(ValueError, match="'layernorm_nobis' is no norm of this zoo; registered: .*layernorm_nobias"):
        ModelConfig(vocab_size=8, max_seq_len=8, d_model=8, n_layer=1, n_head=2, norm="layernorm_nobis")


def test_forward_is_layernorm_without_bias():
    x, w, _ = rows(5, 40, 0)
    y, stats = B.norm_forward("layernorm_nobias", x, w, None, EPS)
    ref, _ = B.norm_forward("layernorm", x, w, np.zeros_like(w), EPS)
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(stats[0], x.mean(-1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="norm layernorm_nobias has no bias"):
        B.norm_forward("layernorm_nobias", x, w, w, EPS)


def test_pullback_matches_finite_differences(threads):
    x, w, dy = rows(3, 24, 1)
    y, stats = B.norm_forward("layernorm_nobias", x, w, None, EPS)
    dx, dw, db = B.norm_pullback("layernorm_nobias", x, w, None, stats, dy, EPS)
    assert db is None

    def objective(x_, w_):
        return float((B.norm_forward("layernorm_nobias", x_.astype(np.float32), w_.astype(np.float32), None,
                                     EPS)[0].astype(np.float64) * dy).sum())

    h = 1e-2
    for arr, grad, name in ((x, dx, "x"), (w, dw, "w")):
        num = np.zeros(arr.shape)
        for i in np.ndindex(arr.shape):
            up, down = arr.astype(np.float64), arr.astype(np.float64)
            up[i] += h
            down[i] -= h
            args = (up, w) if name == "x" else (x, up)
            args_down = (down, w) if name == "x" else (x, down)
            num[i] = (objective(*args) - objective(*args_down)) / (2 * h)
        np.testing.assert_allclose(grad, num, rtol=2e-2, atol=2e-3, err_msg=name)


@needs_clad
@pytest.mark.parametrize("C", [24, 200])  # past 64: Clad's tape leaves its inline buffer
def test_clad_pullback_equals_the_hand_written_one(threads, C):
    x, w, dy = rows(7, C, 2)
    _, stats = B.norm_forward("layernorm_nobias", x, w, None, EPS)
    dx, dw, _ = B.norm_pullback("layernorm_nobias", x, w, None, stats, dy, EPS, "manual")
    cdx, cdw, _ = B.norm_pullback("layernorm_nobias", x, w, None, stats, dy, EPS, "clad")
    np.testing.assert_allclose(cdx, dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cdw, dw, rtol=1e-4, atol=1e-5)


@needs("torch")
@pytest.mark.parametrize("ad", ["manual"] + (["clad"] if CLAD else []))
@pytest.mark.parametrize("cfg", [GPT2_NAMED, LLAMA_NAMED], ids=["gpt2_named", "llama_named"])
def test_model_matches_the_torch_reference(cfg, ad):
    from zoo.tools.torch_reference import Reference

    model = zoo.Model(cfg, seed=1, ad={"layernorm_nobias": ad})
    randomize_norms(model, 2)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, cfg.vocab_size, (2, 12))
    targets = rng.integers(0, cfg.vocab_size, (2, 12))
    ref = Reference(cfg, model.parameters())
    assert np.abs(model.logits(tokens) - ref.logits(tokens).detach().numpy()).max() <= 1e-4
    loss, grads = model.loss_and_grads(tokens, targets)
    ref_loss, ref_grads = ref.loss_and_grads(tokens, targets)
    assert abs(loss - ref_loss) <= 1e-5
    assert set(grads) == set(ref_grads)
    for k in grads:
        assert rel_err(grads[k], ref_grads[k]) <= 1e-3, k


def test_trains_and_round_trips_a_checkpoint(tmp_path):
    model = zoo.Model(LLAMA_NAMED, seed=0)
    tokens = np.random.default_rng(4).integers(0, LLAMA_NAMED.vocab_size, (4, 17))
    x, y = tokens[:, :-1], tokens[:, 1:]
    first = model.loss(x, y)
    for _ in range(20):
        model.zero_grads()
        model.forward_backward(x, y)
        model.adamw_step(3e-3)
    assert model.loss(x, y) < 0.8 * first
    with pytest.warns(UserWarning):  # transformers has no class for it: zoo's own config.json
        model.save_pretrained(tmp_path / "m")
    again = zoo.Model.from_pretrained(tmp_path / "m")
    assert again.config.norm == "layernorm_nobias"
    np.testing.assert_array_equal(again.logits(x), model.logits(x))
