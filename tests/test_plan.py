"""The activation planner (native/plan.hpp): buffers placed by liveness, and the proof that no
two buffers live at the same time share memory."""

import itertools

import numpy as np
import pytest

import zoo
from zoo._load_native import _native
from zoo.presets import preset

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


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_training_plans_never_overlap_live_buffers(name, checkpointing):
    cfg = preset(name)
    plan = _native.activation_plan(cfg.model_dump(), 3, 16, checkpointing)
    assert overlapping_live_pairs(plan) == []
    names = {b["name"] for b in plan}
    assert {"residual", "head_logits", "d_res", "pullback_scratch"} <= names
    # the head's logits chunk reuses memory that is dead while the head runs
    head = next(b for b in plan if b["name"] == "head_logits")
    assert any(b["live"] & HEAD == 0 and b["offset"] < head["offset"] + head["floats"]
               and head["offset"] < b["offset"] + b["floats"] for b in plan)
    total = max(b["offset"] + b["floats"] for b in plan)
    assert 4 * total == zoo.Model(cfg, seed=0, checkpointing=checkpointing).activation_bytes(3, 16)


def test_a_built_model_steps_on_the_plan_it_checked():
    model = zoo.Model(preset("tiny-llama"), seed=0)
    tok = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9))
    model.loss_and_grads(tok[:, :-1], tok[:, 1:])
    plan = model._exec.activation_plan()
    assert plan and overlapping_live_pairs(plan) == []
