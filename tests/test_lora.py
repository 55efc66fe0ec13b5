"""LoRA over a frozen base (docs/lora.md): the adapter block, the base's storage formats and their
products, what a LoRA model and a forward-only model allocate, dropout, the memory refusal, and
LoRA runs through the CLI. Parity with PEFT itself is in test_lora_peft.py."""

import json

import numpy as np
import pytest
from helpers import (
    BF16,
    GPT2_TINY,
    SHAKESPEARE,
    STORIES,
    bf16_round,
    cli,
    needs_bf16,
    needs_clad,
    needs_shared,
    rel_err,
    shared,
)

import zoo
from zoo import LoraConfig, ModelConfig
from zoo.arch.layout import num_parameters
from zoo.train.config import TrainConfig
from zoo.train.trainer import Trainer, TrainInterrupted

# Heads of 10 (no power of two), and adapters over every module of the Llama family.
LLAMA_TINY = ModelConfig(vocab_size=101, max_seq_len=32, d_model=40, n_layer=2, n_head=4, n_kv_head=2, head_dim=10,
                         d_ff=72, norm="rmsnorm", mlp="swiglu", positions="rope", attention_bias=False,
                         mlp_bias=False, tied_embeddings=False)
# Rows of 96 (one and a half nf4 blocks) and a vocabulary whose matrix is widened in two tiles.
WIDE_VOCAB = ModelConfig(vocab_size=20000, max_seq_len=16, d_model=96, n_layer=1, n_head=4, d_ff=160,
                         norm="rmsnorm", mlp="swiglu", positions="rope", attention_bias=False, mlp_bias=False,
                         tied_embeddings=False)


def batch(cfg, B=2, T=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))


def randomize_adapters(model, seed=1, scale=1.0):
    rng = np.random.default_rng(seed)
    for name, v in model.parameters().items():
        v[...] = rng.standard_normal(v.shape).astype(np.float32) * (scale * (0.2 if "lora_B" in name else 0.3))


def fp32_copy(model) -> zoo.Model:
    """A trainable fp32 model holding model's base as stored (widened)."""
    full = zoo.Model(model.config, seed=None)
    for name in model.base_tensor_names():
        full.set_base_tensor(name, model.base_tensor(name))
    return full


def merged(model) -> zoo.Model:
    """fp32_copy with every adapter merged into its module's weight: W + (alpha / r) B A (LoRA's
    scaling, written here from its definition)."""
    from zoo.arch.lora import adapters

    full = fp32_copy(model)
    p = model.parameters()
    for a in adapters(model.config, model.lora):
        w = a.module + ".weight"
        full.set_base_tensor(w, full.base_tensor(w) + model.lora.alpha / model.lora.r * p[a.module + ".lora_B.weight"]
                             @ p[a.module + ".lora_A.weight"])
    return full


# --- the adapter block ---------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [GPT2_TINY, LLAMA_TINY], ids=["gpt2", "llama"])
def test_new_adapters_leave_the_base_unchanged(cfg):
    tok, tgt = batch(cfg)
    base = zoo.Model(cfg, seed=3)
    lora = zoo.Model(cfg, seed=3, lora=LoraConfig(r=4), base_dtype="fp32")
    assert lora.loss(tok, tgt) == base.loss(tok, tgt)  # B starts at zero


@pytest.mark.parametrize("cfg", [GPT2_TINY, LLAMA_TINY], ids=["gpt2", "llama"])
@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj", "down_proj"]], ids=["all", "some"])
def test_adapters_compute_the_merged_model_and_its_chain_rule(cfg, targets):
    """The adapted model is the base with W + s B A; its adapters' gradients are the merged
    model's weight gradient G pulled back: dB = s G A^T, dA = s B^T G (the hand-written
    full-model pullbacks as the reference)."""
    if cfg is GPT2_TINY and targets:
        targets = ["c_attn", "mlp.c_proj"]
    tok, tgt = batch(cfg)
    model = zoo.Model(cfg, seed=3, lora=LoraConfig(r=4, alpha=6, targets=targets), base_dtype="fp32")
    randomize_adapters(model)
    full = merged(model)
    assert rel_err(model.logits(tok), full.logits(tok)) < 1e-5
    _, grads = model.loss_and_grads(tok, tgt)
    _, full_grads = full.loss_and_grads(tok, tgt)
    from zoo.arch.lora import adapters

    s, p = model.lora.alpha / model.lora.r, model.parameters()
    for a in adapters(cfg, model.lora):
        G = full_grads[a.module + ".weight"]
        A, B = p[a.module + ".lora_A.weight"], p[a.module + ".lora_B.weight"]
        assert rel_err(grads[a.module + ".lora_B.weight"], s * G @ A.T) < 1e-3, a.module
        assert rel_err(grads[a.module + ".lora_A.weight"], s * B.T @ G) < 1e-3, a.module


