"""Every family against its transformers class: a tiny random checkpoint transformers wrote loads
with its logits and gradients, saves back as the same class, and transformers reads that with
the same logits. A family without a tiny checkpoint here fails the first test: adding a family
means adding its line to TINY (docs/adding_a_family.md)."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from hf_helpers import VOCAB, _randomized, assert_parity, hf_logits, load_hf_fp32, tiny_gpt2, tiny_llama, tokens  # noqa: E402
from zoo import families  # noqa: E402
from zoo.core.errors import CheckpointError  # noqa: E402


def tiny_mistral(*, window=None):
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                     max_position_embeddings=64, sliding_window=window, rms_norm_eps=1e-5,
                                     bos_token_id=0, eos_token_id=1)
    return _randomized(transformers.MistralForCausalLM, cfg, seed=2)


# family -> a tiny random model of its transformers class
TINY = {"gpt2": tiny_gpt2, "llama": lambda: tiny_llama(n_kv_head=2, head_dim=12), "mistral": tiny_mistral}


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


def test_mistral_window_caps_the_context_and_stays_exact(tmp_path):
    hf = tiny_mistral(window=16)
    hf.save_pretrained(tmp_path / "hf")
    model = zoo.Model.from_pretrained(tmp_path / "hf")
    assert model.config.max_seq_len == 16  # the window, not max_position_embeddings 64
    tok = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
    np.testing.assert_allclose(model.logits(tok), hf_logits(hf, tok), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="max_seq_len: 32 is beyond the context"):
        zoo.Model.from_pretrained(tmp_path / "hf", max_seq_len=32)


def test_a_family_refuses_what_its_class_cannot_hold(tmp_path):
    hf = tiny_mistral()
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
