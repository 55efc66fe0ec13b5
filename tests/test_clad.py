"""The Clad backend (docs/clad.md): pullbacks Clad generates at build time from each block's
forward, chosen per model with zoo.Model(ad=...).

Where zoo was built with Clad: every block's Clad pullback equals the hand-written one, whole
models train to the same gradients on either backend or a mix, and relu2 (a block written as
its forward only) trains. Where it was not: asking for Clad says how to build it, and relu2
runs forward but refuses to train, naming the block. Each group skips in the other build
(`make test-clad` runs the suite on a Clad build); relu2's training runs wherever relu2 has a
pullback, whichever backend gives it."""

import json

import numpy as np
import pytest
from helpers import (
    CLAD,
    GPT2_TINY,
    LLAMA_TINY,
    RELU2_TINY,
    needs,
    needs_clad,
    random_batch,
    randomize_norms,
    rel_err,
    without_clad,
)
from zoo.core._native import blocks as B

import zoo
from zoo import ModelConfig
from zoo.core import blocks
from zoo.model import AD_BLOCKS, ADError, resolve_ad

BACKENDS = ["manual"] + (["clad"] if CLAD else [])
RELU2_TRAINS = CLAD or "relu2" in zoo.build_info()["manual_blocks"]


# --- both builds ------------------------------------------------------------------------


def test_build_info_says_whether_clad_is_built():
    info = zoo.build_info()
    assert isinstance(info["clad"], bool)
    assert set(info["manual_blocks"]) == set(AD_BLOCKS) - {"relu2"}
    assert set(info["clad_blocks"]) == (set(AD_BLOCKS) if info["clad"] else set())


def test_ad_choices_are_validated():
    with pytest.raises(ADError, match="choose 'manual', 'clad'"):
        resolve_ad("enzyme", GPT2_TINY)
    with pytest.raises(ADError, match="no block named 'softmax'"):
        resolve_ad({"softmax": "clad"}, GPT2_TINY)
    with pytest.raises(ADError, match="'manual' or 'clad'"):
        resolve_ad({"attention": "jax"}, GPT2_TINY)
    assert resolve_ad("manual", GPT2_TINY) == {b: "manual" for b in
                                               ("embedding", "layernorm", "linear", "attention", "gelu",
                                                "cross_entropy")}


@needs("torch")
def test_relu2_forward_runs_in_any_build():
    from zoo.tools.torch_reference import Reference

    x = np.random.default_rng(0).standard_normal((5, 33)).astype(np.float32)
    np.testing.assert_array_equal(B.activation_forward("relu2", x), np.square(np.maximum(x, 0)))
    model = zoo.Model(RELU2_TINY, seed=1)
    randomize_norms(model, 2)
    tokens, targets = random_batch(RELU2_TINY)
    ref = Reference(RELU2_TINY, model.parameters())
    assert np.abs(model.logits(tokens) - ref.logits(tokens).detach().numpy()).max() <= 1e-4
    assert abs(model.loss(tokens, targets) - float(ref.loss(tokens, targets).detach())) <= 1e-5
    model.reset_cache(3, 24)  # generation: the KV-cache path runs relu2 too
    last = model.forward_cached(tokens, 0)
    np.testing.assert_allclose(last, model.logits(tokens)[:, -1], atol=1e-4)


# --- without Clad -----------------------------------------------------------------------


@without_clad
@pytest.mark.parametrize("ad", ["clad", {"attention": "clad"}])
def test_asking_for_clad_says_it_was_not_built(ad):
    with pytest.raises(ADError, match=r"built without the Clad backend .*ZOO_CLAD_DIR=.*docs/clad.md"):
        zoo.Model(GPT2_TINY, seed=0, ad=ad)


@pytest.mark.skipif(RELU2_TRAINS, reason="relu2 has a pullback in this build")
def test_relu2_does_not_train_without_clad_and_names_the_block(tmp_path):
    from zoo.train.config import TrainConfig
    from zoo.train.trainer import Trainer

    model = zoo.Model(RELU2_TINY, seed=0)
    assert model.ad["relu2"] is None
    tokens, targets = random_batch(RELU2_TINY)
    with pytest.raises(ADError, match=r"block 'relu2' .*no hand-written pullback.*Clad backend"):
        model.loss_and_grads(tokens, targets)
    with pytest.raises(RuntimeError, match="relu2"):  # the native core refuses too
        model._exec.forward_backward(tokens.astype(np.int32), targets.astype(np.int32), 1.0)
    # The trainer stops at once: before tokenizing data (here a folder that does not exist).
    cfg = TrainConfig(model=RELU2_TINY, data=[str(tmp_path / "no-such-data")], out=str(tmp_path / "run"),
                      steps=2, progress=False, sample_tokens=0)
    with pytest.raises(ADError, match="relu2"):
        Trainer(cfg)


