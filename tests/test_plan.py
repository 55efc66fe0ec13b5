"""The activation planner (native/executor/plan.hpp): buffers placed by liveness, and the proof that no
two buffers live at the same time share memory."""

import itertools

import numpy as np
import pytest

import zoo
from zoo.arch.presets import preset
from zoo.core.native import _native

FORWARD, HEAD, PULLBACK = 1, 2, 4


def overlapping_live_pairs(buffers):
    """Pairs of buffers live in a common phase whose memory overlaps: computed here, apart
    from the planner's own check."""
    bad = []
    for a, b in itertools.combinations(buffers, 2):
        if a["live"] & b["live"] and a["offset"] < b["offset"] + b["floats"] and b["offset"] < a["offset"] + a["floats"]:
            bad.append((a["name"], b["name"]))
    return bad


def test_buffers_live_together_are_apart_and_dead_ones_share():
    plan = {b["name"]: b for b in _native.place_buffers([
        ("kept", 100, FORWARD | HEAD | PULLBACK), ("fwd", 64, FORWARD), ("head", 48, HEAD), ("grad", 32, PULLBACK)])}
    assert plan["fwd"]["offset"] >= plan["kept"]["offset"] + plan["kept"]["floats"]
    # head and grad are never live with fwd or each other: all three start at the same place
    assert plan["head"]["offset"] == plan["fwd"]["offset"] == plan["grad"]["offset"]
    assert plan["kept"]["floats"] == 112  # rounded up to 64 bytes
    assert overlapping_live_pairs(plan.values()) == []


def test_check_refuses_a_plan_that_overlaps_live_buffers():
    ok = [("a", 16, FORWARD, 0), ("b", 16, PULLBACK, 0), ("c", 16, FORWARD | PULLBACK, 16)]
    _native.check_buffer_plan(ok)
    with pytest.raises(Exception, match="overlaps buffers a and c, which are live at the same time"):
        _native.check_buffer_plan([("a", 32, FORWARD, 0), ("b", 16, PULLBACK, 0), ("c", 16, FORWARD | PULLBACK, 16)])


def test_invalid_live_phases_are_refused():
    with pytest.raises(ValueError, match="buffer x has no valid live phases"):
        _native.place_buffers([("x", 16, 0)])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True, 1], ids=["stored", "checkpointed", "first-layer"])
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_training_plans_never_overlap_live_buffers(name, checkpointing, precision):
    cfg = preset(name)
    plan = _native.activation_plan(cfg.model_dump(), 3, 16, checkpointing, precision=precision)
    assert overlapping_live_pairs(plan) == []
    names = {b["name"] for b in plan}
    assert {"residual", "head_logits", "d_res", "pullback_scratch"} <= names
    # the head's logits chunk reuses memory that is dead while the head runs
    head = next(b for b in plan if b["name"] == "head_logits")
    assert any(b["live"] & HEAD == 0 and b["offset"] < head["offset"] + head["floats"]
               and head["offset"] < b["offset"] + b["floats"] for b in plan)
    total = max(b["offset"] + b["floats"] for b in plan)
    model = zoo.Model(cfg, seed=0, checkpointing=checkpointing)
    if precision == "bf16" and zoo.gemm_info()["bf16_native"]:
        model.set_precision("bf16")
    if model.precision == precision:
        assert 4 * total == model.activation_bytes(3, 16)
    # bf16 never plans more than fp32
    fp32 = _native.activation_plan(cfg.model_dump(), 3, 16, checkpointing)
    assert total <= max(b["offset"] + b["floats"] for b in fp32)


@pytest.mark.parametrize("n_layer,kept", [(2, False), (3, True)])
def test_a_bf16_step_keeps_the_products_outputs_in_bf16_where_that_saves_memory(n_layer, kept):
    """q|k|v, the attention output and the MLP input, each layer's in bf16; the layers share fp32
    buffers for them, which cost more than the halving saves in a model of two layers."""
    cfg = preset("tiny-gpt2").model_copy(update={"n_layer": n_layer}).model_dump()
    names = {b["name"] for b in _native.activation_plan(cfg, 3, 16, precision="bf16")}
    expected = {f"layer{i}.{t}_bf16" for i in range(n_layer) for t in ("qkv", "att", "fc")}
    assert (expected <= names) == kept and ("fc_work" in names) == kept
    assert not any(b["name"].endswith("_bf16") for b in _native.activation_plan(cfg, 3, 16, True, precision="bf16"))


def test_a_bf16_step_keeps_half_the_activations_and_a_smaller_head_chunk():
    """GPT-2 at 4 x 64, the memory target's shape: the saved products in bf16 and the LM head in
    two chunks of 128 rows (fp32 keeps one of 256)."""
    cfg = preset("gpt2").model_dump()
    plans = {p: _native.activation_plan(cfg, 4, 64, precision=p) for p in ("fp32", "bf16")}
    size = {p: {b["name"]: b["floats"] for b in plan} for p, plan in plans.items()}
    assert size["bf16"]["layer0.qkv_bf16"] == size["fp32"]["layer0.qkv"] // 2
    assert size["bf16"]["layer0.fc_bf16"] == size["fp32"]["layer0.fc"] // 2
    assert size["fp32"]["head_logits"] == 256 * 50257 and size["bf16"]["head_logits"] == 128 * 50257
    total = {p: max(b["offset"] + b["floats"] for b in plan) for p, plan in plans.items()}
    assert total["bf16"] < 0.6 * total["fp32"]