@pytest.mark.parametrize("frozen", [False, True], ids=["full", "lora"])
def test_the_profile_times_the_lm_head_apart_from_the_layers(frozen):
    from zoo.generate import generate

    model = zoo.Model(LLAMA_TINY, seed=3, **({"lora": LoraConfig(r=4), "base_dtype": "bf16"} if frozen else {}))
    tok, tgt = batch(LLAMA_TINY)
    model.set_profiling(True)
    model.forward_backward(tok, tgt)
    profile = model.block_profile()
    for kind in ("linear", "lm_head"):
        forward, pullback = profile[kind]
        assert forward > 0 and pullback > 0, (kind, profile[kind])
    model.set_profiling(True)  # starts again from zero
    generate(model, [1, 2, 3], max_new_tokens=3)
    forward, pullback = model.block_profile()["lm_head"]
    assert forward > 0 and pullback == 0


def test_targets_name_modules_and_unknown_ones_are_refused():
    m = zoo.Model(LLAMA_TINY, seed=0, lora=LoraConfig(r=2, targets=["q_proj", "v_proj"]), base_dtype="fp32")
    assert sorted({n.split(".")[-3] for n in m.parameters()}) == ["q_proj", "v_proj"]
    assert m.lora.targets == ["q_proj", "v_proj"]
    assert zoo.Model(LLAMA_TINY, seed=0, lora=LoraConfig(r=2)).lora.targets == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with pytest.raises(ValueError, match="c_attn.*match no module.*q_proj"):
        zoo.Model(LLAMA_TINY, lora=LoraConfig(targets=["c_attn"]))


def test_dropout_draws_masks_per_pass_and_only_in_training():
    cfg = LLAMA_TINY
    tok, tgt = batch(cfg)
    lora = LoraConfig(r=4, dropout=0.3)
    a = zoo.Model(cfg, seed=3, lora=lora, base_dtype="fp32")
    b = zoo.Model(cfg, seed=3, lora=lora, base_dtype="fp32")
    plain = zoo.Model(cfg, seed=3, lora=LoraConfig(r=4), base_dtype="fp32")
    for m in (a, b, plain):
        randomize_adapters(m)
    assert a.loss(tok, tgt) == plain.loss(tok, tgt)  # evaluation drops nothing
    la, ga = a.loss_and_grads(tok, tgt)
    lb, gb = b.loss_and_grads(tok, tgt)
    assert la == lb and all(np.array_equal(ga[k], gb[k]) for k in ga)  # the same masks for the same pass
    assert la != plain.loss(tok, tgt)
    again, _ = a.loss_and_grads(tok, tgt)  # the next pass of the step draws other masks
    assert again != la