# --- with Clad: every block, against the hand-written pullback ---------------------------

RNG = np.random.default_rng(0)


def rnd(*shape, scale=1.0):
    return (scale * RNG.standard_normal(shape)).astype(np.float32)


@needs_clad
@pytest.mark.parametrize("name, C", [("layernorm", 96), ("layernorm", 101), ("rmsnorm", 101)])
def test_norms(threads, name, C):
    # through the registry, as the executor calls them: dx, dw, db alone, and with the output
    # recomputed (y), on both backends
    x, w, dy = rnd(37, C), 1 + rnd(C, scale=0.1), rnd(37, C)
    b = rnd(C, scale=0.1) if name == "layernorm" else None
    y, stats = B.norm_forward(name, x, w, b, 1e-5)
    want = B.norm_pullback(name, x, w, b, stats, dy, 1e-5)
    dy0, stats0 = dy.copy(), stats.copy()
    for backend in ("clad", "manual"):
        for recompute in (False, True):
            got = B.norm_pullback(name, x, w, b, stats, dy, 1e-5, backend, recompute)
            for g, ref in zip(got[:3], want):
                assert g is None if ref is None else rel_err(g, ref) <= 1e-5
            if recompute:
                assert rel_err(got[3], y) <= 1e-6
    np.testing.assert_array_equal(dy, dy0)
    np.testing.assert_array_equal(stats, stats0)


# Every registered activation with a hand-written pullback: Clad's must equal it.
HAND_WRITTEN_ACTIVATIONS = [(b["name"], blocks.activations()[b["name"]]["gate_width"]) for b in blocks.blocks()
                            if b["kind"] == "mlp" and b["manual"]]


@needs_clad
@pytest.mark.parametrize("name, width", HAND_WRITTEN_ACTIVATIONS)
def test_activations(threads, name, width):
    # the executor's two calls: dx alone, and y recomputed with dx (the MLP step's fused pass)
    x, dy = rnd(9, width * 150, scale=3.0), rnd(9, 150)
    x[0, :6] = [-200.0, -90.0, -12.0, 12.0, 90.0, 200.0]  # saturated tails: no inf/inf
    x[1, -6:] = [-200.0, -90.0, -12.0, 12.0, 90.0, 200.0]  # (for a gated unit: in up too)
    want = B.activation_pullback(name, x, dy)
    assert rel_err(B.activation_pullback(name, x, dy, "clad"), want) <= 1e-5
    y, dx = B.activation_recompute_and_pullback(name, x, dy, "clad")
    assert rel_err(y, B.activation_forward(name, x)) <= 1e-6  # the forward's formula, to rounding
    assert rel_err(dx, want) <= 1e-5


@needs_clad
@pytest.mark.skipif("relu2" in zoo.build_info()["manual_blocks"], reason="relu2 has a hand-written pullback")
def test_relu2_has_only_the_generated_pullback(threads):
    x, dy = rnd(9, 300), rnd(9, 300)
    x[0, :4] = 0.0  # the kink: relu2's derivative there is 0 from either side
    want = 2 * np.maximum(x, 0) * dy
    assert rel_err(B.activation_pullback("relu2", x, dy, "clad"), want) <= 1e-6
    y, dx = B.activation_recompute_and_pullback("relu2", x, dy, "clad")
    assert rel_err(y, B.activation_forward("relu2", x)) <= 1e-6
    assert rel_err(dx, want) <= 1e-6
    with pytest.raises(ValueError, match="relu2 has no manual pullback"):
        B.activation_pullback("relu2", x, dy)


@needs_clad
@pytest.mark.parametrize("bias", [True, False])
def test_linear(threads, bias):
    x, W, b, dy = rnd(37, 64), rnd(96, 64), rnd(96), rnd(37, 96)
    manual = B.linear_pullback(x, W, dy, bias)
    dy0 = dy.copy()
    got = B.linear_pullback_clad(x, W, b if bias else None, dy)
    np.testing.assert_array_equal(dy, dy0)  # the generated pullback reads dy and leaves it
    for g, m in zip(got, manual):
        if m is None:
            assert g is None
        else:
            assert rel_err(g, m) <= 1e-5


@needs_clad
@pytest.mark.parametrize("learned_positions", [True, False])
def test_embedding(threads, learned_positions):
    tokens = RNG.integers(0, 20, (3, 50)).astype(np.int32)  # repeated tokens: their rows add up
    wte, wpe, dx = rnd(20, 70), rnd(50, 70), rnd(150, 70)
    manual = B.embedding_pullback(tokens, dx, 20, 50 if learned_positions else 0)
    got = B.embedding_pullback_clad(tokens, wte, wpe if learned_positions else None, dx)
    assert rel_err(got[0], manual[0]) <= 1e-5
    if learned_positions:
        assert rel_err(got[1], manual[1]) <= 1e-5
    else:
        assert got[1] is None


