"""Generation at the weights' bandwidth: the decode products (native/kernels/gemv.hpp) on every
instruction set against the plain C++ kernel and against the sums they declare; the KV cache's
segments (several sequences in one call, each at its own position, prompts in chunks) against
the full forward; batched generation against one prompt at a time; and greedy generation on
every base format against transformers running the same stored weights."""

import numpy as np
import pytest
from helpers import bf16_round

import zoo
from zoo import ModelConfig
from zoo.core.native import _native
from zoo.generate import generate, generate_batch

FORMATS = ["fp32", "bf16", "int8", "nf4"]
ISAS = _native.decode_isas()


def _stored(w: np.ndarray, fmt: str) -> np.ndarray:
    """W as the format stores it, widened to float32 (the GEMM path's widening)."""
    return _native.stored_matrix_product(np.eye(w.shape[1], dtype=np.float32), w, fmt, "fp32")[0].T


NF4_LEVELS = np.array([-1.0, -0.6961928, -0.52507305, -0.39491749, -0.28444138, -0.18477343, -0.09105004, 0.0,
                       0.07958030, 0.16093020, 0.24611230, 0.33791524, 0.44070983, 0.56261700, 0.72295684, 1.0],
                      dtype=np.float32)


def _nf4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quant.hpp's nf4 in numpy: per block of 64 values (the last padded with zeros) the scale
    max|block| and each value's nearest level (a tie to the lower one)."""
    R, K = w.shape
    K64 = -(-K // 64) * 64
    blocks = np.zeros((R, K64), np.float32)
    blocks[:, :K] = w
    blocks = blocks.reshape(R, -1, 64)
    scales = np.abs(blocks).max(axis=2)
    v = blocks * np.where(scales > 0, 1.0 / np.where(scales > 0, scales, 1), 0).astype(np.float32)[:, :, None]
    mid = (NF4_LEVELS[:-1] + NF4_LEVELS[1:]) / 2
    codes = (v[..., None] > mid).sum(axis=-1)
    return codes, scales


def _declared(x, w, fmt, precision):
    """The sums gemv.hpp declares, in float64, and the sums of their terms' magnitudes."""
    rounds = precision == "bf16" and fmt != "fp32"
    xs = (bf16_round(x) if rounds else x).astype(np.float64)
    if rounds and fmt == "int8":  # 16-bit integers times their row's scale
        scale = np.abs(x).max(axis=1, keepdims=True).astype(np.float32) / np.float32(32767)
        xs = np.rint(x / np.where(scale > 0, scale, 1)) * scale.astype(np.float64)
    if fmt == "nf4":
        codes, scales = _nf4(w)
        levels = (bf16_round(NF4_LEVELS) if rounds else NF4_LEVELS).astype(np.float64)
        wide = (levels[codes] * scales[:, :, None]).reshape(w.shape[0], -1)[:, :w.shape[1]]
        # The numpy codes are the stored ones: widened, they give the stored matrix back.
        np.testing.assert_allclose((NF4_LEVELS[codes] * scales[:, :, None]).reshape(w.shape[0], -1)[:, :w.shape[1]],
                                   _stored(w, "nf4"), rtol=1e-6, atol=1e-7)
    else:
        wide = _stored(w, fmt).astype(np.float64)
    return xs @ wide.T, np.abs(xs) @ np.abs(wide).T


def _operands(rng, M, R, K):
    return rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((R, K)).astype(np.float32)


# Shapes that reach every tail: rows not a multiple of a block of 4 or of 16, columns not a
# multiple of 16, 32 or 64 (nf4's blocks), and one column.
SHAPES = [(1, 1), (5, 15), (37, 100), (16, 33), (33, 130), (20, 576)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_instruction_set_computes_what_the_plain_kernel_does(fmt, precision):
    rng = np.random.default_rng(0)
    for R, K in SHAPES:
        for M in range(1, 9):
            x, w = _operands(rng, M, R, K)
            b = rng.standard_normal(R).astype(np.float32)
            r = rng.standard_normal((M, R)).astype(np.float32)
            plain = _native.decode_product(x, w, fmt, precision, "scalar", b, r)[0]
            _, size = _declared(x, w, fmt, precision)
            for isa in ISAS[1:]:
                y = _native.decode_product(x, w, fmt, precision, isa, b, r)[0]
                # The same sums in another order: fp32 rounding of the terms' magnitudes.
                np.testing.assert_allclose(y, plain, rtol=0, atol=2e-6 * (size.max() + 1),
                                           err_msg=f"{isa} {fmt} {precision} M={M} R={R} K={K}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_decode_product_is_the_sum_it_declares(fmt, precision):
    """x W^T + bias + residual with W as stored, x rounded to bf16 in a bf16 product of a narrow
    format (and nf4's levels), on every instruction set, split over threads or not."""
    rng = np.random.default_rng(1)
    for R, K in [(37, 128), (70, 576), (16, 64)]:
        for M in (1, 3, 8):
            x, w = _operands(rng, M, R, K)
            b = rng.standard_normal(R).astype(np.float32)
            r = rng.standard_normal((M, R)).astype(np.float32)
            want, size = _declared(x, w, fmt, precision)
            for isa in ISAS:
                for parallel in (False, True):
                    y = _native.decode_product(x, w, fmt, precision, isa, b, r, parallel=parallel)[0]
                    np.testing.assert_allclose(y, want + b + r, rtol=0, atol=4e-6 * (size.max() + 1),
                                               err_msg=f"{isa} {fmt} {precision} M={M} R={R} K={K}")


def test_a_bf16_product_rounds_the_operand_and_an_fp32_one_does_not():
    rng = np.random.default_rng(2)
    x, w = _operands(rng, 2, 48, 256)
    for isa in ISAS:
        exact = _native.decode_product(x, w, "bf16", "fp32", isa)[0]
        rounded = _native.decode_product(x, w, "bf16", "bf16", isa)[0]
        wide = _stored(w, "bf16").astype(np.float64)
        np.testing.assert_allclose(exact, x.astype(np.float64) @ wide.T, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(rounded, bf16_round(x).astype(np.float64) @ wide.T, rtol=1e-5, atol=1e-4)
        assert np.abs(exact - rounded).max() > 1e-3  # the rounding of x shows


def test_the_decode_product_refuses_what_it_cannot_do():
    x, w = _operands(np.random.default_rng(3), 9, 8, 16)
    with pytest.raises(ValueError, match="1 to 8 rows, not 9"):
        _native.decode_product(x, w, "fp32", "fp32", "scalar")
    with pytest.raises(ValueError, match="instruction set 'sse9' is unknown"):
        _native.decode_product(x[:1], w, "fp32", "fp32", "sse9")
    missing = [i for i in ("avx2", "avx512", "avx512_bf16") if i not in ISAS]
    for isa in missing:  # built without it, or a CPU without it: named, not run
        with pytest.raises(ValueError, match=f"instruction set {isa} is not built"):
            _native.decode_product(x[:1], w, "fp32", "fp32", isa)


def test_int8_sums_longer_than_a_flush_stay_exact():
    """Rows longer than the integer sums' flush (8192 values on AVX-512 against 3 or more rows
    of x, 2048 otherwise) at the largest terms the 16-bit operand has (127 x 32767): a lane's
    integer sum reaches 2^31 - 2^16 between flushes of 8192 and must not wrap; every instruction
    set gives the exact total."""
    K = 8192 * 2 + 100
    w = np.ones((5, K), np.float32)
    w[1] = -1.0
    w[2, ::3] = -1.0
    x = np.ones((4, K), np.float32)
    x[1] = -2.0
    x[2, 1::2] = -1.0
    x[3, :8192] = 0.5  # max|x| is 1: these are the half-way integer 16384 (16383.5 rounds to even)
    want, _ = _declared(x, w, "int8", "bf16")
    for isa in ISAS:
        for M in (1, 4):
            y = _native.decode_product(x[:M], w, "int8", "bf16", isa)[0]
            np.testing.assert_allclose(y, want[:M], rtol=1e-6, atol=1e-6, err_msg=f"{isa} M={M}")


# --- the KV cache's segments --------------------------------------------------------------------

LLAMA = ModelConfig(vocab_size=211, max_seq_len=48, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=96,
                    norm="rmsnorm", mlp="swiglu", positions="rope", attention_bias=False, mlp_bias=False,
                    tied_embeddings=False)
GPT2 = ModelConfig(vocab_size=97, max_seq_len=48, d_model=48, n_layer=2, n_head=4, d_ff=96)
# A context longer than a chunk of the cache (cache_chunk_rows, 512): a prompt goes through in pieces.
LONG = ModelConfig(vocab_size=64, max_seq_len=1200, d_model=32, n_layer=2, n_head=2, n_kv_head=1, d_ff=64,
                   norm="rmsnorm", mlp="swiglu", positions="rope", attention_bias=False, mlp_bias=False)


def _model(cfg, fmt, precision="fp32"):
    return zoo.Model(cfg, seed=4, base_dtype=fmt, precision=precision)


def _full(model, seq):
    return model.logits(np.asarray([seq]))[0]


def _tol(fmt, precision):
    return 1e-4 if precision == "fp32" else 3e-2  # bf16 products: the operands' rounding


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_segments_of_several_sequences_match_the_full_forward(cfg, fmt, threads):
    """Prompts of different lengths in one call, then their new tokens together, each at its own
    position; a sequence rewritten from the middle; a slot left out of a call."""
    precision = "fp32"
    model = _model(cfg, fmt, precision)
    rng = np.random.default_rng(6)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (30, 5, 17)]
    model.reset_cache(4, 40)
    prompts = [seqs[0][:9], seqs[1][:2], seqs[2][:11]]
    got = model.forward_segments([0, 2, 3], prompts, [0, 0, 0])
    for k, (s, p) in enumerate(zip(seqs, prompts)):
        np.testing.assert_allclose(got[k], _full(model, p)[-1], atol=_tol(fmt, precision), err_msg=f"prompt {k}")
    at = [len(p) for p in prompts]
    for step in range(3):  # one new token each, the slots in another order
        order = [2, 0, 1] if step % 2 else [0, 1, 2]
        slots = [[0, 2, 3][k] for k in order]
        got = model.forward_segments(slots, [[seqs[k][at[k]]] for k in order], [at[k] for k in order])
        for j, k in enumerate(order):
            at[k] += 1
            np.testing.assert_allclose(got[j], _full(model, seqs[k][:at[k]])[-1], atol=_tol(fmt, precision),
                                       err_msg=f"step {step}, sequence {k}")
    assert [model.slot_length(s) for s in (0, 1, 2, 3)] == [at[0], 0, at[1], at[2]]
    # Sequence 0 rewritten from position 4 with other tokens, sequence 2 untouched by this call.
    other = rng.integers(0, cfg.vocab_size, 6).tolist()
    got = model.forward_segments([0], [other], [4])
    np.testing.assert_allclose(got[0], _full(model, seqs[0][:4] + other)[-1], atol=_tol(fmt, precision))
    assert model.slot_length(0) == 10
    got = model.forward_segments([3], [[seqs[2][at[2]]]], [at[2]])
    np.testing.assert_allclose(got[0], _full(model, seqs[2][:at[2] + 1])[-1], atol=_tol(fmt, precision))


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_a_prompt_longer_than_a_chunk_goes_through_in_pieces(fmt):
    model = _model(LONG, fmt)
    rng = np.random.default_rng(7)
    seq = rng.integers(0, LONG.vocab_size, 1100).tolist()
    full = model.logits(np.asarray([seq]))[0]
    model.reset_cache(3, 1110)
    # Two prompts in one call: 700 + 400 rows, split 512 | 188 + 324 | 76 across three chunks.
    got = model.forward_segments([1, 0], [seq[:700], seq[:400]], [0, 0])
    np.testing.assert_allclose(got[0], full[699], atol=1e-4)
    np.testing.assert_allclose(got[1], full[399], atol=1e-4)
    got = model.forward_segments([0, 1], [seq[400:1090], seq[700:701]], [400, 700])
    np.testing.assert_allclose(got[0], full[1089], atol=1e-4)
    np.testing.assert_allclose(got[1], full[700], atol=1e-4)
    step = model.forward_segments([0], [seq[1090:1091]], [1090])
    np.testing.assert_allclose(step[0], full[1090], atol=1e-4)


def test_a_segment_the_cache_cannot_take_is_refused_by_name():
    model = _model(LLAMA, "fp32")
    with pytest.raises(ValueError, match=r"reset_cache\(B, max_len\) first"):
        model.forward_segments([0], [[1, 2]], [0])
    model.reset_cache(2, 10)
    model.forward_segments([0], [[1, 2, 3]], [0])
    cases = [([2], [[1]], [0], "segment 0: slot 2 outside the cache's 2 slots"),
             ([0, 0], [[1], [2]], [3, 4], "segment 1: slot 0 twice in one call"),
             ([1], [[1]], [1], "segment 0: position 1, but slot 1 holds 0 positions"),
             ([0], [[1]], [5], "segment 0: position 5, but slot 0 holds 3 positions"),
             ([0], [list(range(8))], [3], r"segment 0: positions 3..11 exceed the cache length 10"),
             ([0, 1], [[1], [2]], [3], "one of each per sequence"),
             ([0], [[]], [3], "token list 0 must be a non-empty"),
             ([0], [[500]], [3], "id 500 outside the vocabulary"),
             ([-1], [[1]], [3], "slots hold -1"),
             ([0], [[1]], [2**40], "starts hold 1099511627776"),
             ([0, 1, 1], [[1], [2], [3]], [3, 0, 0], "segments for a cache of 2 slots")]
    for slots, lists, starts, message in cases:
        with pytest.raises(ValueError, match=message):
            model.forward_segments(slots, lists, starts)
    assert model.slot_length(0) == 3 and model.slot_length(1) == 0  # refused calls changed nothing
    with pytest.raises(ValueError, match="reset_cache"):
        model.forward_cached(np.zeros((1, 2), dtype=np.int64), 0)  # a cache of 2 slots takes 2 rows


# --- batched generation -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_generation_gives_each_prompt_what_it_gets_alone(fmt, threads):
    """Greedy, more prompts than slots: finished sequences hand their slot to the next prompt,
    whose prompt runs in the same calls as the others' new tokens."""
    model = _model(LLAMA, fmt, "fp32")
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, LLAMA.vocab_size, n).tolist() for n in (3, 12, 1, 7, 20, 5)]
    budgets = [9, 4, 15, 6, 30, 2]  # the fifth runs into the context (48 - 20 = 28 tokens)
    alone = [generate(model, p, b) for p, b in zip(prompts, budgets)]
    assert len(alone[4]) == 28
    batched = generate_batch(model, prompts, 30, batch_size=3,
                             stop_after=lambda i, new: len(new) >= budgets[i])
    for p, want, got in zip(prompts, alone, batched):
        _same_greedy(model, p, want, got)


def _same_greedy(model, prompt, want, got):
    """Greedy tokens equal, or parting where the top two logits are a rounding apart: a row's
    sums differ in the last bits with the rows beside it (several rows take the GEMM path)."""
    if want == got:
        return
    k = next(k for k in range(min(len(want), len(got))) if want[k] != got[k])
    logits = model.logits(np.asarray([prompt + want[:k]]))[0, -1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] < 1e-4 * max(1.0, np.abs(logits).max()), f"parted at new token {k}: {want} vs {got}"


def test_batched_generation_stops_each_sequence_on_its_own_and_samples_each_on_its_own():
    model = _model(LLAMA, "bf16")
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, LLAMA.vocab_size, 4).tolist() for _ in range(5)]
    free = generate_batch(model, prompts, 12, temperature=0.0, batch_size=5)
    stop = {free[1][3], free[3][0]}
    stopped = generate_batch(model, prompts, 12, temperature=0.0, batch_size=2, stop_ids=stop)
    for p, want, got in zip(prompts, free, stopped):
        cut = next((k + 1 for k, t in enumerate(want) if t in stop), len(want))
        _same_greedy(model, p, want[:cut], got)
    seen = []
    sampled = generate_batch(model, prompts, 10, temperature=1.0, seed=3, batch_size=5,
                             on_token=lambda i, tok: seen.append((i, tok)))
    assert sorted(seen) == sorted((i, t) for i, out in enumerate(sampled) for t in out)
    # Prompt i's tokens come from its own generator, whatever shares its batch.
    regrouped = generate_batch(model, prompts, 10, temperature=1.0, seed=3, batch_size=2)
    assert regrouped == sampled
    assert generate_batch(model, prompts[:1], 10, temperature=1.0, seed=3)[0] == sampled[0]
    assert generate(model, prompts[0], 10, temperature=1.0, seed=3) == sampled[0]


