"""Every named architecture in one list: the real GPT-2 and Llama-family shapes, plus tiny
ones for tests. Each entry notes the Hugging Face checkpoints whose config.json it matches."""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig
from ..core.rope import RopeScaling


@dataclass(frozen=True)
class Preset:
    name: str
    config: ModelConfig
    hf_checkpoints: tuple[str, ...]  # Hugging Face repos this shape matches ("" for zoo-only shapes)
    licence: str


def _gpt2(d_model: int, n_layer: int, n_head: int) -> ModelConfig:
    return ModelConfig(vocab_size=50257, max_seq_len=1024, d_model=d_model, n_layer=n_layer,
                       n_head=n_head, norm="layernorm", norm_eps=1e-5, mlp="gelu",
                       positions="learned", attention_bias=True, mlp_bias=True, tied_embeddings=True)


def _llama(**kw) -> ModelConfig:
    base = dict(norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", positions="rope",
                attention_bias=False, mlp_bias=False)
    base.update(kw)
    return ModelConfig(**base)


_LLAMA3_1B_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)
_LLAMA3_8B_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)

_MIT = "MIT (OpenAI GPT-2 release); the weights carry OpenAI's model card caveats"
_LLAMA2 = "Llama 2 Community License (Meta): acceptance required; usage limits above 700M monthly users"
_LLAMA3 = "Llama 3.x Community License (Meta): acceptance required; attribution and naming rules"
_APACHE = "Apache-2.0"

PRESETS: list[Preset] = [
    Preset("gpt2", _gpt2(768, 12, 12), ("openai-community/gpt2",), _MIT),
    Preset("gpt2-medium", _gpt2(1024, 24, 16), ("openai-community/gpt2-medium",), _MIT),
    Preset("gpt2-large", _gpt2(1280, 36, 20), ("openai-community/gpt2-large",), _MIT),
    Preset("gpt2-xl", _gpt2(1600, 48, 25), ("openai-community/gpt2-xl",), _MIT),
    Preset("llama-2-7b", _llama(vocab_size=32000, max_seq_len=4096, d_model=4096, n_layer=32,
                                n_head=32, n_kv_head=32, d_ff=11008, rope_theta=10000.0,
                                tied_embeddings=False),
           ("meta-llama/Llama-2-7b-hf",), _LLAMA2),
    Preset("tinyllama-1.1b", _llama(vocab_size=32000, max_seq_len=2048, d_model=2048, n_layer=22,
                                    n_head=32, n_kv_head=4, d_ff=5632, rope_theta=10000.0,
                                    tied_embeddings=False),
           ("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", "TinyLlama/TinyLlama-1.1B-Chat-v1.0"),
           _APACHE),
    Preset("llama-3.2-1b", _llama(vocab_size=128256, max_seq_len=131072, d_model=2048, n_layer=16,
                                  n_head=32, n_kv_head=8, head_dim=64, d_ff=8192, rope_theta=500000.0,
                                  rope_scaling=_LLAMA3_1B_SCALING, tied_embeddings=True),
           ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct"), _LLAMA3),
    Preset("llama-3.2-3b", _llama(vocab_size=128256, max_seq_len=131072, d_model=3072, n_layer=28,
                                  n_head=24, n_kv_head=8, head_dim=128, d_ff=8192, rope_theta=500000.0,
                                  rope_scaling=_LLAMA3_1B_SCALING, tied_embeddings=True),
           ("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct"), _LLAMA3),
    Preset("llama-3.1-8b", _llama(vocab_size=128256, max_seq_len=131072, d_model=4096, n_layer=32,
                                  n_head=32, n_kv_head=8, head_dim=128, d_ff=14336, rope_theta=500000.0,
                                  rope_scaling=_LLAMA3_8B_SCALING, tied_embeddings=False),
           ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct"), _LLAMA3),
    Preset("smollm-135m", _llama(vocab_size=49152, max_seq_len=2048, d_model=576, n_layer=30,
                                 n_head=9, n_kv_head=3, d_ff=1536, rope_theta=10000.0,
                                 tied_embeddings=True),
           ("HuggingFaceTB/SmolLM-135M", "HuggingFaceTB/SmolLM2-135M"), _APACHE),
    Preset("smollm-360m", _llama(vocab_size=49152, max_seq_len=2048, d_model=960, n_layer=32,
                                 n_head=15, n_kv_head=5, d_ff=2560, rope_theta=10000.0,
                                 tied_embeddings=True),
           ("HuggingFaceTB/SmolLM-360M", "HuggingFaceTB/SmolLM2-360M"), _APACHE),
    Preset("qwen2.5-0.5b", _llama(family="qwen2", vocab_size=151936, max_seq_len=32768, d_model=896, n_layer=24,
                                  n_head=14, n_kv_head=2, d_ff=4864, rope_theta=1000000.0, norm_eps=1e-6,
                                  attention_bias=True, attention_out_bias=False, tied_embeddings=True),
           ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B-Instruct"), _APACHE),
    Preset("qwen3-1.7b", _llama(family="qwen3", vocab_size=151936, max_seq_len=40960, d_model=2048, n_layer=28,
                                n_head=16, n_kv_head=8, head_dim=128, d_ff=6144, rope_theta=1000000.0, norm_eps=1e-6,
                                qk_norm="head", tied_embeddings=True),
           ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-1.7B-Base"), _APACHE),
    # Tiny shapes for tests and the embedded demo: byte-level vocabulary (256 bytes + specials).
    Preset("tiny-gpt2", ModelConfig(vocab_size=320, max_seq_len=256, d_model=64, n_layer=2, n_head=4,
                                    d_ff=256), (), "zoo (MIT)"),
    Preset("tiny-llama", _llama(vocab_size=320, max_seq_len=256, d_model=64, n_layer=2, n_head=4,
                                n_kv_head=2, d_ff=176, rope_theta=10000.0,
                                rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0,
                                                         original_max_position_embeddings=64),
                                tied_embeddings=False),
           (), "zoo (MIT)"),
]

_BY_NAME = {p.name: p for p in PRESETS}


def preset_info(name: str) -> Preset:
    """A named preset: its config, the checkpoints it matches, its licence."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(_BY_NAME)}") from None


def preset(name: str) -> ModelConfig:
    """The ModelConfig of a named preset."""
    return preset_info(name).config
