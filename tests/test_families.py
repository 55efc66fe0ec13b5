"""Every family against its transformers class: a tiny random checkpoint transformers wrote loads
with its logits and gradients, saves back as the same class, and transformers reads that with
the same logits. A family without a tiny checkpoint here fails the first test: adding a family
means adding its line to TINY (docs/adding_a_family.md)."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_helpers import (  # noqa: E402
    VOCAB,
    assert_parity,
    hf_logits,
    load_hf_fp32,
    tiny_gpt2,
    tiny_llama,
    tiny_variant,
    tokens,
)

import zoo  # noqa: E402
from zoo import families  # noqa: E402
from zoo.core.errors import CheckpointError  # noqa: E402

# family -> a tiny random model of its transformers class
TINY = {"gpt2": tiny_gpt2, "llama": lambda: tiny_llama(n_kv_head=2, head_dim=12),
        **{name: (lambda name=name: tiny_variant(name)) for name in
           ("mistral", "qwen2", "qwen3", "olmo2", "smollm3", "granite", "gemma", "gemma2", "gemma3", "phi3", "gpt_neox")}}


def test_every_family_has_a_tiny_checkpoint_here():
    assert set(TINY) == set(families.FAMILIES)


@pytest.mark.parametrize("name", sorted(TINY))
def test_family_loads_computes_and_saves_back_as_its_class(name, tmp_path):
    hf = TINY[name]()
    hf.save_pretrained(tmp_path / "hf")
    model = zoo.Model.from_pretrained(tmp_path / "hf")
    assert model.config.family == name
    assert_parity(hf, model)
    model.save_pretrained(tmp_path / "zoo")
    saved = json.loads((tmp_path / "zoo" / "config.json").read_text())
    assert saved["architectures"] == [families.get(name).saves_as] == [type(hf).__name__]
    back = load_hf_fp32(tmp_path / "zoo")
    assert type(back) is type(hf)
    tok, _ = tokens(1)
    np.testing.assert_allclose(hf_logits(back, tok), model.logits(tok), rtol=1e-4, atol=1e-4)


def test_windows_are_banded_beyond_their_width(tmp_path):
    """Mistral's window on every layer, Qwen2's on the layers from max_window_layers on: a
    sequence 4x the window computes as transformers' banded attention (not the window as a cap)."""
    for name in ("mistral", "qwen2"):
        hf = tiny_variant(name)
        hf.save_pretrained(tmp_path / name)
        model = zoo.Model.from_pretrained(tmp_path / name)
        assert model.config.sliding_window == 5 and model.config.max_seq_len == 64
        assert model.config.sliding_layers == (None if name == "mistral" else (1, 2))
        tok = np.random.default_rng(0).integers(0, VOCAB, (2, 20))
        np.testing.assert_allclose(model.logits(tok), hf_logits(hf, tok), rtol=1e-4, atol=1e-4)


def test_a_family_refuses_what_its_class_cannot_hold(tmp_path):
    hf = tiny_variant("mistral")
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(cfg, hidden_act="relu")))
    with pytest.raises(CheckpointError, match="hidden_act.*unsupported activation 'relu'"):
        zoo.Model.from_pretrained(tmp_path / "hf")
    model = zoo.Model(zoo.ModelConfig(**{**zoo.preset("tiny-llama").model_dump(), "family": "mistral",
                                          "attention_bias": True}), seed=0)
    with pytest.warns(UserWarning, match="MistralForCausalLM has no biases"):
        model.save_pretrained(tmp_path / "biased")  # zoo's own config.json then
    assert json.loads((tmp_path / "biased" / "config.json").read_text())["model_type"] == "zoo"


def test_linear_rope_scaling_loads_computes_and_exports(tmp_path):
    """rope_type "linear" (every frequency divided by the factor), as transformers computes it,
    through save, GGUF export and back."""
    from zoo.io.gguf import save_gguf

    hf = tiny_llama(n_kv_head=2, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0})
    hf.save_pretrained(tmp_path / "hf")
    model = zoo.Model.from_pretrained(tmp_path / "hf")
    assert model.config.rope_scaling.rope_type == "linear"
    assert_parity(hf, model)
    model.save_pretrained(tmp_path / "zoo")
    tok, _ = tokens(1)
    np.testing.assert_allclose(hf_logits(load_hf_fp32(tmp_path / "zoo"), tok), model.logits(tok), atol=1e-4)
    with pytest.warns(RuntimeWarning, match="no tokenizer"):
        save_gguf(model, tmp_path / "m.gguf")
    back = zoo.Model.from_pretrained(tmp_path / "m.gguf")
    assert back.config.rope_scaling == model.config.rope_scaling
    np.testing.assert_array_equal(back.logits(tok), model.logits(tok))