# --- the frozen base's formats -------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bf16", "int8", "nf4"])
def test_each_format_is_within_its_stated_bound(fmt):
    m = zoo.Model(WIDE_VOCAB, seed=5, base_dtype=fmt)
    ref = zoo.Model(WIDE_VOCAB, seed=5)
    for name in ("model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        w = ref.base_tensor(name).astype(np.float64)
        w[0, :7] *= 40  # an outlier row and block
        m.set_base_tensor(name, w)
        err = np.abs(m.base_tensor(name) - w)
        if fmt == "bf16":
            bound = np.abs(w) * 2.0**-8
        elif fmt == "int8":
            bound = np.abs(w).max(axis=1, keepdims=True) / 254
        else:
            blocks = np.abs(np.pad(w, ((0, 0), (0, -w.shape[1] % 64)))).reshape(w.shape[0], -1, 64).max(axis=2)
            bound = np.repeat(blocks, 64, axis=1)[:, :w.shape[1]] * 0.1520
        slack = 1e-6 * np.abs(w).max(axis=1, keepdims=True)  # float32 arithmetic of the scales
        assert (err <= bound + slack).all(), (name, float((err - bound).max()))
        assert err.max() > 0


@pytest.mark.parametrize("fmt", ["bf16", "int8", "nf4"])
def test_products_on_a_stored_base_equal_fp32_products_on_its_values(fmt):
    """The products widen the stored matrix a tile at a time (the LM head here in two tiles): in
    fp32 they equal a plain model holding the widened values, logits and adapter gradients."""
    tok, tgt = batch(WIDE_VOCAB, T=8)
    m = zoo.Model(WIDE_VOCAB, seed=5, lora=LoraConfig(r=4), base_dtype=fmt)
    randomize_adapters(m)
    ref = zoo.Model(WIDE_VOCAB, seed=None, lora=LoraConfig(r=4), base_dtype="fp32")
    for name in m.base_tensor_names():
        ref.set_base_tensor(name, m.base_tensor(name))
    for k, v in m.parameters().items():
        ref.parameters()[k][...] = v
    assert rel_err(m.logits(tok), ref.logits(tok)) < 1e-5
    _, g = m.loss_and_grads(tok, tgt)
    _, gr = ref.loss_and_grads(tok, tgt)
    for k in gr:
        assert rel_err(g[k], gr[k]) < 1e-4, k


@pytest.mark.skipif(not BF16, reason="no bf16 dot products on this CPU")
@pytest.mark.parametrize("fmt", ["bf16", "nf4"])
def test_bf16_products_on_a_stored_base_stay_close(fmt):
    tok, tgt = batch(WIDE_VOCAB, T=8)
    m = zoo.Model(WIDE_VOCAB, seed=5, lora=LoraConfig(r=4), base_dtype=fmt, precision="bf16")
    ref = zoo.Model(WIDE_VOCAB, seed=5, lora=LoraConfig(r=4), base_dtype=fmt)
    # Adapters of a trained run's size: ten times larger, they make the attention scores so
    # large that the softmax turns bf16's rounding of q and k into a 5% change of the logits.
    randomize_adapters(m, scale=0.1)
    randomize_adapters(ref, scale=0.1)
    # bf16's error, and not fp32's: the products must really run in bf16.
    assert 1e-4 < rel_err(m.logits(tok), ref.logits(tok)) < 2e-2
    _, g = m.loss_and_grads(tok, tgt)
    _, gr = ref.loss_and_grads(tok, tgt)
    for k in gr:  # and bf16's error in every adapter gradient
        assert 1e-4 < rel_err(g[k], gr[k]) < 5e-2, k


# --- what is allocated -----------------------------------------------------------------------


def test_a_forward_only_model_allocates_weights_and_cache_only():
    from zoo.generate import generate

    for m in (zoo.Model(LLAMA_TINY, seed=1), zoo.Model(LLAMA_TINY, seed=1, base_dtype="bf16")):
        generate(m, [1, 2, 3], 5, temperature=0)
        m.logits(np.array([[1, 2, 3]]))
        sizes = m.arena_bytes()
        assert sizes["gradients"] == 0 and sizes["moments"] == 0, sizes
        assert sizes["kv_cache"] > 0
    q = zoo.Model(LLAMA_TINY, seed=1, base_dtype="bf16")
    full = zoo.Model(LLAMA_TINY, seed=1)
    assert q.arena_bytes()["frozen_base"] < 0.55 * full.arena_bytes()["weights"]
    with pytest.raises(RuntimeError, match="frozen and it has no adapters"):
        q.forward_backward(*batch(LLAMA_TINY))


def test_a_lora_step_allocates_training_state_for_the_adapters_alone():
    m = zoo.Model(LLAMA_TINY, seed=1, lora=LoraConfig(r=4), base_dtype="int8")
    assert m.arena_bytes()["gradients"] == 0
    m.forward_backward(*batch(LLAMA_TINY))
    m.adamw_step(1e-3)
    sizes = m.arena_bytes()
    assert sizes["weights"] == sizes["gradients"] == 4 * m.n_params
    assert sizes["moments"] == 8 * m.n_params
    assert m.n_params == sum(v.size for v in m.parameters().values())
    assert sizes["frozen_base"] < 0.3 * 4 * num_parameters(LLAMA_TINY)


# --- runs ------------------------------------------------------------------------------------


def test_a_run_that_cannot_fit_is_refused_up_front_with_what_would(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 200)
    r = cli("train", "--preset", "smollm-135m", "--data", text, "--steps", "1", "--out", tmp_path / "run",
            "--batch-size", "4", "--seq-len", "256", env={"ZOO_MEMORY_AVAILABLE": str(1_500_000_000)})
    assert r.returncode == 3, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "needs" in line and "weights" in line and "AdamW moments" in line and "1.40 GiB (1,500,000,000 bytes) is available" in line
    assert "would fit: --lora (" in line and "--lora --base-dtype int8 (" in line
    assert not (tmp_path / "run" / "train.log").exists()  # refused before anything was made
    # A LoRA run fits where the full one did not.
    ok = cli("train", "--preset", "smollm-135m", "--data", text, "--steps", "1", "--out", tmp_path / "lora",
             "--batch-size", "1", "--seq-len", "32", "--lora", "--no-progress", "--sample-tokens", "0",
             "--threads", "1",
             env={"ZOO_MEMORY_AVAILABLE": str(1_500_000_000)}, timeout=300)
    assert ok.returncode == 0, ok.stderr


@pytest.fixture(scope="module")
def shakespeare_ids(tmp_path_factory):
    """tinyshakespeare as stories260K's byte tokens (its vocabulary's ids 3..258 are bytes)."""
    path = tmp_path_factory.mktemp("data") / "shakespeare.npy"
    raw = shared(SHAKESPEARE).read_bytes()[:150_000]
    np.save(path, np.frombuffer(raw, np.uint8).astype(np.int32) + 3)
    return path


@needs_shared(STORIES)
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_lora_on_a_quantized_base_lowers_the_loss(tmp_path, shakespeare_ids, fmt):
    out = tmp_path / "run"
    r = cli("finetune", "--from", STORIES, "--lora", "--lora-r", "16", "--base-dtype", fmt, "--data",
            shakespeare_ids, "--steps", "40", "--batch-size", "8", "--seq-len", "128", "--lr", "1e-2",
            "--eval-every", "40", "--out", out, "--no-progress", "--sample-tokens", "0", "--threads", "1", timeout=300)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [x["val_loss"] for x in records if x.get("val_loss") is not None]
    assert val[-1] < val[0] - 0.3, val
    assert f"the {fmt} base is frozen" in (out / "train.log").read_text()
    # The run folder is a PEFT adapter on its base: eval gives the run's last validation loss.
    e = cli("eval", "--from", out, "--split", "val", "--json", tmp_path / "eval.json", timeout=300)
    assert e.returncode == 0, e.stderr
    assert abs(json.loads((tmp_path / "eval.json").read_text())["loss"] - val[-1]) < 1e-6


def test_a_resumed_lora_run_is_exact(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(300)))

    def cfg(name, **kw):
        return TrainConfig(preset="tiny-llama", data=[str(text)], out=str(tmp_path / name), steps=10, save_every=4,
                           batch_size=4, seq_len=32, lr=1e-2, lora=True, lora_r=4, lora_dropout=0.1,
                           base_dtype="nf4", progress=False, sample_tokens=0, **kw)

    full = Trainer(cfg("full"))
    full.run()

    def stop_at(step):
        def hook(done, loss):
            if done == step:
                import signal

                signal.raise_signal(signal.SIGINT)
        return hook

    with pytest.raises(TrainInterrupted):
        Trainer(cfg("cut")).run(on_step=stop_at(6))
    resumed = Trainer(cfg("cut", resume=True))
    assert resumed.step == 6
    resumed.run()
    for k, v in full.model.parameters().items():
        assert np.array_equal(v, resumed.model.parameters()[k]), k
    assert np.array_equal(full.model.optimizer_state()["v"], resumed.model.optimizer_state()["v"])


