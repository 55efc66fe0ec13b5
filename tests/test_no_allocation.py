"""No heap allocation inside a training step (house rule: one memory arena planned up front).
After a warm-up step has made the plan, further steps (zero_grads, forward_backward,
adamw_step) make no C++ heap allocation on either backend: every scratch buffer, Clad's
included, lives in the arenas. Counted natively (native/executor/alloc_count.cpp) inside the calls.
In bf16, oneDNN's primitive execution allocates on every call whatever its caller does (its
argument map and execution context): those are counted apart and bounded per call."""

import numpy as np
import pytest
from helpers import CLAD, needs_bf16

import zoo
from zoo import LoraConfig
from zoo.core.native import _native

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


# oneDNN 3.2's dnnl_primitive_execute allocates 7 times a call on its brgemm matmuls (its
# argument map, a std::unordered_map: buckets and a node per argument; 3 more in the execution
# context and stream), 8 with a sum post-op (a product that adds into its output); its gemm-based
# bf16 matmul, which it picks for some of a rank-r adapter's products, builds a std::function and
# a hash map of its own on top (a LoRA step here: 10 a call on average). Found with a
# malloc-counting LD_PRELOAD shim (docs/benchmarks.md). A primitive made inside a step would
# count thousands, and in zoo's count, not this one.
ONEDNN_ALLOCATIONS_PER_CALL = 16


# The whole model on either backend; LoRA over each stored base format.
# (base, ad, packed): packed, the bf16 base's packed copy read by the pullback (Model.set_packed_base).
BF16_RUNS = ([(None, ad, False) for ad in BACKENDS] + [(base, "manual", False) for base in ("bf16", "int8", "nf4")]
             + [("bf16", "manual", True)])


@needs_bf16
@pytest.mark.parametrize("base,ad,packed", BF16_RUNS,
                         ids=[f"{'full' if b is None else 'lora-' + b}{'-packed' if p else ''}-{ad}"
                              for b, ad, p in BF16_RUNS])
@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_a_bf16_training_step_allocates_nothing_but_onednns_per_call_maps(cfg, base, ad, packed, threads):
    """The second step is the first after an AdamW step, whose weight-gradient products add
    instead of writing: they are made with the first step's (gemm.cpp), so one warm-up step
    plans everything here too."""
    lora = {} if base is None else {"lora": LoraConfig(r=4), "base_dtype": base}
    model = zoo.Model(cfg, seed=0, precision="bf16", ad=ad, **lora)
    if packed:
        assert model.set_packed_base(True) > 0
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, 80)).astype(np.int32)
    targets = rng.integers(0, cfg.vocab_size, (2, 80)).astype(np.int32)
    model._exec.count_step_allocations(tokens, targets, 1)
    assert model._exec.count_step_allocations(tokens, targets, 3) == 0
    allocations, calls = model._exec.library_allocations()
    assert calls >= 3 * 3 * cfg.n_layer  # the step's products ran on oneDNN: the case is exercised
    if packed:
        assert any("weights prepacked" in k["kernel"] for k in _native.gemm_kernels_used())
    assert allocations <= ONEDNN_ALLOCATIONS_PER_CALL * calls


@needs_bf16
def test_a_bf16_step_planned_while_the_primitive_cache_overflows_allocates_nothing_after():
    """oneDNN's primitives are kept per product shape, up to a bound: a warm-up step that fills
    the cache midway must keep its own (the older half goes), or the next step makes the first
    ones again. Seen when this file ran after the rest of the suite had filled the cache."""
    rng = np.random.default_rng(0)
    entries, capacity = _native.gemm_primitive_cache()
    n = 1
    while entries < capacity - 8:  # products of shapes no model here has, until nearly full
        _native.gemm(rng.standard_normal((3, n), dtype=np.float32), rng.standard_normal((5, n), dtype=np.float32),
                     False, True, "bf16")
        entries, n = _native.gemm_primitive_cache()[0], n + 1
    model = zoo.Model(LLAMA, seed=0, precision="bf16")
    tokens = rng.integers(0, LLAMA.vocab_size, (3, 77)).astype(np.int32)  # shapes no other test runs
    model._exec.count_step_allocations(tokens, tokens, 1)
    assert _native.gemm_primitive_cache()[0] < capacity - 8  # the warm-up step overflowed it
    assert model._exec.count_step_allocations(tokens, tokens, 3) == 0


def test_the_counter_counts():
    """The instrument itself: a step that has to plan (a new batch shape) allocates."""
    model = zoo.Model(GPT2, seed=0)
    tokens = np.zeros((1, 8), np.int32)
    assert model._exec.count_step_allocations(tokens, tokens, 1) > 0
