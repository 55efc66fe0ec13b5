"""A frozen base's token embedding read from its checkpoint file through a memory map
(Model.map_base_tensor, chosen by load_pretrained for a bf16 base over a BF16 checkpoint whose
LM head is its own matrix): the same losses, gradients and logits as the embedding held in
memory, only the rows a pass reads resident, writes kept from the file, the cases that keep a
copy (tied head, other formats, full finetuning), and clear errors for short or corrupt files."""

import hashlib
import mmap
import re
import sys

import numpy as np
import pytest

import zoo
from zoo import LoraConfig, ModelConfig
from zoo.core.errors import CheckpointError
from zoo.io.safetensors import CheckpointReader

# A vocabulary whose bf16 embedding (20000 x 96) spans about 940 pages; heads of 24.
CFG = ModelConfig(vocab_size=20000, max_seq_len=32, d_model=96, n_layer=2, n_head=4, n_kv_head=2, head_dim=24,
                  d_ff=160, norm="rmsnorm", mlp="swiglu", positions="rope", attention_bias=False, mlp_bias=False,
                  tied_embeddings=False)
LORA = LoraConfig(r=4)
EMBEDDING = "model.embed_tokens.weight"


def batch(cfg, B=2, T=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))


def in_memory(cfg, base_dtype="bf16", lora=LORA):
    """zoo's init of cfg with its base in base_dtype, the embedding held in the base arena."""
    return zoo.Model(cfg, seed=0, lora=lora, base_dtype=base_dtype, precision="fp32")


def saved(model, folder, dtype="bfloat16"):
    """model's base values as a checkpoint folder (exact in bf16: they are bf16 already)."""
    full = zoo.Model(model.config, seed=None)
    for name in model.base_tensor_names():
        full.set_base_tensor(name, model.base_tensor(name))
    full.save_pretrained(folder, dtype=dtype)
    return folder


def same_adapters(*models):
    for m in models:  # B nonzero, so that every adapter has a gradient
        rng = np.random.default_rng(1)
        for v in m.parameters().values():
            v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.1


def mapped_bytes(model):
    return model.arena_bytes()["frozen_base_mapped"]


