"""Data-parallel training (docs/distributed.md).

First the pieces that need no MPI: AdamW over a shard of the parameters, clipping by a given
norm, and the split of a global batch across ranks. Then whole runs under mpirun (skipped, with
the reason, where mpi4py or mpirun is missing; `make test` installs both through the `mpi`
extra): tiny Llama, byte-level tokenizer, the demo text, one thread per rank."""

from __future__ import annotations

import numpy as np
import pytest

import zoo


def _batch(seed=0, B=4, T=32):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 258, (B, T)), rng.integers(0, 258, (B, T))


def test_adamw_over_shards_equals_adamw_over_all():
    """Two models holding half the moments each, clipped by the norm summed from both halves and
    merged after each step, follow the model that holds them all (bitwise here: the same
    element-wise update; the norms differ only in summation order, too little to change the
    float32 clip factor)."""
    cfg = zoo.preset("tiny-llama")
    whole = zoo.Model(cfg, seed=0)
    n, cut = whole.n_params, whole.n_params // 2 + 5  # a cut inside a tensor, off the 16-float grid
    halves = [zoo.Model(cfg, seed=0), zoo.Model(cfg, seed=0)]
    halves[0].set_moment_range(0, cut)
    halves[1].set_moment_range(cut, n)
    assert halves[0].optimizer_state()["m"].size == cut and halves[1].optimizer_state()["v"].size == n - cut
    x, y = _batch()
    for _ in range(3):
        for m in (whole, *halves):
            m.zero_grads()
            m.forward_backward(x, y)
        expected = whole.adamw_step(1e-2, weight_decay=0.1, max_grad_norm=0.5)
        norm = np.sqrt(halves[0].grad_sum_squares(0, cut) + halves[1].grad_sum_squares(cut, n))
        assert norm == pytest.approx(expected, rel=1e-6)
        for m in halves:
            assert m.adamw_step(1e-2, weight_decay=0.1, max_grad_norm=0.5, grad_norm=norm) == norm
        merged = np.concatenate([halves[0].parameter_block()[:cut], halves[1].parameter_block()[cut:]])
        for m in halves:
            m.parameter_block()[:] = merged
        np.testing.assert_array_equal(merged, whole.parameter_block())
    # The shards' moments are the whole model's, cut at the same place.
    np.testing.assert_array_equal(halves[1].optimizer_state()["v"], whole.optimizer_state()["v"][cut:])


def test_moment_range_is_fixed_once_the_moments_exist():
    m = zoo.Model(zoo.preset("tiny-llama"), seed=0)
    with pytest.raises(ValueError, match="not a non-empty range"):
        m.set_moment_range(5, 5)
    m.optimizer_state()
    with pytest.raises(RuntimeError, match="in use already"):
        m.set_moment_range(0, 10)


def test_reduced_gradients_replace_the_pass_norm():
    """reduce_gradients: what a collective writes into the block is what the step clips by."""
    m = zoo.Model(zoo.preset("tiny-llama"), seed=0)
    m.zero_grads()
    m.forward_backward(*_batch())
    before = m.grad_norm()
    m.reduce_gradients(lambda block: block.__imul__(2.0))
    assert m.grad_norm() == pytest.approx(2 * before, rel=1e-6)
    with pytest.raises(ValueError, match="grad_norm must be >= 0"):
        m.adamw_step(1e-3, grad_norm=float("nan"))