def test_a_built_model_steps_on_the_plan_it_checked():
    model = zoo.Model(preset("tiny-llama"), seed=0)
    tok = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9))
    model.loss_and_grads(tok[:, :-1], tok[:, 1:])
    plan = model._exec.activation_plan()
    assert plan and overlapping_live_pairs(plan) == []


def _configs():
    from zoo import ModelConfig

    return {
        "gpt2_tied": preset("tiny-gpt2"),
        # three layers: a bf16 step keeps the products' outputs in bf16
        "gpt2_three_layers": preset("tiny-gpt2").model_copy(update={"n_layer": 3}),
        "llama_untied": preset("tiny-llama"),
        # a vocabulary large enough that the LM head runs in several chunks of rows
        "chunked_head": ModelConfig(vocab_size=300_007, max_seq_len=16, d_model=16, n_layer=1, n_head=2, d_ff=32),
    }


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ad", ["manual", "clad"])
@pytest.mark.parametrize("checkpointing", [False, True, 1], ids=["stored", "checkpointed", "first-layer"])
@pytest.mark.parametrize("name", list(_configs()))
def test_dead_buffers_hold_nothing_a_phase_reads(name, checkpointing, ad, precision):
    """With every byte that no live buffer covers set to NaN at each phase boundary, a step
    gives the same loss and gradients: no buffer is read in a phase its declaration leaves out."""
    if ad == "clad" and not zoo.build_info()["clad"]:
        pytest.skip("this zoo was built without the Clad backend")
    if precision == "bf16" and not zoo.gemm_info()["bf16_native"]:
        pytest.skip("no bf16 dot products on this CPU")
    cfg = _configs()[name]
    tok = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 13))
    results = []
    for poison in (False, True):
        model = zoo.Model(cfg, seed=0, checkpointing=checkpointing, ad=ad, precision=precision)
        model._exec.set_poison_dead_buffers(poison)
        results.append(model.loss_and_grads(tok[:, :-1], tok[:, 1:]))
        results[-1][1]["logits"] = model.logits(tok[:, :-1])
    (loss, grads), (poisoned_loss, poisoned_grads) = results
    assert np.isfinite(poisoned_loss) and poisoned_loss == loss
    for k in grads:
        np.testing.assert_array_equal(poisoned_grads[k], grads[k], err_msg=k)


def test_checkpointing_part_of_the_layers_plans_between_none_and_all():
    """The first k layers checkpointed: their internals in one set they share (live while a layer
    runs), the others' kept (in bf16 in a bf16 step); from k = 1 (where the shared set can cost
    what the one layer's kept set saved) the arena shrinks as k grows, to the plan with every
    layer checkpointed (k = n_layer, the smallest); k = 0 is the plan without."""
    cfg = preset("tiny-gpt2").model_copy(update={"n_layer": 4}).model_dump()
    for precision in ("fp32", "bf16"):
        plans = [_native.activation_plan(cfg, 3, 16, k, precision=precision) for k in range(5)]
        totals = [max(b["offset"] + b["floats"] for b in plan) for plan in plans]
        assert all(a > b for a, b in zip(totals[1:], totals[2:])) and min(totals) == totals[4] < totals[0], totals
        for flag, k in ((False, 0), (True, 4)):
            assert _native.activation_plan(cfg, 3, 16, flag, precision=precision) == plans[k]
        names = {b["name"] for b in plans[2]}
        suffix = "_bf16" if precision == "bf16" else ""
        assert {f"layer{i}.fc{suffix}" for i in (2, 3)} <= names and "layers.res_mid" in names
        assert not any(n.startswith(("layer0.", "layer1.")) for n in names)
        assert overlapping_live_pairs(plans[2]) == []
    with pytest.raises(ValueError, match="5 checkpointed layers of 4"):
        _native.activation_plan(cfg, 3, 16, 5)
    model = zoo.Model(preset("tiny-gpt2"), seed=0, checkpointing=1)
    assert model.checkpointing and model.checkpoint_layers == 1
    with pytest.raises(ValueError, match="a number of layers from 0 to 2"):
        model.set_checkpointing(3)


