"""config.json <-> ModelConfig without torch: every key that changes the math, defaults,
both rope forms, errors naming file and key, and round trips of the presets."""

import json

import pytest

from zoo import preset
from zoo.arch.config import ModelConfig, RopeScaling
from zoo.arch.presets import PRESETS
from zoo.core.errors import CheckpointError
from zoo.io.hf_config import (
    config_from_hf,
    config_to_hf,
    config_to_zoo,
    hf_incompatibility,
    read_config,
)

GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 100, "n_positions": 64,
        "n_embd": 48, "n_layer": 3, "n_head": 4, "n_inner": None, "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new"}
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100,
         "max_position_embeddings": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
         "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": False}
LLAMA3 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_gpt2_keys():
    cfg = config_from_hf(GPT2)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.d_model, cfg.n_layer, cfg.n_head) == (100, 64, 48, 3, 4)
    assert cfg.d_ff == 4 * 48 and cfg.head_dim == 12 and cfg.tied_embeddings
    assert (cfg.norm, cfg.mlp, cfg.positions, cfg.family) == ("layernorm", "gelu", "learned", "gpt2")
    assert config_from_hf({**GPT2, "n_inner": 80, "layer_norm_epsilon": 1e-6}).d_ff == 80
    assert config_from_hf({**GPT2, "tie_word_embeddings": False}).tied_embeddings is False
    # transformers' GPT2Config defaults apply to keys it left out
    assert config_from_hf({"model_type": "gpt2"}) == preset("gpt2")


def test_llama_keys_and_defaults():
    cfg = config_from_hf(LLAMA)
    assert (cfg.d_model, cfg.d_ff, cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim) == (64, 96, 2, 8, 2, 16)
    assert (cfg.norm, cfg.mlp, cfg.positions, cfg.norm_eps) == ("rmsnorm", "swiglu", "rope", 1e-5)
    assert cfg.attention_bias and not cfg.mlp_bias and cfg.tied_embeddings
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    bare = config_from_hf({k: v for k, v in LLAMA.items() if k not in ("num_key_value_heads", "head_dim",
                                                                         "tie_word_embeddings", "rms_norm_eps")})
    assert (bare.n_kv_head, bare.head_dim, bare.tied_embeddings, bare.norm_eps) == (8, 8, False, 1e-6)


def test_rope_both_forms():
    new = config_from_hf({**LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}})
    old = config_from_hf({**LLAMA, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA3}})
    older = config_from_hf({**LLAMA, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}})
    assert new == old == older
    assert new.rope_theta == 5e5 and new.rope_scaling == RopeScaling(**LLAMA3)
    plain = config_from_hf({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert plain.rope_theta == 5e5 and plain.rope_scaling is None
    # rope_scaling: null next to rope_parameters (what transformers 5 may write)
    assert config_from_hf({**LLAMA, "rope_scaling": None, "rope_parameters": {"rope_type": "llama3",
                                                                              "rope_theta": 5e5, **LLAMA3}}) == new


@pytest.mark.parametrize("hf, key", [
    ({**GPT2, "model_type": "bert"}, "model_type"),
    ({**GPT2, "architectures": ["GPT2ForSequenceClassification"]}, "architectures"),
    ({**GPT2, "activation_function": "relu"}, "activation_function"),
    ({**GPT2, "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({**GPT2, "scale_attn_weights": False}, "scale_attn_weights"),
    ({**GPT2, "add_cross_attention": True}, "add_cross_attention"),
    ({**GPT2, "n_head": 5}, "n_head"),
    ({**GPT2, "n_embd": 4.5}, "n_embd"),
    ({**LLAMA, "hidden_act": "gelu"}, "hidden_act"),
    ({**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type"),
    ({**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({**LLAMA, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_parameters.low_freq_factor"),
    ({**LLAMA, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({**LLAMA, "num_key_value_heads": 3}, "num_key_value_heads"),
    ({**LLAMA, "vocab_size": 0}, "vocab_size"),
    ({**LLAMA, "attention_bias": "yes"}, "attention_bias"),
])
def test_unsupported_values_name_file_and_key(hf, key):
    with pytest.raises(CheckpointError) as e:
        config_from_hf(hf, "ckpt/config.json")
    assert str(e.value).startswith("ckpt/config.json: ") and repr(key) in str(e.value)


def test_read_config_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{'model_type': 'gpt2'}")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert read_config(tmp_path) == config_from_hf(LLAMA)


@pytest.mark.parametrize("name", [p.name for p in PRESETS])
def test_presets_round_trip(name):
    cfg = preset(name)
    write = config_to_hf if hf_incompatibility(cfg) is None else config_to_zoo
    hf = write(cfg, bos_token_id=1, eos_token_id=[2, 3])
    assert config_from_hf(json.loads(json.dumps(hf))) == cfg
    assert hf["dtype"] == "float32" and hf["eos_token_id"] == [2, 3]


def test_real_presets_are_hugging_face_shapes():
    for p in PRESETS:
        if p.hf_checkpoints:
            assert hf_incompatibility(p.config) is None, p.name


def test_written_rope_forms_agree():
    hf = config_to_hf(preset("llama-3.2-1b"))
    assert hf["rope_parameters"]["rope_type"] == hf["rope_scaling"]["rope_type"] == "llama3"
    old_only = {k: v for k, v in hf.items() if k != "rope_parameters"}
    new_only = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
    assert config_from_hf(old_only) == config_from_hf(new_only) == preset("llama-3.2-1b")


def test_configs_hf_cannot_express():
    gpt2_rms = ModelConfig(vocab_size=10, max_seq_len=8, d_model=8, n_layer=1, n_head=2, norm="rmsnorm")
    with pytest.raises(CheckpointError, match="'norm'.*GPT2LMHeadModel"):
        config_to_hf(gpt2_rms)
    llama_ln = ModelConfig(vocab_size=10, max_seq_len=8, d_model=8, n_layer=1, n_head=2, positions="rope")
    with pytest.raises(CheckpointError, match="LlamaForCausalLM"):
        config_to_hf(llama_ln)


def test_written_config_is_accepted_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    for name in ("tiny-gpt2", "tiny-llama", "llama-3.2-1b", "smollm-135m"):
        (tmp_path / "config.json").write_text(json.dumps(config_to_hf(preset(name), eos_token_id=2)))
        hf = transformers.AutoConfig.from_pretrained(tmp_path)
        back = hf.to_dict()
        back["model_type"] = hf.model_type
        assert config_from_hf(back) == preset(name), name


def test_zoo_form_for_mixed_configs():
    mixed = ModelConfig(vocab_size=64, max_seq_len=32, d_model=32, n_layer=2, n_head=4, n_kv_head=1, d_ff=64,
                        norm="layernorm", mlp="gelu", positions="rope", tied_embeddings=True)
    written = json.loads(json.dumps(config_to_zoo(mixed, eos_token_id=5)))
    assert written["model_type"] == "zoo" and config_from_hf(written) == mixed
    written["zoo_config"]["n_kv_head"] = 3
    with pytest.raises(CheckpointError, match="'zoo_config'.*n_kv_head"):
        config_from_hf(written, "c/config.json")
    written["zoo_config"]["mlp"] = "relu"
    with pytest.raises(CheckpointError, match="'zoo_config.mlp'"):
        config_from_hf(written, "c/config.json")
