"""Packed rows: several examples in one row, each with positions restarting at 0, train and
predict exactly as the examples would on their own: attention, RoPE and learned positions stay
within each example, forward and pullback, on both backends."""

import numpy as np
import pytest
from test_model_parity import GPT2_TINY, LLAMA_TINY

import zoo

LENGTHS = (5, 7, 4)  # three examples packed into one row of 16


def _examples(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, cfg.vocab_size, (1, n)), rng.integers(0, cfg.vocab_size, (1, n))) for n in LENGTHS]


def _packed(examples):
    tokens = np.concatenate([x for x, _ in examples], axis=1)
    targets = np.concatenate([y for _, y in examples], axis=1)
    positions = np.concatenate([np.arange(x.shape[1])[None] for x, _ in examples], axis=1)
    return tokens, targets, positions


def _backends():
    return ["manual", "clad"] if zoo.build_info()["clad"] else ["manual"]


@pytest.mark.parametrize("ad", _backends())
@pytest.mark.parametrize("name,cfg", [("gpt2", GPT2_TINY), ("llama", LLAMA_TINY)])
def test_packed_examples_do_not_see_each_other(name, cfg, ad):
    model = zoo.Model(cfg, seed=3, ad=ad)
    examples = _examples(cfg)
    tokens, targets, positions = _packed(examples)
    total = tokens.shape[1]

    separate = np.concatenate([model.logits(x) for x, _ in examples], axis=1)
    np.testing.assert_allclose(model.logits(tokens, positions=positions), separate, rtol=1e-5, atol=1e-5)

    # The packed row's mean loss and its gradients are the examples' own, weighted by length.
    model.zero_grads()
    weighted = sum(model.forward_backward(x, y, grad_scale=x.shape[1] / total) * x.shape[1] / total
                   for x, y in examples)
    expected = {k: v.copy() for k, v in model.gradients().items()}
    loss, grads = model.loss_and_grads(tokens, targets, positions=positions)
    assert loss == pytest.approx(weighted, rel=1e-6)
    assert model.loss(tokens, targets, positions=positions) == pytest.approx(loss, rel=1e-6)
    for k in expected:
        np.testing.assert_allclose(grads[k], expected[k], rtol=1e-4, atol=1e-6, err_msg=k)

    # Without positions the row is one sequence: later examples see the earlier ones.
    assert not np.allclose(model.logits(tokens)[:, LENGTHS[0]:], separate[:, LENGTHS[0]:], atol=1e-3)


def test_packed_rows_in_a_batch_with_a_plain_row():
    model = zoo.Model(LLAMA_TINY, seed=1)
    tokens, targets, positions = _packed(_examples(LLAMA_TINY, seed=2))
    plain = np.random.default_rng(5).integers(0, LLAMA_TINY.vocab_size, tokens.shape)
    batch = np.concatenate([tokens, plain])
    both = np.concatenate([positions, np.arange(tokens.shape[1])[None]])
    logits = model.logits(batch, positions=both)
    np.testing.assert_allclose(logits[:1], model.logits(tokens, positions=positions), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits[1:], model.logits(plain), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad,message", [
    ([[1, 2, 3, 0]], r"positions\[0, 0\] = 1 after -1"),
    ([[0, 1, 3, 0]], r"positions\[0, 2\] = 3 after 1"),
    ([[0, 1, 1, 2]], r"positions\[0, 2\] = 1 after 1"),
])
def test_positions_that_do_not_count_from_zero_are_refused(bad, message):
    model = zoo.Model(GPT2_TINY, seed=0)
    tokens = np.zeros((1, 4), dtype=np.int64)
    with pytest.raises(ValueError, match=message):
        model.loss(tokens, tokens, positions=np.array(bad))
    with pytest.raises(ValueError, match="positions hold 9, outside a row of 4 tokens"):
        model.logits(tokens, positions=np.array([[0, 1, 2, 9]]))
    with pytest.raises(ValueError, match="shape of tokens"):
        model.logits(tokens, positions=np.array([[0, 1, 2]]))