def test_mapped_embedding_gives_the_same_losses_gradients_and_logits(tmp_path):
    ref = in_memory(CFG)
    folder = saved(ref, tmp_path / "ck")
    model = zoo.Model.from_pretrained(folder, lora=LORA, base_dtype="bf16", precision="fp32")
    assert mapped_bytes(model) == CFG.vocab_size * CFG.d_model * 2
    assert model.arena_bytes()["frozen_base"] == ref.arena_bytes()["frozen_base"] - mapped_bytes(model)
    assert np.array_equal(model.base_tensor(EMBEDDING), ref.base_tensor(EMBEDDING))
    same_adapters(ref, model)
    x, y = batch(CFG)
    for step in range(2):  # a step, AdamW, and the step after it
        losses, grads = zip(*(m.loss_and_grads(x, y) for m in (ref, model)))
        assert losses[0] == losses[1], step
        assert grads[0].keys() == grads[1].keys()
        for k in grads[0]:
            assert np.array_equal(grads[0][k], grads[1][k]), (step, k)
        for m in (ref, model):
            m.adamw_step(1e-2, max_grad_norm=1.0)
    assert np.array_equal(ref.logits(x), model.logits(x))
    for m in (ref, model):  # generation reads the embedding too
        m.reset_cache(1, 8)
    assert np.array_equal(ref.forward_cached(x[:1, :5], 0), model.forward_cached(x[:1, :5], 0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_only_the_rows_a_pass_reads_are_resident(tmp_path):
    folder = saved(in_memory(CFG), tmp_path / "ck")
    model = zoo.Model.from_pretrained(folder, lora=LORA, base_dtype="bf16", precision="fp32")

    def resident_kib():  # the checkpoint's mappings in this process (the embedding's, once loaded)
        total = 0
        for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
            if str(folder) in block.split("\n", 1)[0]:
                total += int(re.search(r"\nRss:\s+(\d+) kB", block).group(1))
        return total

    assert resident_kib() == 0  # loading scanned every row and kept none
    x, y = batch(CFG, B=1, T=24)
    model.loss_and_grads(x, y)
    rows, page = np.unique(x), mmap.PAGESIZE  # 4 KiB on x86-64; 16 or 64 KiB on some ARM kernels
    pages = len({(r * CFG.d_model * 2) // page for r in rows} | {((r + 1) * CFG.d_model * 2 - 1) // page for r in rows})
    table_kib = CFG.vocab_size * CFG.d_model * 2 // 1024
    if page // 1024 * (pages + 2) >= table_kib // 10:
        pytest.skip(f"pages of {page // 1024} KiB: the pages of the rows read are a tenth of this test's table")
    # a page per row read (and the neighbour of a row across a page boundary), not the table
    assert 0 < resident_kib() <= page // 1024 * (pages + 2) < table_kib // 10


def test_stores_into_the_mapped_embedding_change_the_model_not_the_file(tmp_path):
    folder = saved(in_memory(CFG), tmp_path / "ck")
    weights = folder / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    model = zoo.Model.from_pretrained(folder, lora=LORA, base_dtype="bf16", precision="fp32")
    rows = np.full((3, CFG.d_model), 0.5, np.float32)
    model.set_base_tensor(EMBEDDING, rows, first_row=7)
    assert np.array_equal(model.base_tensor(EMBEDDING)[7:10], rows)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest
    again = zoo.Model.from_pretrained(folder, lora=LORA, base_dtype="bf16", precision="fp32")
    assert not np.array_equal(again.base_tensor(EMBEDDING)[7:10], rows)


@pytest.mark.parametrize("case", ["tied", "fp32 checkpoint", "int8", "nf4", "full finetuning"])
def test_a_copy_where_the_file_cannot_serve(tmp_path, case):
    """A tied embedding (the head reads all of it), a checkpoint in another format than the
    base's, a quantized base and a base that trains keep the embedding in memory, as before."""
    cfg = CFG.model_copy(update={"tied_embeddings": True}) if case == "tied" else CFG
    base = {"int8": "int8", "nf4": "nf4"}.get(case, "bf16")
    lora = None if case == "full finetuning" else LORA
    src = in_memory(cfg)
    folder = saved(src, tmp_path / "ck", dtype="float32" if case == "fp32 checkpoint" else "bfloat16")
    model = zoo.Model.from_pretrained(folder, lora=lora, base_dtype=base if lora else None, precision="fp32")
    assert mapped_bytes(model) == 0
    # the reference: every tensor stored as loading stores it
    ref = zoo.Model(cfg, seed=None, lora=lora, base_dtype=base if lora else None, precision="fp32")
    for name in src.base_tensor_names():
        ref.set_base_tensor(name, src.base_tensor(name))
    if lora:
        ref.init_adapters(0)
        same_adapters(ref, model)
    x, y = batch(cfg)
    (l0, g0), (l1, g1) = ref.loss_and_grads(x, y), model.loss_and_grads(x, y)
    assert l0 == l1
    for k in g0:
        assert np.array_equal(g0[k], g1[k]), k
    if case == "full finetuning":
        assert np.abs(g1[EMBEDDING]).sum() > 0  # the embedding trains, in memory


def test_a_truncated_checkpoint_names_the_file_and_tensor(tmp_path):
    folder = saved(in_memory(CFG), tmp_path / "ck")
    weights = folder / "model.safetensors"
    with CheckpointReader(folder) as r:
        last = max(r.names, key=lambda n: r.info(n).end)
    data = weights.read_bytes()
    weights.write_bytes(data[:-1000])
    with pytest.raises(CheckpointError) as e:
        zoo.Model.from_pretrained(folder, lora=LORA, base_dtype="bf16")
    assert str(weights) in str(e.value) and repr(last) in str(e.value) and "truncated" in str(e.value)


def test_a_nonfinite_mapped_embedding_is_refused_by_name(tmp_path):
    src = in_memory(CFG)
    full = zoo.Model(CFG, seed=None)
    for name in src.base_tensor_names():
        full.set_base_tensor(name, src.base_tensor(name))
    full.parameters()[EMBEDDING][123, 4] = np.nan
    full.save_pretrained(tmp_path / "ck", dtype="bfloat16")
    with pytest.raises(CheckpointError, match=re.escape(repr(EMBEDDING))):
        zoo.Model.from_pretrained(tmp_path / "ck", lora=LORA, base_dtype="bf16")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        model = zoo.Model.from_pretrained(tmp_path / "ck", lora=LORA, base_dtype="bf16", allow_nonfinite=True)
    assert mapped_bytes(model) > 0 and np.isnan(model.base_tensor(EMBEDDING)[123, 4])


def test_map_base_tensor_errors_name_the_file_and_tensor(tmp_path):
    model = in_memory(CFG)
    short = tmp_path / "short.bin"
    short.write_bytes(b"\0" * 1000)
    with pytest.raises(ValueError) as e:
        model.map_base_tensor(EMBEDDING, short, 8)
    assert str(short) in str(e.value) and repr(EMBEDDING) in str(e.value) and "1000" in str(e.value)
    with pytest.raises(ValueError, match="no such|cannot open"):
        model.map_base_tensor(EMBEDDING, tmp_path / "missing.bin", 0)
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (CFG.vocab_size * CFG.d_model * 2 + 8))
    with pytest.raises(ValueError, match="not aligned"):
        model.map_base_tensor(EMBEDDING, big, 1)
    with pytest.raises(ValueError, match="fused"):
        model.map_base_tensor("model.layers.0.self_attn.k_proj.weight", big, 0)
    with pytest.raises(ValueError, match="nf4"):
        in_memory(CFG, "nf4").map_base_tensor(EMBEDDING, big, 0)
    with pytest.raises(ValueError, match="trains its weights"):
        zoo.Model(CFG, seed=0).map_base_tensor(EMBEDDING, big, 0)
    assert mapped_bytes(model) == 0  # nothing was mapped by a refused call