def test_batched_generation_refuses_bad_prompts_by_index():
    model = _model(LLAMA, "fp32")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_batch(model, [[1], []], 3)
    with pytest.raises(ValueError, match="prompt 2: token id 999 outside"):
        generate_batch(model, [[1], [2], [999]], 3)
    with pytest.raises(ValueError, match="batch_size: must be >= 1"):
        generate_batch(model, [[1]], 3, batch_size=0)
    assert generate_batch(model, [list(range(48)), [1]], 3) == [[], generate(model, [1], 3)]


# --- greedy generation against transformers, on every base format --------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_generation_matches_transformers_on_the_stored_weights(tmp_path, family, fmt):
    """transformers runs the weights the base format stores (widened back to float32): every
    step's logits agree within the products' rounding, and greedy picks the same token wherever
    the top two logits are further apart than that (a nearer tie may break either way)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zoo import Model

    if family == "llama":
        hf_cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=192,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=96, tie_word_embeddings=False,
                                          initializer_range=0.2)
        hf_class = transformers.LlamaForCausalLM
    else:
        hf_cfg = transformers.GPT2Config(vocab_size=300, n_positions=96, n_embd=128, n_layer=2, n_head=4,
                                         initializer_range=0.2)
        hf_class = transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    hf_class(hf_cfg).eval().save_pretrained(tmp_path / "fp32")
    precision = "bf16" if fmt != "fp32" and zoo.gemm_info()["bf16_native"] else "fp32"
    model = Model.from_pretrained(tmp_path / "fp32", base_dtype=fmt, precision=precision)
    model.save_pretrained(tmp_path / "stored")  # the stored weights, widened: what transformers runs
    hf = hf_class.from_pretrained(tmp_path / "stored", torch_dtype=torch.float32).eval()
    prompt = [0, 17, 42, 99, 7, 250, 3]
    ours = generate(model, prompt, 40)
    seq = prompt + ours
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].numpy()
    model.reset_cache(1, len(seq))
    steps = [model.forward_segments([0], [prompt], [0])[0]]
    steps += [model.forward_segments([0], [[t]], [len(prompt) + k])[0] for k, t in enumerate(ours[:-1])]
    bound = {"fp32": 2e-4}.get(precision, 4e-2) * max(1.0, np.abs(ref).max())
    for k, step in enumerate(steps):
        want = ref[len(prompt) - 1 + k]
        assert np.abs(step - want).max() < bound, f"step {k}: {np.abs(step - want).max()} >= {bound}"
        top2 = np.sort(want)[-2:]
        if top2[1] - top2[0] > 2 * bound:
            assert ours[k] == int(np.argmax(want)), f"step {k}"


# --- zoo generate --prompts ---------------------------------------------------------------------


def test_generate_a_file_of_prompts_prints_what_each_prompt_gives_alone(tmp_path, capsys):
    import json

    from zoo.cli import main
    from zoo.generate import prompt_tokens
    from zoo.text.tokenizers import Tokenizer

    cfg = LLAMA.model_copy(update={"vocab_size": 300, "max_seq_len": 64})
    model = zoo.Model(cfg, seed=3)
    folder = tmp_path / "m"
    model.save_pretrained(folder, tokenizer=Tokenizer.byte_level())
    texts = ["Once upon", "a time there was", "x", "The keeper of the lighthouse said"]
    (tmp_path / "p.txt").write_text("\n".join(texts[:2]) + "\n\n" + "\n".join(texts[2:]) + "\n")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": t, "id": k}) + "\n" for k, t in enumerate(texts)))
    tok = Tokenizer.from_pretrained(folder)
    loaded = zoo.Model.from_pretrained(folder)
    want = []
    for t in texts:
        new = generate(loaded, prompt_tokens(tok, t), 6, stop_ids=tok.eos_ids)
        want.append({"prompt": t, "completion": tok.decode([i for i in new if i not in tok.eos_ids]),
                     "new_tokens": len(new)})
    for name in ("p.txt", "p.jsonl"):
        rc = main(["generate", "--from", str(folder), "--prompts", str(tmp_path / name), "--temperature", "0",
                   "--max-new-tokens", "6", "--batch-size", "3", "--threads", "1"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        got = [json.loads(line) for line in out.splitlines()]
        for p, w, g in zip(texts, want, got):
            if w != g:  # a near tie may part them (a row's sums beside others' round differently)
                assert w["prompt"] == g["prompt"] and w["completion"][:1] == g["completion"][:1], (w, g)
        assert [g["prompt"] for g in got] == texts
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    assert main(["generate", "--from", str(folder), "--prompts", str(tmp_path / "bad.jsonl")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'bad.jsonl'}" in err and 'line 2: expected an object with a "prompt" string' in err
    (tmp_path / "empty.txt").write_text("\n\n")
    assert main(["generate", "--from", str(folder), "--prompts", str(tmp_path / "empty.txt")]) == 1
    assert "no prompts in this file" in capsys.readouterr().err
    assert main(["generate", "--from", str(folder), "--prompts", str(tmp_path / "p.txt"), "--batch-size", "0"]) == 1
    assert "--batch-size: must be >= 1, got 0" in capsys.readouterr().err


# --- GGUF files zoo writes, in llama.cpp itself (where llama-cpp-python is installed) -------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "q8_0", "q4_0"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_llama_cpp_runs_the_gguf_zoo_writes(tmp_path, family, dtype):
    """llama.cpp loads every type zoo writes, with and without a tokenizer (a file without one
    says so, and llama.cpp runs its token ids), and computes the logits zoo computes from the
    weights the type stores (zoo reads the file back for those)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import warnings

    from zoo.io.gguf import save_gguf
    from zoo.text.tokenizers import Tokenizer

    cfg = (LLAMA if family == "llama" else GPT2).model_copy(update={"vocab_size": 320})
    model = zoo.Model(cfg, seed=5)
    tokens = [1, 17, 42, 99, 7, 250, 3]
    for tokenizer in (None, Tokenizer.byte_level()):
        path = tmp_path / f"m-{tokenizer is not None}.gguf"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            save_gguf(model, path, dtype=dtype, tokenizer=tokenizer)
        said = [str(w.message) for w in caught if "no tokenizer" in str(w.message)]
        assert len(said) == (tokenizer is None), said
        stored = zoo.Model.from_pretrained(path)  # the weights as the file stores them, in float32
        want = stored.logits(np.asarray([tokens]))[0]
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False,
                              type_k=0, type_v=0)  # a float32 KV cache (llama.cpp's default is float16)
        llm.eval(tokens)
        got = np.asarray(llm.scores[:len(tokens)])
        # llama.cpp's own arithmetic: its F16/BF16/Q8_0/Q4_0 products round the activations too.
        bound = (1e-4 if dtype == "float32" else 3e-2) * np.abs(want).max()
        assert np.abs(got - want).max() < bound, (tokenizer, np.abs(got - want).max(), bound)
        if tokenizer is not None:
            assert llm.tokenize(b"Hi", add_bos=False, special=False) == Tokenizer.byte_level().encode("Hi")


def test_the_decode_product_benchmark_runs(capsys):
    """`python -m zoo.tools.bench_gemv` on a small matrix: a line per format and rows of x."""
    from zoo.tools import bench_gemv

    bench_gemv.main(["--rows", "64", "--cols", "96", "--format", "int8", "nf4", "--rows-of-x", "1", "3", "--repeats", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"W 64 x 96, {ISAS[-1]}, one thread, best of 3")
    assert [ln.split(":")[0] for ln in lines[1:]] == ["int8  M=1", "int8  M=3", "nf4   M=1", "nf4   M=3"]
    assert all("G values/s" in ln and "G multiply-adds/s" in ln for ln in lines[1:])