@needs_clad
@pytest.mark.parametrize("cfg", [GPT2_TINY, LLAMA_TINY], ids=["gpt2", "llama"])
def test_the_adapters_clad_pullback_equals_the_hand_written_one(cfg):
    tok, tgt = batch(cfg)
    lora = LoraConfig(r=4, alpha=8, dropout=0.2)
    manual = zoo.Model(cfg, seed=2, lora=lora, base_dtype="fp32")
    clad = zoo.Model(cfg, seed=2, lora=lora, base_dtype="fp32", ad={"lora": "clad"})
    assert clad.ad["lora"] == "clad" and manual.ad["lora"] == "manual"
    randomize_adapters(manual)
    randomize_adapters(clad)
    lm, gm = manual.loss_and_grads(tok, tgt)
    lc, gc = clad.loss_and_grads(tok, tgt)
    assert lm == lc
    for k in gm:
        assert rel_err(gc[k], gm[k]) < 1e-5, k


def test_inspect_works_from_a_preset_name_or_a_config_alone(tmp_path, capsys, monkeypatch):
    from zoo.cli import main
    from zoo.io.checkpoints import save_pretrained
    from zoo.io.inspect import format_inspection, inspect_checkpoint

    monkeypatch.setenv("ZOO_MEMORY_AVAILABLE", str(12 * 2**30))
    report = inspect_checkpoint("llama-3.1-8b", seq_len=256)
    plain = {name: n for name, n, _ in report["memory_options"]}
    full, bf16, int8, nf4 = (plain[k] for k in ("full finetune (fp32, AdamW)", "LoRA r=16, bf16 base",
                                                "LoRA r=16, int8 base", "LoRA r=16, nf4 base"))
    assert nf4 < int8 < bf16 < plain["full finetune (bf16 products)"] < full
    assert report["parameters"] == num_parameters(zoo.preset("llama-3.1-8b"))
    text = format_inspection(report)
    assert "none read" in text and "LoRA r=16, nf4 base" in text and "does not fit" in text and "  fits" in text
    # config.json alone, and a folder holding only it: the same figures, no weights read
    save_pretrained(zoo.Model(LLAMA_TINY, seed=0), tmp_path / "ckpt")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_bytes((tmp_path / "ckpt" / "config.json").read_bytes())
    from_file = inspect_checkpoint(tmp_path / "cfg" / "config.json", seq_len=16)
    from_folder = inspect_checkpoint(tmp_path / "cfg", seq_len=16)
    with_weights = inspect_checkpoint(tmp_path / "ckpt", seq_len=16)
    assert from_file["memory_options"] == from_folder["memory_options"] == with_weights["memory_options"]
    assert from_file["weights"] is None and with_weights["loadable"] == "yes"
    assert main(["inspect", "smollm-135m", "--lora-r", "8"]) == 0
    assert "LoRA r=8, int8 base" in capsys.readouterr().out
    assert main(["inspect", "no-such-preset"]) == 1


