"""Every MLP activation of the block registry (zoo.core.blocks.activations()) in whole models:
logits, loss and every gradient against the independent PyTorch reference
(zoo/tools/torch_reference.py), in both families' naming, stored and checkpointed, on each
pullback this build has for the block; a frozen base under LoRA adapters (the executor's
unfused activation pullback) against the chain rule; training lowers the loss, and a
checkpoint saves and loads back. A block added to the registry is tested here without an edit
to this file (its PyTorch reference goes in torch_reference.MLPS). Block-level checks are in
test_blocks.py, Clad against hand-written in test_clad.py."""

import warnings

import numpy as np
import pytest

import zoo
from zoo import LoraConfig, ModelConfig
from zoo.core import blocks


def gpt2_named(mlp: str) -> ModelConfig:
    return ModelConfig(vocab_size=61, max_seq_len=32, d_model=32, n_layer=2, n_head=4, d_ff=40, mlp=mlp)


def llama_named(mlp: str) -> ModelConfig:
    return ModelConfig(vocab_size=67, max_seq_len=32, d_model=36, n_layer=2, n_head=6, n_kv_head=2, d_ff=44,
                       norm="rmsnorm", mlp=mlp, positions="rope", attention_bias=False, mlp_bias=False,
                       tied_embeddings=False)


FAMILIES = {"gpt2_named": gpt2_named, "llama_named": llama_named}


def pullback_backends(name: str) -> list[str]:
    """The pullbacks this build has for the block: "manual", "clad" (none for a block written as
    its forward only, in a build without Clad)."""
    info = next(b for b in blocks.blocks() if b["name"] == name)
    return [backend for backend in ("manual", "clad") if info[backend]]


# (activation, backend or None): None where the build can run the block forward only.
RUNS = [(name, backend) for name in blocks.activations() for backend in pullback_backends(name) or [None]]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def randomize(model: zoo.Model, seed: int) -> None:
    """Non-trivial norms and biases so every gradient path is exercised."""
    rng = np.random.default_rng(seed)
    for name, v in model.parameters().items():
        if v.ndim == 1:
            v[...] = (1.0 if "norm" in name or "ln" in name else 0.0) + 0.1 * rng.standard_normal(v.shape)


def batch(cfg, B=2, T=12, seed=3):
    rng = np.random.default_rng(seed)
    tokens, targets = rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))
    targets[0, :2] = -100
    return tokens, targets


@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "checkpointed"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name,backend", RUNS)
def test_model_matches_the_torch_reference(name, backend, family, checkpointing):
    pytest.importorskip("torch")
    from zoo.tools.torch_reference import Reference

    cfg = FAMILIES[family](name)
    model = zoo.Model(cfg, seed=1, checkpointing=checkpointing, ad={name: backend} if backend else "manual")
    assert model.ad[name] == backend
    randomize(model, 2)
    tokens, targets = batch(cfg)
    ref = Reference(cfg, model.parameters())
    assert np.abs(model.logits(tokens) - ref.logits(tokens).detach().numpy()).max() <= 1e-4
    if backend is None:
        pytest.skip(f"{name} trains on Clad's pullback only; this build runs it forward only")
    loss, grads = model.loss_and_grads(tokens, targets)
    ref_loss, ref_grads = ref.loss_and_grads(tokens, targets)
    assert abs(loss - ref_loss) <= 1e-5
    assert set(grads) == set(ref_grads)
    for k in grads:
        assert rel_err(grads[k], ref_grads[k]) <= 1e-3, k


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name,backend", [run for run in RUNS if run[1]])
def test_lora_adapters_follow_the_chain_rule(name, backend, family):
    """A frozen base runs the activation's plain pullback (the fused one recomputes for the
    weight gradient, which a frozen base has none of). Its adapters' gradients are the merged
    model's weight gradient G pulled back: dB = s G A^T, dA = s B^T G."""
    from zoo.arch.lora import adapters

    cfg = FAMILIES[family](name)
    model = zoo.Model(cfg, seed=3, lora=LoraConfig(r=4, alpha=6), base_dtype="fp32", ad={name: backend})
    rng = np.random.default_rng(1)
    for k, v in model.parameters().items():
        v[...] = rng.standard_normal(v.shape).astype(np.float32) * (0.2 if "lora_B" in k else 0.3)
    full = zoo.Model(cfg, seed=None, ad={name: backend})
    p, s = model.parameters(), model.lora.scaling
    for k in model.base_tensor_names():
        full.set_base_tensor(k, model.base_tensor(k))
    for a in adapters(cfg, model.lora):
        w = a.module + ".weight"
        full.set_base_tensor(w, full.base_tensor(w) + s * p[a.module + ".lora_B.weight"] @ p[a.module + ".lora_A.weight"])
    tokens, targets = batch(cfg)
    assert rel_err(model.logits(tokens), full.logits(tokens)) < 1e-5
    _, grads = model.loss_and_grads(tokens, targets)
    _, full_grads = full.loss_and_grads(tokens, targets)
    for a in adapters(cfg, model.lora):
        G = full_grads[a.module + ".weight"]
        A, B = p[a.module + ".lora_A.weight"], p[a.module + ".lora_B.weight"]
        assert rel_err(grads[a.module + ".lora_B.weight"], s * G @ A.T) < 1e-3, a.module
        assert rel_err(grads[a.module + ".lora_A.weight"], s * B.T @ G) < 1e-3, a.module


@pytest.mark.parametrize("name,backend", [run for run in RUNS if run[1]])
def test_trains_and_round_trips_a_checkpoint(name, backend, tmp_path):
    cfg = llama_named(name)
    model = zoo.Model(cfg, seed=0, ad={name: backend})
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (4, 17))
    x, y = tokens[:, :-1], tokens[:, 1:]
    first = model.loss(x, y)
    for _ in range(20):
        model.zero_grads()
        model.forward_backward(x, y)
        model.adamw_step(3e-3)
    assert model.loss(x, y) < 0.8 * first
    with warnings.catch_warnings():  # a mix transformers has no class for is saved with zoo's own config.json
        warnings.simplefilter("ignore", UserWarning)
        model.save_pretrained(tmp_path / "m")
    again = zoo.Model.from_pretrained(tmp_path / "m")
    assert again.config.mlp == name
    np.testing.assert_array_equal(again.logits(x), model.logits(x))


def test_bench_activations_times_every_registered_activation(tmp_path, capsys):
    """`python -m zoo.tools.bench_activations` on a small input: a row and a JSON entry per
    registered activation, pullbacks where the build has a hand-written one."""
    import json

    from zoo.tools import bench_activations

    out = tmp_path / "activations.json"
    bench_activations.main(["--rows", "8", "--width", "70", "--threads", "1", "--repeats", "2", "--json", str(out)])
    doc = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert set(doc["activations"]) == set(blocks.activations())
    for name, r in doc["activations"].items():
        assert f"| {name} |" in table
        assert r["forward_ms"] > 0
        manual = "manual" in pullback_backends(name)
        assert (r["pullback_ms"] is not None) == manual and (r["recompute_and_pullback_ms"] is not None) == manual
    with pytest.raises(SystemExit):
        bench_activations.main(["--name", "gelu", "no_such_activation"])
    assert "no activation no_such_activation; registered: " in capsys.readouterr().err