@needs_clad
@pytest.mark.parametrize("head_dim", [16, 128])
def test_rope(threads, head_dim):
    inv = (1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    dy = rnd(2, 9, 3 * head_dim)
    assert rel_err(B.rope_pullback_clad(dy, inv, head_dim), B.rope_pullback(dy, inv, head_dim)) <= 1e-5


@needs_clad
@pytest.mark.parametrize("n_head,n_kv_head,head_dim,T", [(4, 4, 16, 9), (4, 2, 12, 9), (6, 1, 8, 70)],
                         ids=["mha", "gqa", "mqa-long"])
def test_attention(threads, n_head, n_kv_head, head_dim, T):
    qkv, dout = rnd(2, T, (n_head + 2 * n_kv_head) * head_dim), rnd(2, T, n_head * head_dim)
    _, lse = B.attention_forward(qkv, n_head, n_kv_head, head_dim)
    manual = B.attention_pullback(qkv, lse, dout, n_head, n_kv_head, head_dim)
    assert rel_err(B.attention_pullback_clad(qkv, dout, n_head, n_kv_head, head_dim), manual) <= 1e-5


@needs_clad
def test_attention_large_scores(threads):
    # Scores in the hundreds: exp overflows unless the softmax is shifted by its max. The two
    # pullbacks differ more here (the scores' own rounding, magnified), as they did before.
    qkv, dout = rnd(2, 70, 8 * 16, scale=30.0), rnd(2, 70, 6 * 16)
    _, lse = B.attention_forward(qkv, 6, 1, 16)
    manual = B.attention_pullback(qkv, lse, dout, 6, 1, 16)
    got = B.attention_pullback_clad(qkv, dout, 6, 1, 16)
    assert np.isfinite(got).all()
    assert rel_err(got, manual) <= 2e-3


@needs_clad
def test_cross_entropy(threads):
    logits, targets = rnd(37, 301, scale=3.0), RNG.integers(0, 301, 37).astype(np.int32)
    targets[:3] = -100
    loss, counted, got = B.cross_entropy_forward_pullback_clad(logits, targets, 34, 0.5)
    want_loss, want_counted, want = B.cross_entropy_forward_pullback(logits, targets, 34, 0.5)
    assert rel_err(got, want) <= 1e-5
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss) and counted == want_counted == 34
    assert not got[:3].any()


@needs_clad
def test_residual(threads):
    a, b, dy = rnd(10_001), rnd(10_001), rnd(10_001)
    for got, want in zip(B.residual_pullback_clad(a, b, dy), B.residual_pullback(dy)):
        assert rel_err(got, want) <= 1e-5


# --- with Clad: whole models -----------------------------------------------------------


def grads_on(cfg, ad, checkpointing=False, seed=1, precision="fp32"):
    model = zoo.Model(cfg, seed=seed, ad=ad, checkpointing=checkpointing, precision=precision)
    randomize_norms(model, 2)
    loss, grads = model.loss_and_grads(*random_batch(cfg))
    return model, loss, grads


def assert_same_grads(a, b, tol=1e-4):
    assert set(a) == set(b)
    for k in a:
        assert rel_err(a[k], b[k]) <= tol, f"{k}: relative error {rel_err(a[k], b[k]):.2e}"


@needs_clad
@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "checkpointed"])
@pytest.mark.parametrize("cfg", [GPT2_TINY, LLAMA_TINY], ids=["gpt2", "llama"])
def test_whole_model_gradients_match_the_manual_backend(threads, cfg, checkpointing):
    _, loss_m, manual = grads_on(cfg, "manual", checkpointing)
    model, loss_c, clad = grads_on(cfg, "clad", checkpointing)
    assert set(model.ad.values()) == {"clad"}
    assert sorted(model._exec.clad_blocks()) == sorted(model.ad)
    assert abs(loss_c - loss_m) <= 1e-6
    assert_same_grads(clad, manual)


