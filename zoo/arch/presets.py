"""Every named architecture in one list: the real GPT-2 and Llama-family shapes, plus tiny
ones for tests. Each entry notes the Hugging Face checkpoints whose config.json it matches."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.rope import RopeScaling
from .config import ModelConfig


@dataclass(frozen=True)
class Preset:
    name: str
    config: ModelConfig
    hf_checkpoints: tuple[str, ...]  # Hugging Face repos this shape matches ("" for zoo-only shapes)
    licence: str
    note: str = ""  # what a card says of those checkpoints beyond the shape (a multimodal repo's text tower)


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


def _gemma(**kw) -> ModelConfig:
    """Gemma (GemmaForCausalLM): the (1 + w) RMSNorm, GeGLU, embeddings times sqrt(d_model),
    head_dim 256, tied, the 256,000-token vocabulary, an 8,192-token context."""
    base = dict(family="gemma", vocab_size=256000, max_seq_len=8192, head_dim=256, norm="rmsnorm_1p", norm_eps=1e-6,
                mlp="geglu", rope_theta=10000.0, tied_embeddings=True, embedding_scale=math.sqrt(kw["d_model"]))
    base.update(kw)
    return _llama(**base)


def _gemma2(**kw) -> ModelConfig:
    """Gemma 2 (Gemma2ForCausalLM): Gemma's, plus norms on both sides of each branch, the softmax
    scale query_pre_attn_scalar ** -0.5 (256 in the 2B and 9B), soft-caps of 50 on the scores and
    30 on the logits, a 4,096-key window on the even layers (layer_types: 0, 2, 4, ...)."""
    n_layer = kw["n_layer"]
    return _gemma(family="gemma2", branch_norms="both", attention_scale=256 ** -0.5, attention_softcap=50.0,
                  logit_softcap=30.0, sliding_window=4096, sliding_layers=tuple(range(0, n_layer, 2)), **kw)


def _gemma3(**kw) -> ModelConfig:
    """Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2's without the soft-caps,
    plus q/k norms over each head, five sliding layers to one full (the full ones 5, 11, 17, ...),
    RoPE base 1e6 on the full layers and 10,000 on the sliding ones (rope_local_base_freq), the
    262K vocabulary."""
    n_layer = kw["n_layer"]
    return _gemma(family="gemma3", branch_norms="both", attention_scale=256 ** -0.5, qk_norm="head",
                  rope_theta=1000000.0, sliding_rope_theta=10000.0,
                  sliding_layers=tuple(i for i in range(n_layer) if (i + 1) % 6), **kw)


def _pythia(d_model: int, n_layer: int, n_head: int) -> ModelConfig:
    """Pythia (GPTNeoXForCausalLM): LayerNorm and linear biases, the exact GELU, the parallel
    residual with two norms (use_parallel_residual), RoPE on a quarter of each head (rotary_pct
    0.25), an untied embed_out, the 50,304-entry padded vocabulary, a 2,048-token context."""
    head_dim = d_model // n_head
    return ModelConfig(family="gpt_neox", vocab_size=50304, max_seq_len=2048, d_model=d_model, n_layer=n_layer,
                       n_head=n_head, d_ff=4 * d_model, norm="layernorm", norm_eps=1e-5, mlp="gelu_erf",
                       layer="parallel_two_norms", positions="rope", rope_theta=10000.0, rotary_dim=head_dim // 4,
                       attention_bias=True, mlp_bias=True, tied_embeddings=False)


_LLAMA3_1B_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)
_LLAMA3_8B_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)

_MIT = "MIT (OpenAI GPT-2 release); the weights carry OpenAI's model card caveats"
_LLAMA2 = "Llama 2 Community License (Meta): acceptance required; usage limits above 700M monthly users"
_LLAMA3 = "Llama 3.x Community License (Meta): acceptance required; attribution and naming rules"
_APACHE = "Apache-2.0"
_GEMMA = ("Gemma Terms of Use (Google): acceptance required; use restricted by the Gemma Prohibited Use Policy, "
          "which finetunes and redistributions carry on")
_PHI3 = "MIT"
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
    # Gemma (GemmaForCausalLM), from google/gemma-2b's and gemma-7b's config.json: head_dim 256 in both (the
    # 7B's 16 heads of 256 are wider than its d_model of 3072), multi-query attention in the 2B.
    Preset("gemma-2b", _gemma(d_model=2048, n_layer=18, n_head=8, n_kv_head=1, d_ff=16384),
           ("google/gemma-2b", "google/gemma-2b-it"), _GEMMA),
    Preset("gemma-7b", _gemma(d_model=3072, n_layer=28, n_head=16, n_kv_head=16, d_ff=24576),
           ("google/gemma-7b", "google/gemma-7b-it"), _GEMMA),
    # Gemma 2 (Gemma2ForCausalLM), from google/gemma-2-2b's and gemma-2-9b's config.json. The 9B's
    # query_pre_attn_scalar is 256 (head_dim), as its config.json has it since July 2024 and Google's
    # gemma_pytorch computes it; an earlier config.json said 224 (d_model / n_head).
    Preset("gemma-2-2b", _gemma2(d_model=2304, n_layer=26, n_head=8, n_kv_head=4, d_ff=9216),
           ("google/gemma-2-2b", "google/gemma-2-2b-it"), _GEMMA),
    Preset("gemma-2-9b", _gemma2(d_model=3584, n_layer=42, n_head=16, n_kv_head=8, d_ff=14336),
           ("google/gemma-2-9b", "google/gemma-2-9b-it"), _GEMMA),
    # Gemma 3 text (Gemma3ForCausalLM). The 1B is text-only: google/gemma-3-1b-pt's config.json (a window
    # of 512, a 32,768-token context, 262,144 entries, no rope scaling). The 4B is multimodal upstream
    # (Gemma3ForConditionalGeneration, a SigLIP vision tower beside the text model): this is its
    # text_config's shape (a window of 1,024, 131,072 tokens, 262,208 entries, the full layers' RoPE
    # scaled linearly by 8; the keys its text_config leaves out take Gemma3TextConfig's defaults).
    Preset("gemma-3-1b", _gemma3(vocab_size=262144, max_seq_len=32768, d_model=1152, n_layer=26, n_head=4,
                                 n_kv_head=1, d_ff=6912, sliding_window=512),
           ("google/gemma-3-1b-pt", "google/gemma-3-1b-it"), _GEMMA),
    Preset("gemma-3-4b", _gemma3(vocab_size=262208, max_seq_len=131072, d_model=2560, n_layer=34, n_head=8,
                                 n_kv_head=4, d_ff=10240, sliding_window=1024,
                                 rope_scaling=RopeScaling(rope_type="linear", factor=8.0)),
           ("google/gemma-3-4b-pt", "google/gemma-3-4b-it"), _GEMMA,
           note=("These repositories are multimodal (Gemma3ForConditionalGeneration: this text model as "
                 "`language_model`, plus a SigLIP vision tower and its projector); this preset is the shape of "
                 "their `text_config`. zoo reads text-only checkpoints (model_type `gemma3_text`): a text model "
                 "extracted from them, with its own config.json, loads.")),
    # Phi-3 mini (Phi3ForCausalLM), from microsoft/Phi-3-mini-4k-instruct's config.json: multi-head
    # attention, a window of 2047 keys on every layer, no partial rotary, the 32,064-entry vocabulary,
    # untied. Phi-3.5-mini-instruct is not listed: its rope_scaling is "longrope" (short and long factors
    # over a 131,072 context), which zoo refuses.
    Preset("phi-3-mini-4k", _llama(family="phi3", vocab_size=32064, max_seq_len=4096, d_model=3072, n_layer=32,
                                   n_head=32, n_kv_head=32, d_ff=8192, rope_theta=10000.0, sliding_window=2047,
                                   tied_embeddings=False),
           ("microsoft/Phi-3-mini-4k-instruct",), _PHI3),
    # Pythia (GPTNeoXForCausalLM), from EleutherAI/pythia-*'s config.json (the -deduped models share each shape).
    Preset("pythia-70m", _pythia(512, 6, 8), ("EleutherAI/pythia-70m", "EleutherAI/pythia-70m-deduped"), _APACHE),
    Preset("pythia-160m", _pythia(768, 12, 12), ("EleutherAI/pythia-160m", "EleutherAI/pythia-160m-deduped"),
           _APACHE),
    Preset("pythia-410m", _pythia(1024, 24, 16), ("EleutherAI/pythia-410m", "EleutherAI/pythia-410m-deduped"),
           _APACHE),
    Preset("pythia-1b", _pythia(2048, 16, 8), ("EleutherAI/pythia-1b", "EleutherAI/pythia-1b-deduped"), _APACHE),
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
