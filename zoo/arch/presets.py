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


def _qwen2(**kw) -> ModelConfig:
    return _llama(family="qwen2", rope_theta=1000000.0, norm_eps=1e-6, attention_bias=True,
                  attention_out_bias=False, **kw)


def _qwen3(**kw) -> ModelConfig:
    return _llama(family="qwen3", vocab_size=151936, max_seq_len=40960, head_dim=128, rope_theta=1000000.0,
                  norm_eps=1e-6, qk_norm="head", **kw)


def _mistral(**kw) -> ModelConfig:
    return _llama(family="mistral", max_seq_len=32768, d_model=4096, n_layer=32, n_head=32, n_kv_head=8,
                  d_ff=14336, tied_embeddings=False, **kw)


def _olmo2(**kw) -> ModelConfig:
    return _llama(family="olmo2", vocab_size=100352, max_seq_len=4096, rope_theta=500000.0, norm_eps=1e-6,
                  qk_norm="projection", branch_norms="post", tied_embeddings=False, **kw)


def _granite(**kw) -> ModelConfig:
    return _llama(family="granite", vocab_size=49159, max_seq_len=131072, n_layer=40, n_head=32, n_kv_head=8,
                  rope_theta=10000000.0, norm_eps=1e-5, embedding_scale=12.0, residual_scale=0.22,
                  tied_embeddings=True, **kw)


_LLAMA3_1B_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)
_LLAMA3_8B_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)

_MIT = "MIT (OpenAI GPT-2 release); the weights carry OpenAI's model card caveats"
_LLAMA2 = "Llama 2 Community License (Meta): acceptance required; usage limits above 700M monthly users"
_LLAMA3 = "Llama 3.x Community License (Meta): acceptance required; attribution and naming rules"
_APACHE = "Apache-2.0"
_QWEN_RESEARCH = ("Qwen Research License (Alibaba Cloud): non-commercial use; commercial use needs "
                  "Alibaba's permission")

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
    # Qwen2.5 (Qwen2ForCausalLM): q, k and v biases, none on o_proj; the window fields of config.json
    # are off (use_sliding_window false), so no window. Contexts as each listed config.json has it.
    Preset("qwen2.5-0.5b", _qwen2(vocab_size=151936, max_seq_len=32768, d_model=896, n_layer=24, n_head=14,
                                  n_kv_head=2, d_ff=4864, tied_embeddings=True),
           ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B-Instruct"), _APACHE),
    # The Instruct config.json says 32768; the base checkpoint's says a longer context (same tensors).
    Preset("qwen2.5-1.5b", _qwen2(vocab_size=151936, max_seq_len=32768, d_model=1536, n_layer=28, n_head=12,
                                  n_kv_head=2, d_ff=8960, tied_embeddings=True),
           ("Qwen/Qwen2.5-1.5B-Instruct",), _APACHE),
    Preset("qwen2.5-3b", _qwen2(vocab_size=151936, max_seq_len=32768, d_model=2048, n_layer=36, n_head=16,
                                n_kv_head=2, d_ff=11008, tied_embeddings=True),
           ("Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-3B-Instruct"), _QWEN_RESEARCH),
    # The 7B has a vocabulary padded to 152,064 and an untied head; the base config.json says a context
    # of 131072 (the Instruct's says 32768: same tensors, load it with --seq-len or its own config.json).
    Preset("qwen2.5-7b", _qwen2(vocab_size=152064, max_seq_len=131072, d_model=3584, n_layer=28, n_head=28,
                                n_kv_head=4, d_ff=18944, tied_embeddings=False),
           ("Qwen/Qwen2.5-7B",), _APACHE),
    # Qwen3 (Qwen3ForCausalLM): head_dim 128 at every size, RMSNorm over each head's q and k. Only the
    # post-trained checkpoints are listed: the -Base ones' config.json files name another context.
    Preset("qwen3-0.6b", _qwen3(d_model=1024, n_layer=28, n_head=16, n_kv_head=8, d_ff=3072, tied_embeddings=True),
           ("Qwen/Qwen3-0.6B",), _APACHE),
    Preset("qwen3-1.7b", _qwen3(d_model=2048, n_layer=28, n_head=16, n_kv_head=8, d_ff=6144, tied_embeddings=True),
           ("Qwen/Qwen3-1.7B",), _APACHE),
    Preset("qwen3-4b", _qwen3(d_model=2560, n_layer=36, n_head=32, n_kv_head=8, d_ff=9728, tied_embeddings=True),
           ("Qwen/Qwen3-4B",), _APACHE),
    Preset("qwen3-8b", _qwen3(d_model=4096, n_layer=36, n_head=32, n_kv_head=8, d_ff=12288, tied_embeddings=False),
           ("Qwen/Qwen3-8B",), _APACHE),
    # Mistral 7B (MistralForCausalLM): v0.1 slides a 4096-key window on every layer; v0.3 has none, a
    # 32768 vocabulary and theta 1e6.
    Preset("mistral-7b-v0.1", _mistral(vocab_size=32000, rope_theta=10000.0, sliding_window=4096),
           ("mistralai/Mistral-7B-v0.1",), _APACHE),
    Preset("mistral-7b-v0.3", _mistral(vocab_size=32768, rope_theta=1000000.0),
           ("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"), _APACHE),
    # OLMo-2 (Olmo2ForCausalLM): norms on the branches' outputs, q/k RMSNorm over the whole projection,
    # multi-head attention, the 100,352-entry vocabulary of its tokenizer (padded), an untied head.
    Preset("olmo-2-1b", _olmo2(d_model=2048, n_layer=16, n_head=16, d_ff=8192),
           ("allenai/OLMo-2-0425-1B", "allenai/OLMo-2-0425-1B-Instruct"), _APACHE),
    Preset("olmo-2-7b", _olmo2(d_model=4096, n_layer=32, n_head=32, d_ff=11008),
           ("allenai/OLMo-2-1124-7B", "allenai/OLMo-2-1124-7B-Instruct"), _APACHE),
    # SmolLM3 (SmolLM3ForCausalLM): every fourth layer (3, 7, ..., 35) rotates nothing (its no_rope_layers
    # list holds 0 there); tied; the Llama 3 vocabulary.
    Preset("smollm3-3b", _llama(family="smollm3", vocab_size=128256, max_seq_len=65536, d_model=2048, n_layer=36,
                                n_head=16, n_kv_head=4, d_ff=11008, rope_theta=5000000.0, norm_eps=1e-6,
                                nope_layers=tuple(range(3, 36, 4)), tied_embeddings=True),
           ("HuggingFaceTB/SmolLM3-3B", "HuggingFaceTB/SmolLM3-3B-Base"), _APACHE),
    # Granite 3.3 (GraniteForCausalLM): the four scalars of its config.json (embedding_multiplier 12,
    # residual_multiplier 0.22, attention_multiplier 1/64 or 1/128, logits_scaling 8 or 16), tied.
    Preset("granite-3.3-2b", _granite(d_model=2048, d_ff=8192, attention_scale=0.015625, logit_scale=1 / 8.0),
           ("ibm-granite/granite-3.3-2b-base", "ibm-granite/granite-3.3-2b-instruct"), _APACHE),
    Preset("granite-3.3-8b", _granite(d_model=4096, d_ff=12800, attention_scale=0.0078125, logit_scale=1 / 16.0),
           ("ibm-granite/granite-3.3-8b-base", "ibm-granite/granite-3.3-8b-instruct"), _APACHE),
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
