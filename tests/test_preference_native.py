"""What preference tuning adds to the native core, on both backends: attention with hidden key
spans (a packed pair's rejected answer sees the shared prompt but not the chosen answer before
it), the cross-entropy pullback weighted per row, and a step whose LM head runs on the selected
rows alone (Model.target_logprobs / backward_logprobs): a packed pair gives exactly what its two
sequences give run apart."""

import math

import numpy as np
import pytest
from helpers import GPT2_TINY, LLAMA_TINY

import zoo
from zoo.arch.lora import LoraConfig

torch = pytest.importorskip("torch")
nb = zoo._native.blocks
CLAD = bool(zoo.build_info()["clad"])
BACKENDS = ["manual", "clad"] if CLAD else ["manual"]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


# --- attention with hidden key spans --------------------------------------------------------


def visible_mask(positions: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """(B, T, T) booleans: which keys each row sees, from the rule's definition (block.hpp)."""
    B, T = positions.shape
    mask = np.zeros((B, T, T), bool)
    for b in range(B):
        for t in range(T):
            lo, hi = hidden[b, t]
            span = hi - lo if hi > lo else 0
            first = t - positions[b, t] - span
            mask[b, t, first:t + 1] = True
            if span:
                mask[b, t, lo:hi] = False
    return mask


def masked_attention(qkv, nh, nkv, hd, mask):
    B, T, _ = qkv.shape
    q, k, v = torch.split(qkv, [nh * hd, nkv * hd, nkv * hd], dim=-1)
    q = q.reshape(B, T, nh, hd).transpose(1, 2)
    k = k.reshape(B, T, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    v = v.reshape(B, T, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~torch.as_tensor(mask)[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, nh * hd)


def pair_row(P: int, C: int, R: int, pad: int = 0):
    """One row laid out as preference.pack_pairs lays a pair out: the prompt but its last token, the
    chosen answer's inputs, the rejected answer's (hiding the chosen), then padding."""
    shared = P - 1
    positions = np.concatenate([np.arange(shared), np.arange(shared, shared + C), np.arange(shared, shared + R),
                                np.arange(pad)])
    hidden = np.zeros((len(positions), 2), np.int64)
    hidden[shared + C:shared + C + R] = (shared, shared + C)
    return positions[None], hidden[None]


@pytest.mark.parametrize("nh,nkv,hd", [(4, 2, 8), (3, 3, 20)])
def test_attention_with_a_hidden_span_against_torch(nh, nkv, hd):
    """Forward, and the hand-written and Clad pullbacks, against torch with the mask spelled out;
    rows of two pairs (one of them padded) and a plain packed row."""
    rng = np.random.default_rng(0)
    pos_a, hid_a = pair_row(4, 5, 7, pad=3)
    pos_b, hid_b = pair_row(1, 9, 9, pad=0)
    T = pos_a.shape[1]
    pos_b = np.concatenate([pos_b, np.arange(T - pos_b.shape[1])[None]], axis=1)
    hid_b = np.concatenate([hid_b, np.zeros((1, T - hid_b.shape[1], 2), np.int64)], axis=1)
    pos_c = np.concatenate([np.arange(6), np.arange(T - 6)])[None]
    positions = np.concatenate([pos_a, pos_b, pos_c]).astype(np.int32)
    hidden = np.concatenate([hid_a, hid_b, np.zeros((1, T, 2), np.int64)]).astype(np.int32)
    qkv = rng.normal(0, 1.3, (3, T, (nh + 2 * nkv) * hd)).astype(np.float32)
    dout = rng.normal(0, 1, (3, T, nh * hd)).astype(np.float32)

    out, lse = nb.attention_forward(qkv, nh, nkv, hd, positions, hidden)
    t = torch.tensor(qkv, dtype=torch.float64, requires_grad=True)
    ref = masked_attention(t, nh, nkv, hd, visible_mask(positions, hidden))
    ref.backward(torch.tensor(dout, dtype=torch.float64))
    assert rel_err(out, ref.detach().numpy()) <= 1e-5
    assert rel_err(nb.attention_pullback(qkv, lse, dout, nh, nkv, hd, positions, hidden), t.grad.numpy()) <= 1e-5
    if CLAD:
        got = nb.attention_pullback_clad(qkv, dout, nh, nkv, hd, positions, hidden)
        assert rel_err(got, t.grad.numpy()) <= 1e-5
    # the rejected answers seeing the chosen ones too would give another output: the span matters
    seen = visible_mask(positions, hidden)
    seen[0, 10:17, 3:8] = True
    assert rel_err(masked_attention(t.detach(), nh, nkv, hd, seen).numpy(), out) > 1e-3


@pytest.mark.parametrize("lo,hi,pos,message", [
    (2, 9, 3, r"hidden\[0, 8\] = \[2, 9\)"),  # the span reaches the row itself
    (4, 6, 7, r"hidden\[0, 8\] = \[4, 6\)"),  # the keys would start before the row
    (5, 7, 0, r"hidden\[0, 8\] = \[5, 7\)"),  # the span starts before the first key seen
])
def test_hidden_spans_outside_their_keys_are_refused(lo, hi, pos, message):
    positions = np.arange(10, dtype=np.int32)[None].copy()
    hidden = np.zeros((1, 10, 2), np.int32)
    positions[0, 8], hidden[0, 8] = pos, (lo, hi)
    qkv = np.zeros((1, 10, 32), np.float32)
    with pytest.raises(ValueError, match=message):
        nb.attention_forward(qkv, 2, 1, 8, positions, hidden)
    model = zoo.Model(LLAMA_TINY, seed=0)
    tokens = np.zeros((1, 10), np.int64)
    with pytest.raises(ValueError, match=message):
        model.loss(tokens, tokens, positions=positions, hidden=hidden)
    with pytest.raises(ValueError, match="need positions"):
        model.loss(tokens, tokens, hidden=hidden)
    with pytest.raises(ValueError, match=r"shape \(1, 10, 2\)"):
        model.loss(tokens, tokens, positions=positions, hidden=hidden[:, :, :1])


# --- the cross-entropy pullback weighted per row -----------------------------------------


def test_cross_entropy_pullback_with_row_weights():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (6, 211)).astype(np.float32)
    targets = np.array([4, -100, 210, 0, 17, 99], np.int32)
    weights = np.array([0.5, 7.0, -1.25, 2.0, 0.0, 3.5], np.float32)
    t = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    row = torch.nn.functional.cross_entropy(t, torch.tensor(targets, dtype=torch.long), ignore_index=-100,
                                            reduction="none")
    (row * torch.tensor(weights, dtype=torch.float64) * 0.3).sum().backward()
    _, counted, d = nb.cross_entropy_forward_pullback(logits, targets, 0, 0.3, weights)
    assert counted == 5
    assert rel_err(d, t.grad.numpy()) <= 1e-5
    if CLAD:
        _, _, d_clad = nb.cross_entropy_forward_pullback_clad(logits, targets, 0, 0.3, weights)
        assert rel_err(d_clad, t.grad.numpy()) <= 1e-5


# --- a preference step: the LM head on the selected rows ----------------------------------


def _pair(cfg, P, C, R, seed):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, P), rng.integers(0, cfg.vocab_size, C),
            rng.integers(0, cfg.vocab_size, R))


