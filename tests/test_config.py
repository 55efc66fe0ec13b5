"""ModelConfig validation and the preset registry."""

import pytest
from pydantic import ValidationError

import zoo
from zoo import ModelConfig, RopeScaling
from zoo.arch.layout import num_parameters
from zoo.cli import main as cli_main

BASE = dict(vocab_size=100, max_seq_len=32, d_model=64, n_layer=2, n_head=4)


def test_defaults_follow_the_usual_rules():
    c = ModelConfig(**BASE)
    assert (c.n_kv_head, c.head_dim, c.d_ff) == (4, 16, 256)
    assert c.family == "gpt2"
    assert ModelConfig(**BASE, positions="rope").family == "llama"


@pytest.mark.parametrize("change, field", [
    (dict(n_kv_head=3), "n_kv_head"),
    (dict(d_model=66), "head_dim"),
    (dict(positions="rope", head_dim=15), "head_dim"),
    (dict(rope_scaling=dict(factor=8, low_freq_factor=1, high_freq_factor=4,
                            original_max_position_embeddings=64)), "rope_scaling"),
    (dict(norm="batchnorm"), "norm"),
    (dict(mlp="relu"), "mlp"),
    (dict(n_layer=0), "n_layer"),
    (dict(norm_eps=-1.0), "norm_eps"),
    (dict(n_heads=4), "n_heads"),  # a typo is an error, not silently ignored
])
def test_invalid_combinations_name_the_field(change, field):
    with pytest.raises(ValidationError) as err:
        ModelConfig(**{**BASE, **change})
    assert field in str(err.value)


def test_rope_scaling_factors_must_be_ordered():
    with pytest.raises(ValidationError, match="high_freq_factor"):
        RopeScaling(factor=8, low_freq_factor=4, high_freq_factor=1, original_max_position_embeddings=64)


@pytest.mark.parametrize("name, params", [
    ("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080),
    ("gpt2-xl", 1_557_611_200), ("llama-2-7b", 6_738_415_616), ("tinyllama-1.1b", 1_100_048_384),
    ("llama-3.2-1b", 1_235_814_400), ("llama-3.2-3b", 3_212_749_824), ("llama-3.1-8b", 8_030_261_248),
    ("smollm-135m", 134_515_008), ("smollm-360m", 361_821_120),
])
def test_presets_have_the_published_parameter_counts(name, params):
    assert num_parameters(zoo.preset(name)) == params


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(KeyError, match="gpt2"):
        zoo.preset("gpt5")


def test_presets_command_prints_every_preset(capsys):
    assert cli_main(["presets"]) == 0
    out = capsys.readouterr().out
    for p in zoo.PRESETS:
        assert p.name in out
    assert "124,439,808" in out