def test_a_frozen_base_is_initialized_as_the_full_model_a_block_of_rows_at_a_time(monkeypatch):
    import zoo.model

    monkeypatch.setattr(zoo.model, "_INIT_CHUNK_VALUES", 100)  # many blocks per tensor
    frozen = zoo.Model(LLAMA_TINY, seed=4, base_dtype="fp32", lora=LoraConfig(r=2))
    full = zoo.Model(LLAMA_TINY, seed=4)
    for name in full.base_tensor_names():
        assert np.array_equal(frozen.base_tensor(name), full.base_tensor(name)), name


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "nf4"])
def test_stored_matrix_products_over_many_tiles_equal_numpy(fmt):
    """Both products (x W^T, dy W) with W widened a tile and a block of rows at a time (here
    five forward tiles and two pullback blocks) equal numpy's on the stored values."""
    from zoo.core._native import stored_matrix_product

    rng = np.random.default_rng(0)
    W = rng.standard_normal((50000, 96)).astype(np.float32)
    x, dy = rng.standard_normal((5, 96)).astype(np.float32), rng.standard_normal((5, 50000)).astype(np.float32)
    widened = _as_stored(zoo.Model(WIDE_VOCAB, seed=None, base_dtype=fmt), W)
    y, _ = stored_matrix_product(x, W, fmt, "fp32", False)
    dx, _ = stored_matrix_product(dy, W, fmt, "fp32", True)
    assert rel_err(y, x.astype(np.float64) @ widened.T) < 1e-5
    assert rel_err(dx, dy.astype(np.float64) @ widened) < 1e-5