def _apart(prompt, answer):
    """The sequence prompt + answer as TRL runs it: inputs, and targets on the answer alone."""
    whole = np.concatenate([prompt, answer])
    y = whole[1:].copy()
    y[:len(prompt) - 1] = -100
    return whole[None, :-1], y[None]


def _packed(pairs, T):
    from zoo.train.preference import pack_pairs

    return pack_pairs(pairs, T)


def _configs():
    out = [("gpt2", GPT2_TINY), ("llama", LLAMA_TINY)]
    if CLAD:  # the parallel-residual layer trains where Clad chains its pullback
        from test_parallel_layer import LLAMA_PARALLEL

        out.append(("llama-parallel", LLAMA_PARALLEL))
    return out


@pytest.mark.parametrize("ad", BACKENDS)
@pytest.mark.parametrize("name,cfg", _configs())
def test_a_packed_pair_gives_what_its_two_sequences_give(name, cfg, ad):
    """Two pairs packed in a row (each prompt computed once) against their four sequences run one
    by one: every answer token's log-probability, and the gradients of a weighted sum of them."""
    model = zoo.Model(cfg, seed=2, ad=ad)
    pairs = [_pair(cfg, 5, 4, 6, 0), _pair(cfg, 3, 7, 2, 1)]
    batch = _packed(pairs, 32)
    assert batch.x.shape[0] == 1  # both pairs in one row
    weights_by_answer = [0.7, -1.3, 0.25, 2.0]

    model.zero_grads()
    expected = {}
    for k, (prompt, chosen, rejected) in enumerate(pairs):
        for which, answer in enumerate((chosen, rejected)):
            x, y = _apart(prompt, answer)
            lp = model.target_logprobs(x, y, train=True)
            model.backward_logprobs(np.where(y != -100, weights_by_answer[2 * k + which], 0.0))
            expected[2 * k + which] = lp[y != -100]
    grads = {n: g.copy() for n, g in model.gradients().items()}

    model.zero_grads()
    lp = model.target_logprobs(batch.x, batch.y, batch.positions, batch.hidden, train=True)
    weights = np.where(batch.answer >= 0, np.take(weights_by_answer, np.maximum(batch.answer, 0)), 0.0)
    model.backward_logprobs(weights)
    for a, want in expected.items():
        np.testing.assert_allclose(lp[batch.answer == a], want, rtol=1e-5, atol=1e-5)
    for n, g in model.gradients().items():
        assert rel_err(g, grads[n]) <= 1e-4, n
    # the log-probabilities are minus the cross-entropy the plain step takes
    assert model.loss(batch.x, batch.y, batch.positions, batch.hidden) == pytest.approx(
        -lp[batch.y != -100].mean(), rel=1e-5)