@needs_clad
@pytest.mark.skipif(not zoo.gemm_info()["bf16_native"], reason="no bf16 dot products on this CPU")
@pytest.mark.parametrize("cfg", [GPT2_TINY, LLAMA_TINY], ids=["gpt2", "llama"])
def test_the_clad_backend_in_bf16_matches_the_manual_one(cfg):
    # Clad's pullbacks call the same GEMMs (the linear layer's custom derivative). The fp32
    # adjoints they feed them differ in the last bits (another order of operations), which
    # now and then rounds an operand to the neighbouring bf16 value: measured, the backends
    # differ by up to 7e-4 (relative, per tensor), bf16 itself by 2e-3 to 8e-3 from fp32.
    _, loss_m, manual = grads_on(cfg, "manual", precision="bf16")
    model, loss_c, clad = grads_on(cfg, "clad", precision="bf16")
    assert model.precision == "bf16"
    assert abs(loss_c - loss_m) <= 1e-6
    assert_same_grads(clad, manual, tol=2e-3)
    _, _, fp32 = grads_on(cfg, "manual")
    assert max(rel_err(clad[k], fp32[k]) for k in fp32) > 1e-4  # bf16 did run


@needs_clad
@pytest.mark.parametrize("cfg", [GPT2_TINY, LLAMA_TINY], ids=["gpt2", "llama"])
def test_clad_gradients_after_an_optimizer_step_are_fresh(cfg):
    # The Clad pullbacks add into parameter gradients; after a step they must start from zero.
    tok = np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 12))
    stepped = zoo.Model(cfg, seed=1, ad="clad")
    stepped.forward_backward(tok, tok)
    stepped.adamw_step(1e-2, weight_decay=0.1)
    fresh = zoo.Model(cfg, seed=None, ad="clad")
    for k, v in stepped.parameters().items():
        fresh.parameters()[k][...] = v
    assert_same_grads(stepped.loss_and_grads(tok, tok)[1], fresh.loss_and_grads(tok, tok)[1], tol=0.0)


@needs_clad
def test_chunked_lm_head_on_clad():
    big_vocab = ModelConfig(vocab_size=300_007, max_seq_len=32, d_model=16, n_layer=1, n_head=2, d_ff=32)
    assert_same_grads(grads_on(big_vocab, "clad")[2], grads_on(big_vocab, "manual")[2])


@needs_clad
@pytest.mark.parametrize("ad", [{"attention": "clad"}, {"rmsnorm": "clad", "swiglu": "clad", "rope": "clad"},
                                {"linear": "clad", "cross_entropy": "clad", "embedding": "clad"}])
def test_mixed_mode(ad):
    _, _, manual = grads_on(LLAMA_TINY, "manual")
    model, _, mixed = grads_on(LLAMA_TINY, ad)
    assert {b for b, v in model.ad.items() if v == "clad"} == set(ad)
    assert_same_grads(mixed, manual)


@pytest.mark.skipif(not RELU2_TRAINS, reason="relu2 has no pullback in this build (no hand-written one; a Clad "
                                                 "build generates one: `make test-clad`, docs/clad.md)")
@needs("torch")
@pytest.mark.parametrize("ad", BACKENDS)
def test_relu2_trains(ad):
    """Its gradients against PyTorch's, and 30 AdamW steps halve the loss, on every backend the
    build has; where relu2's only pullback is Clad's, a model on the hand-written backend
    takes it too, and asking for a hand-written one is refused."""
    from zoo.tools.torch_reference import Reference

    model = zoo.Model(RELU2_TINY, seed=1, ad=ad)
    if "relu2" not in zoo.build_info()["manual_blocks"]:
        assert model.ad["relu2"] == "clad"
        with pytest.raises(ADError, match="'relu2' has no hand-written pullback"):
            zoo.Model(RELU2_TINY, seed=1, ad={"relu2": "manual"})
    randomize_norms(model, 2)
    tokens, targets = random_batch(RELU2_TINY)
    loss, grads = model.loss_and_grads(tokens, targets)
    ref_loss, ref_grads = Reference(RELU2_TINY, model.parameters()).loss_and_grads(tokens, targets)
    assert abs(loss - ref_loss) <= 1e-5
    for k in grads:
        assert rel_err(grads[k], ref_grads[k]) <= 1e-3, k
    first = loss
    for _ in range(30):
        model.zero_grads()
        loss = model.forward_backward(tokens, targets)
        model.adamw_step(3e-3)
    assert loss < 0.5 * first


@needs_clad
def test_bench_ad_compares_every_block_and_the_step(tmp_path, capsys):
    from zoo.tools import bench_ad

    out = tmp_path / "ad.json"
    assert bench_ad.main(["--preset", "tiny-gpt2", "--batch-size", "2", "--seq-len", "16", "--threads", "1",
                          "--rounds", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"][0]
    assert set(r["blocks"]) == {"embedding", "layernorm", "linear", "attention", "gelu",
                                "cross_entropy (loss and adjoint)"}
    assert all(b["manual_ms"] > 0 and b["clad_ms"] > 0 for b in r["blocks"].values())
    assert r["step"]["ratio"] > 0
    assert "**full training step**" in capsys.readouterr().out