def test_a_preference_step_over_a_frozen_base_reads_no_dead_buffer():
    """A frozen head's training forward keeps the head's input adjoint (d_norm) for the pullback,
    which scales it by the row weights: the gradients equal the plain step's for the weights of a
    mean cross-entropy, and stay the same with dead memory poisoned at every phase boundary and
    with the first layer, or every layer, checkpointed."""
    from zoo.arch.lora import LoraConfig

    cfg = preset("tiny-llama").model_copy(update={"n_layer": 3})
    rng = np.random.default_rng(4)
    tok = rng.integers(0, cfg.vocab_size, (2, 12))
    tgt = np.where(rng.random((2, 12)) < 0.5, rng.integers(0, cfg.vocab_size, (2, 12)), -100)
    weights = np.where(tgt != -100, -1.0 / (tgt != -100).sum(), 0.0)  # d(mean cross-entropy)/d(logprob)
    adapters = None
    results = []
    for checkpointing, poison in ((False, False), (False, True), (1, True), (True, True)):
        model = zoo.Model(cfg, seed=0, lora=LoraConfig(r=4, alpha=8, dropout=0.0), base_dtype="fp32",
                          checkpointing=checkpointing)
        if adapters is None:  # B != 0: the adapters are on every path of the gradients
            adapters = {k: rng.normal(0, 0.05, p.shape) for k, p in model.parameters().items()}
        for k, p in model.parameters().items():
            p[...] = adapters[k]
        if not results:
            loss, plain = model.loss_and_grads(tok, tgt)
        model._exec.set_poison_dead_buffers(poison)
        model.zero_grads()
        lp = model.target_logprobs(tok, tgt, train=True)
        model.backward_logprobs(weights)
        results.append((lp, {k: v.copy() for k, v in model.gradients().items()}))
    (lp, grads), rest = results[0], results[1:]
    assert -lp[tgt != -100].mean() == pytest.approx(loss, rel=1e-6)
    for k in grads:
        np.testing.assert_allclose(grads[k], plain[k], rtol=1e-4, atol=1e-7, err_msg=k)
    for other_lp, other in rest:
        np.testing.assert_array_equal(other_lp, lp)
        for k in grads:
            np.testing.assert_allclose(other[k], grads[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "checkpointed"])
def test_a_smaller_batch_after_a_larger_one_uses_its_own_rows(checkpointing):
    """The arena planned for a larger batch serves a smaller one: same results as a fresh model."""
    cfg = preset("tiny-llama")
    tok = np.random.default_rng(2).integers(0, cfg.vocab_size, (4, 11))
    fresh = zoo.Model(cfg, seed=0, checkpointing=checkpointing)
    small_loss, small_grads = fresh.loss_and_grads(tok[:2, :-1], tok[:2, 1:])
    small_logits = fresh.logits(tok[:1, :-1])
    model = zoo.Model(cfg, seed=0, checkpointing=checkpointing)
    model.loss_and_grads(tok[:, :-1], tok[:, 1:])
    loss, grads = model.loss_and_grads(tok[:2, :-1], tok[:2, 1:])
    assert loss == small_loss
    for k in grads:
        np.testing.assert_array_equal(grads[k], small_grads[k], err_msg=k)
    np.testing.assert_array_equal(model.logits(tok[:1, :-1]), small_logits)


def test_a_layout_table_the_kernels_would_misread_is_refused():
    from zoo.arch.layout import layout_table, parameter_layout, parameter_offsets

    cfg = preset("tiny-gpt2")
    layout = parameter_layout(cfg)
    _, n = parameter_offsets(layout)
    table = layout_table(layout)
    inv = []
    _native.Executor(cfg.model_dump(), n, table, inv)  # the table as written binds
    (r0, l0, o0, c0), (r1, l1, o1, c1) = table[2], table[3]  # two neighbours trade 16 floats: still tiles
    traded = table[:2] + [(r0, l0, o0, c0 - 16), (r1, l1, o1 - 16, c1 + 16)] + table[4:]
    with pytest.raises(ValueError, match=f"parameter role {r0} in layer 0 has {c0 - 16} floats in the layout; "
                                         f"the kernels read {c0}"):
        _native.Executor(cfg.model_dump(), n, traded, inv)
    with pytest.raises(ValueError, match=f"leaves a gap at float {table[3][2]}"):
        _native.Executor(cfg.model_dump(), n, table[:3] + table[4:], inv)
    with pytest.raises(ValueError, match=f"covers {n - table[-1][3]} of {n} floats"):
        _native.Executor(cfg.model_dump(), n, table[:-1], inv)
    twice = table + [table[-1]]
    with pytest.raises(ValueError, match="overlaps"):
        _native.Executor(cfg.model_dump(), n, twice, inv)
    misplaced = [("ln1_w", -1, *table[2][2:])] + [row for i, row in enumerate(table) if i != 2]
    with pytest.raises(ValueError, match="no parameter role ln1_w outside the layers"):
        _native.Executor(cfg.model_dump(), n, misplaced, inv)


def test_the_layout_binds_only_roles_the_executor_has():
    from zoo.arch.layout import parameter_layout

    roles = zoo.build_info()["roles"]
    for name in ("tiny-gpt2", "tiny-llama"):
        for p in parameter_layout(preset(name)):
            if p.role:
                assert p.role in (roles["layer"] if p.layer >= 0 else roles["model"]), p.name