def test_target_logprobs_match_the_logits():
    model = zoo.Model(LLAMA_TINY, seed=4)
    rng = np.random.default_rng(0)
    x = rng.integers(0, LLAMA_TINY.vocab_size, (2, 9))
    y = rng.integers(0, LLAMA_TINY.vocab_size, (2, 9))
    y[0, :3] = -100
    logits = model.logits(x).astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    want = np.where(y != -100, np.take_along_axis(logp, np.maximum(y, 0)[..., None], -1)[..., 0], 0.0)
    np.testing.assert_allclose(model.target_logprobs(x, y), want, rtol=1e-5, atol=1e-5)


def test_a_backward_needs_its_forward_just_before_it():
    model = zoo.Model(GPT2_TINY, seed=0)
    x = np.zeros((1, 6), np.int64)
    with pytest.raises(RuntimeError, match="target_logprobs"):
        model.backward_logprobs(np.ones((1, 6)))
    model.target_logprobs(x, x, train=True)
    model.loss(x, x)  # another pass overwrites what the pullback reads
    with pytest.raises(RuntimeError, match="select_forward just before it"):
        model._exec.select_backward(np.ones(6, np.float32), 1.0)
    with pytest.raises(ValueError, match="every one is -100"):
        model.target_logprobs(x, np.full((1, 6), -100))


def test_adapters_off_is_the_base():
    base = zoo.Model(LLAMA_TINY, seed=5, lora=LoraConfig(r=4, alpha=8), base_dtype="fp32")
    for p in base.parameters().values():  # adapters that change the output
        p[...] = np.random.default_rng(1).normal(0, 0.2, p.shape)
    plain = zoo.Model(LLAMA_TINY, seed=5)
    x = np.random.default_rng(2).integers(0, LLAMA_TINY.vocab_size, (1, 8))
    assert not np.allclose(base.logits(x), plain.logits(x), atol=1e-4)
    base.set_adapters_enabled(False)
    np.testing.assert_allclose(base.logits(x), plain.logits(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="adapters are off"):
        base.target_logprobs(x, x, train=True)
    base.set_adapters_enabled(True)
    assert not np.allclose(base.logits(x), plain.logits(x), atol=1e-4)


@pytest.mark.parametrize("ad", BACKENDS)
def test_a_preference_step_allocates_nothing(ad):
    from test_no_allocation import LLAMA  # rows longer than a Clad tape's inline buffer

    model = zoo.Model(LLAMA, seed=0, ad=ad)
    batch = _packed([_pair(LLAMA, 6, 30, 35, 0), _pair(LLAMA, 4, 10, 12, 1)], 96)
    rows = np.flatnonzero(batch.y.reshape(-1) != -100).astype(np.int32)
    args = (batch.x.astype(np.int32), batch.positions, batch.hidden, rows, batch.y.reshape(-1)[rows])
    assert model._exec.count_select_step_allocations(*args, 1) >= 0  # the warm-up step plans
    assert model._exec.count_select_step_allocations(*args, 3) == 0
