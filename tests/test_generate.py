"""Generation: the sampling rules, stopping, streaming, and greedy parity with transformers."""

import io
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import gemm_rounding, greedy_agrees, needs

from zoo.generate import TextStream, generate, sample_token


def test_greedy_and_degenerate_filters_pick_argmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32)
    best = int(np.argmax(logits))
    assert sample_token(logits, 0.0, None, None, rng) == best
    assert all(sample_token(logits, 1.5, 1, None, rng) == best for _ in range(20))
    assert all(sample_token(logits, 1.5, None, 1e-6, rng) == best for _ in range(20))


def test_sampling_follows_softmax_and_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    rng = np.random.default_rng(1)
    draws = np.array([sample_token(logits, 1.0, None, None, rng) for _ in range(4000)])
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    assert set(sample_token(logits, 1.0, 2, None, rng) for _ in range(300)) == {0, 1}
    assert set(sample_token(logits, 1.0, None, 0.7, rng) for _ in range(300)) == {0, 1}  # 0.5 < 0.7 <= 0.8
    a = [sample_token(logits, 1.0, None, None, np.random.default_rng(7)) for _ in range(5)]
    b = [sample_token(logits, 1.0, None, None, np.random.default_rng(7)) for _ in range(5)]
    assert a == b


class ScriptedModel:
    """forward_segments returns logits that prefer token (last input + 1) % V: generation counts up."""

    def __init__(self, vocab=10, max_len=8):
        self.config = SimpleNamespace(vocab_size=vocab, max_seq_len=max_len)
        self.calls = []

    def reset_cache(self, b, max_len):
        self.calls.append(("reset", b, max_len))

    def forward_segments(self, slots, token_lists, starts):
        self.calls.append(("fwd", [(s, list(t), p) for s, t, p in zip(slots, token_lists, starts)]))
        out = np.zeros((len(slots), self.config.vocab_size), dtype=np.float32)
        for k, t in enumerate(token_lists):
            out[k, (t[-1] + 1) % self.config.vocab_size] = 5.0
        return out


def test_generate_uses_the_cache_and_stops_at_eos_or_context():
    m = ScriptedModel()
    assert generate(m, [1, 2], 10, stop_ids=[5]) == [3, 4, 5]
    assert m.calls[0] == ("reset", 1, 8) and m.calls[1] == ("fwd", [(0, [1, 2], 0)])
    assert m.calls[2:] == [("fwd", [(0, [3], 2)]), ("fwd", [(0, [4], 3)])]
    assert generate(ScriptedModel(), [1, 2], 10) == [3, 4, 5, 6, 7, 8]  # max_seq_len 8 caps it
    seen = []
    generate(ScriptedModel(), [0], 3, on_token=seen.append)
    assert seen == [1, 2, 3]


def test_generate_rejects_bad_prompts():
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(ScriptedModel(), [], 3)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generate(ScriptedModel(), [11], 3)
    with pytest.raises(ValueError, match="beyond the model's max_seq_len"):
        generate(ScriptedModel(), list(range(9)), 3)


def test_stream_holds_back_partial_utf8():
    class Bytes:
        eos_id = 256

        def decode(self, ids):
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    out = io.StringIO()
    s = TextStream(Bytes(), list(b"x"), file=out)
    for b in "é!".encode():
        s(b)
        assert "\ufffd" not in out.getvalue()
    s(256)
    s.finish()
    assert out.getvalue() == "é!\n"


# --- parity with transformers ---------------------------------------------------------


def _hf_models():
    import transformers

    gpt2 = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                   bos_token_id=0, eos_token_id=1, initializer_range=0.2)
    llama = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                                     initializer_range=0.2)
    return {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}, {"gpt2": gpt2, "llama": llama}


@gemm_rounding
@needs("torch", "transformers")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_matches_transformers(tmp_path, family):
    """zoo's greedy tokens are transformers' top choices given the tokens before (its logits
    over zoo's sequence), and transformers' own greedy generation gives them, up to the first
    near-tie (top two logits within 1e-4: none here, the smallest gap is 2e-3)."""
    import torch

    classes, configs = _hf_models()
    from zoo import Model

    torch.manual_seed(0)
    hf = classes[family](configs[family]).eval()
    hf.save_pretrained(tmp_path)
    model = Model.from_pretrained(tmp_path)
    prompt = [0, 17, 42, 99, 7, 250, 3]
    ours = generate(model, prompt, 32, temperature=0.0)
    assert len(ours) == 32
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].numpy()
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=1)[0, len(prompt):].tolist()
    free = greedy_agrees(logits, ours)
    assert ours[:free] == ref[:free]