@pytest.mark.parametrize("fmt", ["bf16", "int8", "nf4"])
def test_fp32_products_of_a_narrow_matrix_are_the_same_bits_on_any_thread_count(fmt):
    """On OpenBLAS an fp32 product with a narrow W runs on zoo's threads, each widening its own
    rows (forward) or columns (input gradient) of W a chunk at a time. 700 x 4100 gives each of
    1-3 threads several chunks, column ranges of unequal width and a short last nf4 block. The
    results equal numpy's on the stored values, are the same bits whatever the thread count,
    and leave OpenBLAS on the threads it had."""
    from zoo.core._native import stored_matrix_product

    if zoo.gemm_info()["fp32"] != "openblas":
        pytest.skip(f"fp32 products run on {zoo.gemm_info()['fp32']} here (ZOO_GEMM), not by thread")
    rng = np.random.default_rng(0)
    W = rng.standard_normal((700, 4100)).astype(np.float32)
    x, dy = rng.standard_normal((7, 4100)).astype(np.float32), rng.standard_normal((7, 700)).astype(np.float32)
    stored = stored_matrix_product(np.eye(4100, dtype=np.float32), W, fmt, "fp32", False)[0].T
    results = []
    for n in (1, 2, 3):
        zoo.set_threads(n)
        y, dx = stored_matrix_product(x, W, fmt, "fp32", False)[0], stored_matrix_product(dy, W, fmt, "fp32", True)[0]
        assert zoo.gemm_info()["openblas_threads"] == n
        assert rel_err(y, x.astype(np.float64) @ stored.T) < 1e-5
        assert rel_err(dx, dy.astype(np.float64) @ stored) < 1e-5
        results.append((y, dx))
    for y, dx in results[1:]:
        assert np.array_equal(y, results[0][0]) and np.array_equal(dx, results[0][1])


@needs_bf16
@pytest.mark.parametrize("fmt", ["bf16", "int8", "nf4"])
def test_stored_matrix_bf16_products_over_two_tiles_equal_the_rounded_operands(fmt):
    """A bf16 product widens an int8 or nf4 base to bf16 a tile (forward) or block (pullback) of
    about 4M values at a time: two of each here. Each result is the product of x (or dy) and the
    stored values, both rounded to bf16, summed in fp32: a tile read at a wrong offset, or an
    operand rounded differently, is far outside the bound."""
    from zoo.core._native import stored_matrix_product

    rng = np.random.default_rng(1)
    W = rng.standard_normal((50000, 96)).astype(np.float32)
    x, dy = rng.standard_normal((5, 96)).astype(np.float32), rng.standard_normal((5, 50000)).astype(np.float32)
    widened = bf16_round(_as_stored(zoo.Model(WIDE_VOCAB, seed=None, base_dtype=fmt), W)).astype(np.float64)
    y, _ = stored_matrix_product(x, W, fmt, "bf16", False)
    dx, _ = stored_matrix_product(dy, W, fmt, "bf16", True)
    assert rel_err(y, bf16_round(x).astype(np.float64) @ widened.T) < 1e-5
    assert rel_err(dx, bf16_round(dy).astype(np.float64) @ widened) < 1e-5


@needs_bf16
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_a_widened_bases_forward_tiles_run_on_the_kernel_of_one_whole_product(fmt):
    """A bf16 forward over an int8 or nf4 base runs a product per tile of rows (here 16384 and
    4096), each into a packed block copied into its columns of y: into those strided columns
    themselves, oneDNN 3.2 takes its slower gemm:jit kernel where the whole product over a bf16 base
    takes brgemm. Each tile lands in its own columns, written, or added to what y holds (a bias or
    residual)."""
    from zoo.core import _native

    rng = np.random.default_rng(2)
    W = rng.standard_normal((20480, 256)).astype(np.float32)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    _native.gemm_kernels_used(reset=True)
    _native.stored_matrix_product(x, W, "bf16", "bf16", False)
    (whole,) = {u["kernel"] for u in _native.gemm_kernels_used(reset=True)}
    y, _ = _native.stored_matrix_product(x, W, fmt, "bf16", False)
    tiles = _native.gemm_kernels_used(reset=True)
    assert sorted(u["N"] for u in tiles) == [4096, 16384]
    assert {u["kernel"] for u in tiles} == {whole}
    widened = bf16_round(_native.widen(W, fmt)).astype(np.float64)
    exact = bf16_round(x).astype(np.float64) @ widened.T
    assert rel_err(y, exact) < 1e-5
    bias = rng.standard_normal((5, 20480)).astype(np.float32)
    added, _ = _native.stored_matrix_product(x, W, fmt, "bf16", False, add_to=bias)
    assert rel_err(added, exact + bias) < 1e-5


def _as_stored(model, W):
    """W's rows as the model's format stores them, through its (96, 96) q_proj, 96 rows at a time
    (every format stores rows independently)."""
    name = "model.layers.0.self_attn.q_proj.weight"
    out = np.empty_like(W)
    for r0 in range(0, W.shape[0], 96):
        block = np.zeros((96, 96), np.float32)
        rows = W[r0:r0 + 96]
        block[:len(rows)] = rows
        model.set_base_tensor(name, block)
        out[r0:r0 + 96] = model.base_tensor(name)[:len(rows)]
    return out
