"""No heap allocation inside a training step (house rule: one memory arena planned up front).
After a warm-up step has made the plan, further steps (zero_grads, forward_backward,
adamw_step) make no C++ heap allocation on either backend: every scratch buffer, Clad's
included, lives in the arenas. Counted natively (native/executor/alloc_count.cpp) inside the calls."""

import numpy as np
import pytest
from helpers import CLAD

import zoo

# Rows longer than a Clad tape's inline buffer (64 values): a kernel that taped per element
# or per key would allocate here.
GPT2 = zoo.ModelConfig(vocab_size=97, max_seq_len=96, d_model=80, n_layer=2, n_head=4, d_ff=160)
LLAMA = zoo.ModelConfig(
    vocab_size=101, max_seq_len=96, d_model=72, n_layer=2, n_head=6, n_kv_head=2, head_dim=12, d_ff=144,
    norm="rmsnorm", mlp="swiglu", positions="rope", attention_bias=False, mlp_bias=False, tied_embeddings=False)
# Every variant option at once (Gemma 2/3's and OLMo-2's kind), and GPT-NeoX's parallel layer.
VARIANTS = zoo.ModelConfig(**{
    **LLAMA.model_dump(), "norm": "rmsnorm_1p", "mlp": "geglu", "branch_norms": "both", "qk_norm": "head",
    "sliding_window": 7, "sliding_layers": (0,), "sliding_rope_theta": 100.0, "nope_layers": (1,),
    "embedding_scale": 3.0, "residual_scale": 0.5, "attention_scale": 0.2, "attention_softcap": 5.0,
    "logit_softcap": 3.0, "rotary_dim": 8})
NEOX = zoo.ModelConfig(**{**GPT2.model_dump(), "positions": "rope", "layer": "parallel_two_norms", "mlp": "gelu_erf",
                          "rotary_dim": 6, "family": "gpt_neox"})
BACKENDS = ["manual"] + (["clad"] if CLAD else [])


@pytest.mark.parametrize("ad", BACKENDS)
@pytest.mark.parametrize("cfg", [GPT2, LLAMA, VARIANTS, NEOX], ids=["gpt2", "llama", "variants", "neox"])
def test_a_training_step_allocates_nothing(cfg, ad, threads):
    model = zoo.Model(cfg, seed=0, ad=ad)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, 80)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab_size, (2, 80)).astype(np.int32)
    targets[0, :5] = -100
    assert model._exec.count_step_allocations(tokens, targets, 1) > 0  # the warm-up step plans: it allocates
    assert model._exec.count_step_allocations(tokens, targets, 3) == 0


def test_the_counter_counts():
    """The instrument itself: a step that has to plan (a new batch shape) allocates."""
    model = zoo.Model(GPT2, seed=0)
    tokens = np.zeros((1, 8), np.int32)
    assert model._exec.count_step_allocations(tokens, tokens, 1) > 0
