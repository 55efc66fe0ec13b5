"""A bf16 frozen base packed for its input gradients (Model.set_packed_base, --packed-base): the
products read a second copy of the base's matrices in the layout the bf16 kernels take, and
give the same bits as from the matrices as stored (the same kernel reads either: gemm_rounding);
a base stored or mapped again is packed again; the memory estimate counts the copy; a run may
pack or not across a resume; runs that cannot use it are refused."""

import numpy as np
import pytest
from helpers import BF16, LLAMA_TINY, gemm_rounding, needs_bf16, random_batch

import zoo
from zoo import LoraConfig, ModelConfig
from zoo.arch.memory import (
    check_finetune_fits,
    finetune_memory_bytes,
    packed_base_bytes,
)
from zoo.core.errors import ResourceError
from zoo.core.native import _native
from zoo.train.config import TrainConfig
from zoo.train.trainer import Trainer, TrainInterrupted

# LLAMA_TINY's rows of 48 and 80 are no multiple of the kernels' blocks of 64 columns; its head is
# its own matrix. Here the head is the token embedding, whose 2,100 rows take two blocks of an
# input gradient (2,048 and 52).
TIED_WIDE = ModelConfig(vocab_size=2100, max_seq_len=16, d_model=64, n_layer=1, n_head=4, d_ff=128,
                        norm="rmsnorm", mlp="swiglu", positions="rope", attention_bias=False, mlp_bias=False,
                        tied_embeddings=True)


def batch(cfg):
    return random_batch(cfg, B=2, T=12, ignored=0)


def lora_model(cfg, packed=False, seed=1, precision="bf16"):
    m = zoo.Model(cfg, lora=LoraConfig(r=4), seed=seed)
    m.init_adapters(seed + 1)  # B nonzero: the adapters' products count in the gradients
    m.set_precision(precision)
    if packed:
        m.set_packed_base(True)
    return m


def prepacked_calls():
    """Products read from a packed copy since the last call."""
    return sum(k["calls"] for k in _native.gemm_kernels_used(reset=True) if "weights prepacked" in k["kernel"])


@needs_bf16
@gemm_rounding
@pytest.mark.parametrize("M,rows,cols,add", [(37, 2048 + 80, 96, False), (64, 300, 128, True), (1, 130, 64, False)])
def test_a_packed_matrix_gives_the_bits_of_the_stored_one(M, rows, cols, add):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    dy = rng.standard_normal((M, rows), dtype=np.float32)
    add_to = rng.standard_normal((M, cols), dtype=np.float32) if add else None
    stored, _ = _native.stored_matrix_product(dy, w, "bf16", "bf16", True, 1, add_to)
    prepacked_calls()
    packed, _ = _native.stored_matrix_product(dy, w, "bf16", "bf16", True, 1, add_to, True)
    assert prepacked_calls() > 0  # (a block whose rows no kernel takes packed falls back to W as stored)
    assert np.array_equal(stored, packed)
    assert _native.packed_matrix_bytes(rows, cols) >= _native.storage_bytes("bf16", rows, cols)


@pytest.mark.skipif(BF16, reason="this CPU has bf16 kernels")
def test_without_bf16_kernels_nothing_is_packed_and_packing_is_refused():
    assert packed_base_bytes(LLAMA_TINY) == 0 and _native.packed_matrix_bytes(2048, 64) == 0
    m = lora_model(LLAMA_TINY, precision="fp32")  # a LoRA run's products here
    with pytest.raises(ValueError, match="its products in fp32"):
        m.set_packed_base(True)


@needs_bf16
@gemm_rounding
@pytest.mark.parametrize("cfg", [LLAMA_TINY, TIED_WIDE], ids=["own-head", "tied-head"])
def test_a_packed_base_gives_the_same_step_bit_for_bit(cfg):
    x, y = batch(cfg)
    ref = lora_model(cfg)
    loss, grads = ref.loss_and_grads(x, y)
    m = lora_model(cfg, packed=True)
    assert m.packed_base
    # The layers' matrices and the head's, as the estimate counts them; the untied embedding is not packed.
    assert m.arena_bytes()["packed_base"] == packed_base_bytes(cfg) > 0
    prepacked_calls()
    packed_loss, packed_grads = m.loss_and_grads(x, y)
    assert prepacked_calls() > 0
    assert packed_loss == loss
    for k, g in grads.items():
        assert np.array_equal(g, packed_grads[k]), k
    # The selected rows' head (preference losses) reads the packed copy too.
    for model in (ref, m):
        model.zero_grads()
        model.target_logprobs(x, y, train=True)
        prepacked_calls()
        model.backward_logprobs(np.ones(y.shape, np.float32))
        assert (prepacked_calls() > 0) == (model is m)
    for k, g in ref.gradients().items():
        assert np.array_equal(g, m.gradients()[k]), k
    with pytest.raises(ValueError, match="the base is packed for bf16 products"):
        m.set_precision("fp32")
    m.set_packed_base(False)
    assert not m.packed_base and m.arena_bytes()["packed_base"] == 0
    prepacked_calls()
    assert m.loss_and_grads(x, y)[0] == loss and prepacked_calls() == 0


@needs_bf16
@gemm_rounding
def test_a_base_stored_or_mapped_after_packing_is_packed_again(tmp_path):
    cfg = LLAMA_TINY
    x, y = batch(cfg)
    m, ref = lora_model(cfg, packed=True), lora_model(cfg)
    m.loss_and_grads(x, y)  # packed and read once

    def same_step():
        loss, grads = ref.loss_and_grads(x, y)
        packed_loss, packed_grads = m.loss_and_grads(x, y)
        assert packed_loss == loss
        for k, g in grads.items():
            assert np.array_equal(g, packed_grads[k]), k

    rng = np.random.default_rng(5)
    for name in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"):
        value = rng.standard_normal(m.base_tensor(name).shape).astype(np.float32)
        m.set_base_tensor(name, value)
        ref.set_base_tensor(name, value)
    same_step()
    # A matrix mapped from a file, bf16 values as stored, after the stores were packed.
    name = "model.layers.0.self_attn.o_proj.weight"
    ref.set_base_tensor(name, rng.standard_normal(m.base_tensor(name).shape).astype(np.float32))
    bits = (ref.base_tensor(name).view(np.uint32) >> 16).astype(np.uint16)  # exact: already bf16
    path = tmp_path / "o_proj.bin"
    path.write_bytes(b"\0" * 64 + bits.tobytes())
    m.map_base_tensor(name, path, 64)
    same_step()


def test_packing_is_refused_where_there_is_no_bf16_base_or_no_adapters():
    with pytest.raises(ValueError, match="this model has its base in int8"):
        zoo.Model(LLAMA_TINY, lora=LoraConfig(r=4), base_dtype="int8").set_packed_base(True)
    with pytest.raises(ValueError, match="this model has no adapters"):
        zoo.Model(LLAMA_TINY, base_dtype="bf16").set_packed_base(True)
    with pytest.raises(ValueError, match="this model has no adapters"):
        zoo.Model(LLAMA_TINY).set_packed_base(True)
    with pytest.raises(ValueError, match="--packed-base apply to a LoRA run"):
        TrainConfig(preset="tiny-llama", data=["x.txt"], packed_base=True)
    with pytest.raises(ValueError, match="--packed-base packs a bf16 base for bf16 products; this run has its base in nf4"):
        TrainConfig(preset="tiny-llama", data=["x.txt"], lora=True, base_dtype="nf4", packed_base=True)
    with pytest.raises(ValueError, match="its products in fp32"):
        TrainConfig(preset="tiny-llama", data=["x.txt"], lora=True, precision="fp32", packed_base=True)


def test_the_memory_estimate_counts_the_packed_copy():
    lora = LoraConfig(r=4)
    plain = finetune_memory_bytes(LLAMA_TINY, 2, 12, lora=lora)
    packed = finetune_memory_bytes(LLAMA_TINY, 2, 12, lora=lora, packed_base=True)
    assert plain.packed == 0 and packed.packed == packed_base_bytes(LLAMA_TINY)
    assert packed.total == plain.total + packed.packed
    nf4 = finetune_memory_bytes(LLAMA_TINY, 2, 12, lora=lora, base_dtype="nf4", packed_base=True)
    assert nf4.packed == 0


@needs_bf16
def test_a_run_that_fits_only_without_the_packed_copy_is_told_so(monkeypatch):
    lora = LoraConfig(r=4)
    plain = finetune_memory_bytes(LLAMA_TINY, 2, 12, precision="bf16", lora=lora)
    # Room for the run and a third of the copy (the copy holds the base's matrices, padded).
    monkeypatch.setenv("ZOO_MEMORY_AVAILABLE", str(plain.total + packed_base_bytes(LLAMA_TINY) // 3))
    assert check_finetune_fits(LLAMA_TINY, 2, 12, False, "bf16", lora, "bf16", "training") == plain
    with pytest.raises(ResourceError, match=r"its packed copy .* would fit: --no-packed-base \(.*"
                                            r"--base-dtype int8 --no-packed-base \("):
        check_finetune_fits(LLAMA_TINY, 2, 12, False, "bf16", lora, "bf16", "training", packed_base=True)
    model = lora_model(LLAMA_TINY)
    monkeypatch.setenv("ZOO_MEMORY_AVAILABLE", str(packed_base_bytes(LLAMA_TINY) - 1))
    with pytest.raises(ResourceError, match="a packed copy of the bf16 frozen base needs"):
        model.set_packed_base(True)
    assert not model.packed_base
    monkeypatch.setenv("ZOO_MEMORY_AVAILABLE", str(packed_base_bytes(LLAMA_TINY)))
    assert model.set_packed_base(True) > 0
    monkeypatch.setenv("ZOO_MEMORY_AVAILABLE", "0")
    assert model.set_packed_base(True) > 0  # packed again in the copy's own room: nothing more needed


@needs_bf16
@gemm_rounding
def test_a_run_packs_or_not_across_a_resume_and_takes_the_same_steps(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200)))

    def cfg(name, **kw):
        return TrainConfig(preset="tiny-llama", data=[str(text)], out=str(tmp_path / name), steps=6, save_every=3,
                           batch_size=2, seq_len=32, lr=1e-2, lora=True, lora_r=4, progress=False, sample_tokens=0,
                           **kw)

    plain = Trainer(cfg("plain"))
    plain.run()
    assert not plain.model.packed_base

    def stop_at_3(done, loss):
        if done == 3:
            import signal

            signal.raise_signal(signal.SIGINT)

    packed = Trainer(cfg("cut", packed_base=True))
    assert packed.model.packed_base
    with pytest.raises(TrainInterrupted):
        packed.run(on_step=stop_at_3)
    assert "packed base:" in (tmp_path / "cut" / "train.log").read_text()
    resumed = Trainer(cfg("cut", resume=True, packed_base=False))
    assert resumed.step == 3 and not resumed.model.packed_base
    resumed.run()
    for k, v in plain.model.parameters().items():
        assert np.array_equal(v, resumed.model.parameters()[k]), k
