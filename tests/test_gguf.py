"""GGUF in and out (zoo/gguf_*.py): tiny models written by llama.cpp's own `gguf` writer in every
tensor type zoo reads load with the logits of their dequantized weights; zoo -> GGUF -> zoo round
trips; llama.cpp's q/k permutation and Llama 3 rope_freqs checked against transformers on the
same weights; tokenizers from GGUF metadata encode as the originals; bad files give one clear
error naming the file and the tensor or key.

The GGUF files here are written as llama.cpp's converter (convert_hf_to_gguf.py) writes them,
with names, the permutation and the rope factors spelled out in this file, independently of
zoo's own code for them."""

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

import helpers
import zoo
from helpers import LLAMA2_TOKENIZER, installed, needs, shared
from zoo.cli import main
from zoo.core.errors import CheckpointError
from zoo.text.tokenizers import Tokenizer
from zoo.arch.layout import parameter_shapes

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

SAMPLE = ("Hello   world!! It's 12345 or 3.14159, isn't it?\n\n\tTabs\t\there  \n"
          "Grüße aus Köln — Ünïcödé; 日本語のテキスト; русский текст; العربية; हिन्दी; 한국어\n"
          "emoji 🙂🚀👍🏽 and 🇫🇷 flags   trailing   ")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Rows of 256 values, so that every tensor divides into K-quant super-blocks (QK_K = 256).
LLAMA = zoo.ModelConfig(vocab_size=64, max_seq_len=32, d_model=256, n_layer=1, n_head=4, n_kv_head=2, d_ff=256,
                        norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", positions="rope", rope_theta=10000.0,
                        attention_bias=False, mlp_bias=False, tied_embeddings=False)
GPT2 = zoo.ModelConfig(vocab_size=64, max_seq_len=32, d_model=256, n_layer=1, n_head=4, d_ff=256, norm_eps=1e-5,
                       tied_embeddings=True)
TOKENS = np.random.default_rng(0).integers(0, 64, (2, 12))

# GGUF name -> Hugging Face name, per architecture ({i}: the layer), as llama.cpp's converter maps them.
LLAMA_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
LLAMA_LAYER = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
               "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
               "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
               "ffn_down.weight": "mlp.down_proj.weight"}
GPT2_NAMES = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
              "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias"}
GPT2_LAYER = {"attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias", "attn_qkv.weight": "attn.c_attn.weight",
              "attn_qkv.bias": "attn.c_attn.bias", "attn_output.weight": "attn.c_proj.weight",
              "attn_output.bias": "attn.c_proj.bias", "ffn_norm.weight": "ln_2.weight", "ffn_norm.bias": "ln_2.bias",
              "ffn_up.weight": "mlp.c_fc.weight", "ffn_up.bias": "mlp.c_fc.bias", "ffn_down.weight": "mlp.c_proj.weight",
              "ffn_down.bias": "mlp.c_proj.bias"}


def hf_name(arch: str, gguf_name: str) -> str:
    names, layer, prefix = ((LLAMA_NAMES, LLAMA_LAYER, "model.layers") if arch == "llama"
                            else (GPT2_NAMES, GPT2_LAYER, "transformer.h"))
    if gguf_name in names:
        return names[gguf_name]
    _, i, rest = gguf_name.split(".", 2)
    return f"{prefix}.{i}.{layer[rest]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: Hugging Face rows -> llama.cpp's rope layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def arch_keys(arch: str, cfg: zoo.ModelConfig, n_vocab_key: bool = False) -> dict:
    """The architecture keys llama.cpp's converter writes (key -> (value, GGUFValueType))."""
    T = gguf.GGUFValueType
    keys = {f"{arch}.context_length": (cfg.max_seq_len, T.UINT32), f"{arch}.embedding_length": (cfg.d_model, T.UINT32),
            f"{arch}.block_count": (cfg.n_layer, T.UINT32), f"{arch}.feed_forward_length": (cfg.d_ff, T.UINT32),
            f"{arch}.attention.head_count": (cfg.n_head, T.UINT32)}
    if arch == "gpt2":
        keys[f"{arch}.attention.layer_norm_epsilon"] = (cfg.norm_eps, T.FLOAT32)
    else:
        keys.update({f"{arch}.attention.head_count_kv": (cfg.n_kv_head, T.UINT32),
                     f"{arch}.attention.layer_norm_rms_epsilon": (cfg.norm_eps, T.FLOAT32),
                     f"{arch}.rope.freq_base": (cfg.rope_theta, T.FLOAT32),
                     f"{arch}.rope.dimension_count": (cfg.head_dim, T.UINT32)})
        if cfg.head_dim * cfg.n_head != cfg.d_model:
            keys[f"{arch}.attention.key_length"] = (cfg.head_dim, T.UINT32)
            keys[f"{arch}.attention.value_length"] = (cfg.head_dim, T.UINT32)
    return keys


def write_gguf(path: Path, arch: str, keys: dict, tensors: list[tuple[str, np.ndarray, object]]) -> Path:
    """A GGUF file by gguf's writer: tensors as (name, data, GGML type); data is float32 (converted
    here) or, for a quantized type, the uint8 blocks."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, kind) in keys.items():
        sub = gguf.GGUFValueType.get_type(value[0]) if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, kind, sub_type=sub)
    for name, data, qtype in tensors:
        if qtype == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float16))
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- tensors in every type --------------------------------------------------------------------

# The float16 scale fields (byte offsets in a block) of the K-quants, which gguf-py cannot quantize
# to: random blocks with these set get weights of a sane size.
K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def stored(values: np.ndarray, qtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, the float32 weights it dequantizes to) for a matrix in `qtype`:
    gguf-py's own quantizer where it has one, else random blocks with scales of a sane size."""
    if qtype in (Q.F32, Q.F16):
        data = values.astype(np.float16 if qtype == Q.F16 else np.float32)
        return data, data.astype(np.float32)
    if qtype in K_SCALES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (values.size // block, size), dtype=np.uint8)
        for scale in (1.0, None):  # dequantize at scale 1, then rescale so weights have std 0.05
            if scale is None:
                scale = 0.05 / float(np.std(gguf.quants.dequantize(blocks.reshape(values.shape[0], -1), qtype)))
            for at in K_SCALES[qtype]:
                blocks[:, at:at + 2] = np.full((len(blocks), 1), scale, np.float16).view(np.uint8)
        data = blocks.reshape(values.shape[0], -1)
    else:
        data = gguf.quants.quantize(values, qtype)
    return data, gguf.quants.dequantize(data, qtype).astype(np.float32)


def random_gguf(path: Path, arch: str, cfg: zoo.ModelConfig, qtype, seed: int = 0) -> dict[str, np.ndarray]:
    """A GGUF model with random weights, its matrices in qtype (1-D tensors in F32, as llama.cpp
    keeps them); returns the dequantized weights under their Hugging Face names and order."""
    rng = np.random.default_rng(seed)
    shapes = parameter_shapes(cfg)
    tensors, weights = [], {}
    gguf_names = list(LLAMA_NAMES if arch == "llama" else GPT2_NAMES)
    gguf_names += [f"blk.{i}.{n}" for i in range(cfg.n_layer) for n in (LLAMA_LAYER if arch == "llama" else GPT2_LAYER)]
    for name in gguf_names:
        hf = hf_name(arch, name)
        if hf not in shapes:
            continue  # e.g. output.weight of a tied model
        shape = shapes[hf]
        if len(shape) == 1:
            values = (1.0 if name.endswith("norm.weight") else 0.0) + 0.1 * rng.standard_normal(shape)
            data, deq = values.astype(np.float32), values.astype(np.float32)
            tensors.append((name, data, Q.F32))
        else:
            values = 0.05 * rng.standard_normal(shape).astype(np.float32)
            data, deq = stored(values, qtype, rng)
            tensors.append((name, data, qtype))
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            deq = llama_cpp_unpermute(deq, cfg.n_head if "attn_q" in name else cfg.n_kv_head)
        weights[hf] = deq
    write_gguf(path, arch, arch_keys(arch, cfg), tensors)
    return weights


def zoo_model(cfg: zoo.ModelConfig, weights: dict[str, np.ndarray]) -> zoo.Model:
    model = zoo.Model(cfg, seed=None)
    params = model.parameters()
    assert set(params) == set(weights)
    for name, w in weights.items():
        params[name][...] = w
    return model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_loads_with_the_logits_of_its_dequantized_weights(tmp_path, arch, qtype):
    cfg = LLAMA if arch == "llama" else GPT2
    weights = random_gguf(tmp_path / "m.gguf", arch, cfg, qtype)
    expected = zoo_model(cfg, weights).logits(TOKENS)
    loaded = zoo.Model.from_pretrained(tmp_path / "m.gguf")
    assert loaded.config == cfg
    got = loaded.logits(TOKENS)
    assert np.abs(expected).max() > 0.1  # the weights matter
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def test_the_file_really_holds_the_type(tmp_path):
    """The check above is not vacuous: the reader sees the quantized type, and a K-quant's
    dequantized weights differ from any float16 rounding of them."""
    random_gguf(tmp_path / "m.gguf", "llama", LLAMA, Q.Q4_K)
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == Q.Q4_K and types["blk.0.attn_norm.weight"] == Q.F32


# --- zoo -> GGUF -> zoo ---------------------------------------------------------------------------


def q8_0_bound(w: np.ndarray) -> np.ndarray:
    """Q8_0's largest error per weight: a block of 32 stores round(w / d) with d = absmax / 127 (d
    itself in float16), so each weight is off by at most d / 2 plus the float16 rounding of d times
    127 (under 2^-11 relative)."""
    blocks = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True)
    d = blocks / 127
    return np.broadcast_to(d / 2 + blocks * 2.0 ** -11, (w.size // 32, 32)).reshape(w.shape) * (1 + 1e-6)


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_round_trip_float32_is_exact_and_q8_0_within_its_error(tmp_path, cfg):
    model = zoo.Model(cfg, seed=3)
    ref = model.logits(TOKENS)
    path = tmp_path / "f32.gguf"
    from zoo.io.gguf import save_gguf

    save_gguf(model, path, dtype="float32")
    back = zoo.Model.from_pretrained(path)
    assert back.config == cfg
    np.testing.assert_array_equal(back.logits(TOKENS), ref)
    for name, w in model.parameters().items():
        np.testing.assert_array_equal(back.parameters()[name], w)

    save_gguf(model, tmp_path / "q8.gguf", dtype="q8_0")
    q8 = zoo.Model.from_pretrained(tmp_path / "q8.gguf")
    for name, w in model.parameters().items():
        got = q8.parameters()[name]
        if w.ndim == 1 or name == "transformer.wpe.weight":  # kept in F32
            np.testing.assert_array_equal(got, w)
        else:
            assert np.all(np.abs(got - w) <= q8_0_bound(w)), name
            assert not np.array_equal(got, w)  # really quantized
    # The logits move by the weights' error: measured 1.1% (llama) and 0.4% (gpt2) of the largest logit.
    diff = np.abs(q8.logits(TOKENS) - ref).max()
    assert 0 < diff < 0.025 * np.abs(ref).max(), diff


def test_round_trip_of_llama_variants(tmp_path):
    """Tied head (no output.weight), biases, a head size other than d_model / n_head
    (attention.key_length) and Llama 3 scaling (rope_freqs.weight) come back."""
    cfg = zoo.ModelConfig(vocab_size=64, max_seq_len=32, d_model=64, n_layer=2, n_head=4, n_kv_head=1, head_dim=32,
                          d_ff=96, norm="rmsnorm", mlp="swiglu", positions="rope", rope_theta=500000.0,
                          rope_scaling=zoo.RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=8192),
                          attention_bias=True, mlp_bias=True, tied_embeddings=True)
    model = zoo.Model(cfg, seed=5)
    from zoo.io.gguf import save_gguf
    from zoo.core.rope import rope_inv_freq

    save_gguf(model, tmp_path / "m.gguf")
    names = {t.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert "output.weight" not in names and {"rope_freqs.weight", "blk.0.attn_q.bias", "blk.1.ffn_gate.bias"} <= names
    back = zoo.Model.from_pretrained(tmp_path / "m.gguf")
    assert back.config.model_copy(update={"rope_scaling": cfg.rope_scaling}) == cfg
    # One frequency of 16 lies in the blended band here: the scaling's parameters are not all
    # determined by the divisors, those chosen give the same frequencies.
    np.testing.assert_allclose(rope_inv_freq(back.config), rope_inv_freq(cfg), rtol=1e-6)
    np.testing.assert_allclose(back.logits(TOKENS), model.logits(TOKENS), rtol=0, atol=1e-5)


def test_export_types_and_metadata_as_gguf_reads_them(tmp_path):
    from zoo.io.gguf import save_gguf

    model = zoo.Model(GPT2.model_copy(update={"vocab_size": 320}), seed=0)  # room for the byte-level ids
    save_gguf(model, tmp_path / "m.gguf", dtype="bfloat16", tokenizer=Tokenizer.byte_level())
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.attn_qkv.weight"] == Q.BF16
    assert types["blk.0.attn_qkv.bias"] == Q.F32 and types["output_norm.weight"] == Q.F32
    assert types["position_embd.weight"] == Q.F32  # llama.cpp keeps positions in F32
    assert types["output.weight"] == Q.BF16  # GPT-2's tied head written out, as llama.cpp's converter does
    fields = {k: r.fields[k].contents() for k in r.fields}
    assert fields["general.architecture"] == "gpt2" and fields["general.file_type"] == 32
    assert fields["gpt2.context_length"] == 32 and fields["gpt2.embedding_length"] == 256
    assert fields["gpt2.block_count"] == 1 and fields["gpt2.attention.head_count"] == 4
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.tokens"]) == 320
    assert fields["tokenizer.ggml.eos_token_id"] == 256 and fields["tokenizer.ggml.bos_token_id"] == 257
    # Written atomically: no temporary file left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


# --- the q/k permutation and Llama 3 rope_freqs, against transformers --------------------------------

# The tests against transformers skip one by one without it; the rest need gguf alone.
hf = needs("torch", "transformers")
if installed("torch") and installed("transformers"):
    import torch
    import transformers


def hf_llama(hidden: int, heads: int, kv_heads: int, rope_parameters=None, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=64, rope_parameters=rope_parameters, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def llama_cpp_rope_factors(params: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Llama 3 rope_freqs.weight (with the config's own rope parameters)."""
    base, factor = params["rope_theta"], params["factor"]
    low, high, old = params["low_freq_factor"], params["high_freq_factor"], params["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def hf_to_gguf(model, path: Path, permute: bool = True) -> Path:
    """What convert_hf_to_gguf.py writes for a LlamaForCausalLM, in F32."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    cfg = zoo.ModelConfig(vocab_size=c.vocab_size, max_seq_len=c.max_position_embeddings, d_model=c.hidden_size,
                          n_layer=c.num_hidden_layers, n_head=c.num_attention_heads, n_kv_head=c.num_key_value_heads,
                          d_ff=c.intermediate_size, norm="rmsnorm", norm_eps=c.rms_norm_eps, mlp="swiglu",
                          positions="rope", rope_theta=c.rope_parameters["rope_theta"])
    reverse = {hf_name("llama", n): n for n in LLAMA_NAMES}
    reverse.update({f"model.layers.{i}.{hf}": f"blk.{i}.{g}" for i in range(c.num_hidden_layers)
                    for g, hf in LLAMA_LAYER.items()})
    tensors = []
    for name, value in model.state_dict().items():
        w = value.float().numpy()
        if permute and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, c.num_attention_heads)
        if permute and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, c.num_key_value_heads)
        tensors.append((reverse[name], w, Q.F32))
    if c.rope_parameters.get("rope_type") == "llama3":
        tensors.append(("rope_freqs.weight", llama_cpp_rope_factors(c.rope_parameters, head_dim), Q.F32))
    return write_gguf(path, "llama", arch_keys("llama", cfg), tensors)


LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
PERMUTATION_CASES = {
    "gqa": dict(hidden=32, heads=4, kv_heads=2),
    "mha-theta": dict(hidden=32, heads=4, kv_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # Llama 3.1's real scaling at head_dim 64: several frequencies in the blended band.
    "llama3.1-rope-head64": dict(hidden=128, heads=2, kv_heads=1, rope_parameters=dict(LLAMA31_ROPE)),
    # head_dim 8 with a short original context: one frequency blended, none left unscaled.
    "llama3-rope-head8": dict(hidden=32, heads=4, kv_heads=2, rope_parameters={**LLAMA31_ROPE,
                                                                               "original_max_position_embeddings": 16}),
}


@hf
@pytest.mark.parametrize("case", PERMUTATION_CASES)
def test_qk_permutation_and_rope_match_transformers(tmp_path, case):
    model = hf_llama(**PERMUTATION_CASES[case])
    hf_to_gguf(model, tmp_path / "m.gguf")
    tok = np.random.default_rng(1).integers(0, 97, (2, 24))
    with torch.no_grad():
        expected = model(torch.from_numpy(tok)).logits.numpy()
    loaded = zoo.Model.from_pretrained(tmp_path / "m.gguf")
    np.testing.assert_allclose(loaded.logits(tok), expected, rtol=0, atol=1e-4)
    params = model.config.rope_parameters
    if params.get("rope_type") == "llama3":  # the scaling recovered from the factors computes the same frequencies
        from zoo.core.rope import rope_inv_freq

        hf_inv = model.model.rotary_emb.inv_freq.numpy()
        np.testing.assert_allclose(rope_inv_freq(loaded.config), hf_inv, rtol=1e-6)
        if case == "llama3.1-rope-head64":
            s = loaded.config.rope_scaling
            assert (s.factor, s.original_max_position_embeddings) == (8.0, 8192)
            assert s.low_freq_factor == pytest.approx(1.0, rel=1e-4) and s.high_freq_factor == pytest.approx(4.0, rel=1e-4)


@hf
def test_without_the_permutation_the_logits_differ(tmp_path):
    """The check above can fail: the same weights written without llama.cpp's permutation give
    other logits once loaded."""
    model = hf_llama(hidden=32, heads=4, kv_heads=2)
    hf_to_gguf(model, tmp_path / "m.gguf", permute=False)
    tok = np.random.default_rng(1).integers(0, 97, (2, 24))
    with torch.no_grad():
        expected = model(torch.from_numpy(tok)).logits.numpy()
    assert np.abs(zoo.Model.from_pretrained(tmp_path / "m.gguf").logits(tok) - expected).max() > 1e-2


@hf
def test_gpt2_as_llama_cpp_converts_it_matches_transformers(tmp_path):
    """GPT-2's Conv1D weights transposed and the tied head written out, as convert_hf_to_gguf.py does."""
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    zcfg = zoo.ModelConfig(vocab_size=97, max_seq_len=32, d_model=32, n_layer=2, n_head=4, norm_eps=1e-5)
    reverse = {hf_name("gpt2", n): n for n in GPT2_NAMES}
    reverse.update({f"transformer.h.{i}.{hf}": f"blk.{i}.{g}" for i in range(2) for g, hf in GPT2_LAYER.items()})
    tensors = []
    for name, value in model.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue
        w = value.numpy()
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            w = w.T
        tensors.append((reverse[name], w, Q.F32))
        if name == "transformer.wte.weight":
            tensors.append(("output.weight", w, Q.F32))
    write_gguf(tmp_path / "g.gguf", "gpt2", arch_keys("gpt2", zcfg), tensors)
    tok = np.random.default_rng(2).integers(0, 97, (2, 16))
    with torch.no_grad():
        expected = model(torch.from_numpy(tok)).logits.numpy()
    loaded = zoo.Model.from_pretrained(tmp_path / "g.gguf")
    assert loaded.config.tied_embeddings
    np.testing.assert_allclose(loaded.logits(tok), expected, rtol=0, atol=1e-4)


# --- tokenizers ----------------------------------------------------------------------------------


def spm_vocab_keys(model_file: Path) -> dict:
    """tokenizer.ggml.* as convert_hf_to_gguf.py's _create_vocab_sentencepiece writes them."""
    import sentencepiece as spm

    T = gguf.GGUFValueType
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                     else 6 if sp.is_byte(i) else 1)
    return {"tokenizer.ggml.model": ("llama", T.STRING), "tokenizer.ggml.tokens": (tokens, T.ARRAY),
            "tokenizer.ggml.scores": (scores, T.ARRAY), "tokenizer.ggml.token_type": (types, T.ARRAY),
            "tokenizer.ggml.bos_token_id": (1, T.UINT32), "tokenizer.ggml.eos_token_id": (2, T.UINT32),
            "tokenizer.ggml.unknown_token_id": (0, T.UINT32), "tokenizer.ggml.add_bos_token": (True, T.BOOL),
            "tokenizer.ggml.add_eos_token": (False, T.BOOL),
            "tokenizer.chat_template": ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
                                        T.STRING)}


def tiny_llama_with_vocab(path: Path, vocab: int, tokenizer_keys: dict) -> Path:
    cfg = LLAMA.model_copy(update={"vocab_size": vocab, "d_model": 32, "d_ff": 64, "n_head": 2, "n_kv_head": 1,
                                   "head_dim": 16})
    model = zoo.Model(cfg, seed=0)
    from zoo.io.gguf import save_gguf

    save_gguf(model, path, dtype="float16")  # a zoo export without a tokenizer, then the test's own keys added
    r = gguf.GGUFReader(path)
    keys = {f.name: (f.contents(), f.types[0]) for f in r.fields.values() if not f.name.startswith("GGUF.")}
    keys.pop("general.architecture")
    tensors = [(t.name, np.array(t.data), t.tensor_type) for t in r.tensors]
    return write_gguf(path, "llama", {**keys, **tokenizer_keys}, tensors)


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    shared(LLAMA2_TOKENIZER)
    return tiny_llama_with_vocab(tmp_path_factory.mktemp("spm") / "m.gguf", 32000, spm_vocab_keys(LLAMA2_TOKENIZER))


def test_sentencepiece_vocabulary_encodes_as_the_original(spm_gguf, tmp_path):
    original = Tokenizer.from_pretrained(LLAMA2_TOKENIZER)
    assert main(["convert", str(spm_gguf), str(tmp_path / "out")]) == 0
    tok = Tokenizer.from_pretrained(tmp_path / "out")
    assert tok.kind == "sentencepiece"
    for text in (SAMPLE, " leading space", "<s>special</s> text", "\x00\x01 bytes \u2028", ""):
        assert tok.encode(text) == original.encode(text), text
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == original.decode(ids)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>" and config["unk_token"] == "<unk>"
    assert config["add_bos_token"] is True and config["chat_template"].startswith("{% for m in messages %}")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["vocab_size"]) == (1, 2, 32000)


def test_sentencepiece_tokenizer_exports_as_llama_cpp_converts_it(spm_gguf, tmp_path):
    """zoo's export writes the same tokenizer keys as llama.cpp's converter, from tokenizer.model."""
    folder = tmp_path / "hf"
    zoo.Model.from_pretrained(spm_gguf).save_pretrained(folder)
    assert main(["convert", str(folder), str(tmp_path / "again.gguf")]) == 0
    r = gguf.GGUFReader(tmp_path / "again.gguf")
    expected = spm_vocab_keys(LLAMA2_TOKENIZER)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert r.fields[key].contents() == expected[key][0], key
    np.testing.assert_allclose(r.fields["tokenizer.ggml.scores"].contents(), expected["tokenizer.ggml.scores"][0])
    assert r.fields["tokenizer.ggml.add_space_prefix"].contents() is True


def bpe_tokenizer(pre: str):
    """A byte-level BPE trained here with `tokenizers`, with llama.cpp's pre-tokenizer `pre`."""
    import tokenizers
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "llama-bpe")
    tok.pre_tokenizer = {
        "gpt-2": byte_level,
        "llama-bpe": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"), byte_level]),
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
    }[pre]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([SAMPLE * 20, "To be, or not to be, that is the question 1234567.\n" * 50], trainer)
    return tok


def bpe_vocab_keys(tok, pre: str) -> dict:
    """tokenizer.ggml.* as convert_hf_to_gguf.py's get_vocab_base writes a byte-level BPE."""
    T = gguf.GGUFValueType
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    special = {e["id"] for e in data["added_tokens"] if e["special"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"tokenizer.ggml.model": ("gpt2", T.STRING), "tokenizer.ggml.pre": (pre, T.STRING),
            "tokenizer.ggml.tokens": (tokens, T.ARRAY),
            "tokenizer.ggml.token_type": ([3 if i in special else 1 for i in range(len(tokens))], T.ARRAY),
            "tokenizer.ggml.merges": (merges, T.ARRAY), "tokenizer.ggml.eos_token_id": (0, T.UINT32),
            "tokenizer.ggml.bos_token_id": (0, T.UINT32)}


@needs("tokenizers", "transformers")
@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "smollm"])
def test_bpe_vocabulary_encodes_as_the_original(tmp_path, pre):
    tok = bpe_tokenizer(pre)
    path = tiny_llama_with_vocab(tmp_path / "m.gguf", 640, bpe_vocab_keys(tok, pre))
    assert main(["convert", str(path), str(tmp_path / "out")]) == 0
    zoo_tok = Tokenizer.from_pretrained(tmp_path / "out")
    text = SAMPLE + " <|im_start|>user 2024<|endoftext|>"
    assert zoo_tok.encode(text) == tok.encode(text).ids
    assert zoo_tok.decode(tok.encode(SAMPLE).ids) == SAMPLE
    # transformers reads the folder's tokenizer.json alike
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert auto.encode(text, add_special_tokens=False) == tok.encode(text).ids
    # and the folder goes back to GGUF with the same vocabulary, merges and pre-tokenizer name
    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "again.gguf")]) == 0
    r = gguf.GGUFReader(tmp_path / "again.gguf")
    keys = bpe_vocab_keys(tok, pre)
    assert r.fields["tokenizer.ggml.pre"].contents() == pre
    assert r.fields["tokenizer.ggml.merges"].contents() == keys["tokenizer.ggml.merges"][0]
    n = len(keys["tokenizer.ggml.tokens"][0])
    assert r.fields["tokenizer.ggml.tokens"].contents()[:n] == keys["tokenizer.ggml.tokens"][0]
    assert r.fields["tokenizer.ggml.tokens"].contents()[n] == f"[PAD{n}]"  # padded to the model's rows


def test_zoo_byte_level_tokenizer_round_trips(tmp_path):
    from zoo.io.gguf import save_gguf

    model = zoo.Model(zoo.preset("tiny-llama"), seed=0)
    save_gguf(model, tmp_path / "m.gguf", tokenizer=Tokenizer.byte_level())
    back = zoo.Model.from_pretrained(tmp_path / "m.gguf").pretrained_tokenizer
    original = Tokenizer.byte_level()
    text = SAMPLE + "<|bos|>x<|eos|>"
    assert back.encode(text) == original.encode(text)
    assert back.decode(original.encode(text)) == text
    assert (back.bos_id, back.eos_id) == (original.bos_id, original.eos_id)


# --- the command line, and finetuning a quantized import ------------------------------------------


def test_convert_cli_and_finetune_a_q4_k_import(tmp_path, capsys):
    """zoo convert writes the folder zoo loads with the same logits; the import (float32 now)
    finetunes like any checkpoint."""
    cfg = LLAMA.model_copy(update={"vocab_size": 320})  # room for zoo's byte-level tokenizer's 258 ids
    src = tmp_path / "q4k.gguf"
    random_gguf(src, "llama", cfg, Q.Q4_K)
    folder = tmp_path / "hf"
    assert main(["convert", str(src), str(folder)]) == 0
    assert f"wrote {folder}" in capsys.readouterr().out
    loaded = zoo.Model.from_pretrained(folder)
    np.testing.assert_array_equal(loaded.logits(TOKENS), zoo.Model.from_pretrained(src).logits(TOKENS))
    Tokenizer.byte_level().save(folder)  # the random GGUF carries no vocabulary
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 100)
    run = tmp_path / "run"
    rc = main(["finetune", "--from", str(folder), "--data", str(data), "--out", str(run), "--cache-dir",
               str(tmp_path / "cache"), "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--lr", "1e-3",
               "--threads", "1", "--no-progress", "--sample-tokens", "0"])
    assert rc == 0, capsys.readouterr().err
    tuned = zoo.Model.from_pretrained(run)
    assert tuned.config == cfg
    moved = np.abs(tuned.parameters()["model.layers.0.mlp.up_proj.weight"]
                   - loaded.parameters()["model.layers.0.mlp.up_proj.weight"]).max()
    assert 0 < moved < 0.1


def test_generate_reads_a_gguf_as_its_converted_folder(tmp_path, capsys):
    from zoo.io.gguf import save_gguf

    save_gguf(zoo.Model(zoo.preset("tiny-llama"), seed=1), tmp_path / "m.gguf", tokenizer=Tokenizer.byte_level())
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    texts = []
    for src in ("m.gguf", "hf"):
        assert main(["generate", "--from", str(tmp_path / src), "--prompt", "Once", "--max-new-tokens", "12",
                     "--temperature", "0"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("Once") and len(texts[0]) > len("Once")
    # inspect reads it as it is; finetune starts from a folder, and says how to make one
    assert main(["inspect", str(tmp_path / "m.gguf")]) == 0
    out = capsys.readouterr().out
    assert "a GGUF file" in out and "GGUF llama" in out and "zoo can load   yes" in out
    assert main(["finetune", "--from", str(tmp_path / "m.gguf"), "--data", str(tmp_path / "hf" / "config.json"),
                 "--out", str(tmp_path / "run"), "--steps", "1"]) == 1
    assert f"zoo convert {tmp_path / 'm.gguf'} DIR" in capsys.readouterr().err


def test_convert_q8_0_needs_gguf_and_a_folder_is_no_gguf_target(tmp_path, capsys):
    folder = tmp_path / "m"
    zoo.Model(GPT2, seed=0).save_pretrained(folder)
    assert main(["convert", str(folder), str(tmp_path / "x"), "--dtype", "q8_0"]) == 1
    assert "--dtype: must be one of float32, float16, bfloat16 for a folder" in capsys.readouterr().err
    assert main(["convert", str(folder), str(tmp_path), "--to", "gguf"]) == 1
    assert "--to gguf writes one file" in capsys.readouterr().err
    assert main(["convert", str(folder), str(tmp_path / "m.q8.gguf"), "--dtype", "q8_0"]) == 0
    assert gguf.GGUFReader(tmp_path / "m.q8.gguf").fields["general.file_type"].contents() == 7


# --- bad input ---------------------------------------------------------------------------------------


def small_llama(path: Path, **changes) -> Path:
    """A valid tiny F32 llama GGUF, with keys or tensors changed: keys={...}, drop_keys=[...],
    tensors={name: (data, type)}, arch=..."""
    cfg = LLAMA.model_copy(update={"d_model": 32, "d_ff": 64, "n_head": 2, "n_kv_head": 1, "head_dim": 16})
    model = zoo.Model(cfg, seed=0)
    from zoo.io.gguf import save_gguf

    save_gguf(model, path)
    r = gguf.GGUFReader(path)
    keys = {f.name: (f.contents(), f.types[0]) for f in r.fields.values() if not f.name.startswith("GGUF.")}
    arch = changes.get("arch", keys.pop("general.architecture")[0])
    keys.pop("general.architecture", None)
    keys.update(changes.get("keys", {}))
    for k in changes.get("drop_keys", []):
        keys.pop(k)
    tensors = {t.name: (np.array(t.data), t.tensor_type) for t in r.tensors}
    tensors.update(changes.get("tensors", {}))
    return write_gguf(path, arch, keys, [(n, d, t) for n, (d, t) in tensors.items()])


def load_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        zoo.Model.from_pretrained(path)
    return str(e.value)


def test_unsupported_architecture(tmp_path):
    path = small_llama(tmp_path / "m.gguf", arch="falcon")
    msg = load_error(path)
    assert str(path) in msg and "'general.architecture'" in msg and "unsupported architecture 'falcon'" in msg


@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.I32], ids=lambda t: t.name)
def test_unsupported_tensor_type_names_the_tensor(tmp_path, qtype):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (32, 32 // block * size), dtype=np.uint8)
    path = small_llama(tmp_path / "m.gguf", tensors={"blk.0.attn_q.weight": (raw, qtype)})
    msg = load_error(path)
    assert str(path) in msg and "'blk.0.attn_q.weight'" in msg and f"tensor type {qtype.name} is not supported" in msg


def test_truncated_file_names_the_file_and_the_tensor(tmp_path):
    path = small_llama(tmp_path / "m.gguf")
    data = path.read_bytes()
    r = gguf.GGUFReader(path)
    last = max(r.tensors, key=lambda t: t.data_offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:last.data_offset + 10])
    msg = load_error(cut)
    assert str(cut) in msg and f"'{last.name}'" in msg and "truncated" in msg
    # cut anywhere in the header or the tensor table: one clear error, never a hang or an IndexError
    for at in sorted({24, 30, 100, 1000, len(data) // 3, r.data_offset - 8, r.data_offset + 1}):
        cut.write_bytes(data[:at])
        msg = load_error(cut)
        assert str(cut) in msg and ("truncated" in msg or "too short" in msg), (at, msg)


def test_array_length_past_the_end_is_refused_at_once(tmp_path):
    """gguf-py's reader would loop over a stated array length of 2^60; zoo's refuses it unread."""
    path = tmp_path / "m.gguf"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    key = b"tokenizer.ggml.scores"
    header += struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 6, 1 << 60) + b"\0" * 64
    path.write_bytes(header)
    r = helpers.python(f"import zoo; zoo.Model.from_pretrained({str(path)!r})", timeout=30)
    assert "truncated or corrupt" in r.stderr and "'tokenizer.ggml.scores'" in r.stderr, r.stderr


def test_missing_key_and_wrong_shape(tmp_path):
    path = small_llama(tmp_path / "a.gguf", drop_keys=["llama.attention.layer_norm_rms_epsilon"])
    msg = load_error(path)
    assert str(path) in msg and "'llama.attention.layer_norm_rms_epsilon'" in msg and "required" in msg
    wrong = np.zeros((32, 32), np.float32)
    path = small_llama(tmp_path / "b.gguf", tensors={"blk.0.attn_k.weight": (wrong, Q.F32)})
    msg = load_error(path)
    assert str(path) in msg and "'blk.0.attn_k.weight'" in msg and "shape [32, 32], expected [16, 32]" in msg


def test_not_a_gguf_and_extra_tensor(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 100)
    assert "not a GGUF file" in load_error(bad)
    path = small_llama(tmp_path / "m.gguf", tensors={"blk.0.ffn_gate_exps.weight": (np.zeros((4, 32), np.float32),
                                                                                    Q.F32)})
    msg = load_error(path)
    assert "'blk.0.ffn_gate_exps.weight'" in msg and "has no place" in msg


def test_bad_tokenizer_metadata_names_the_key(tmp_path):
    T = gguf.GGUFValueType
    keys = {"tokenizer.ggml.model": ("gpt2", T.STRING), "tokenizer.ggml.pre": ("gpt-2", T.STRING),
            "tokenizer.ggml.tokens": (["a", "b", "c"], T.ARRAY), "tokenizer.ggml.merges": (["a b"], T.ARRAY)}
    path = small_llama(tmp_path / "m.gguf", keys=keys)  # the merge makes "ab", which is no token
    msg = load_error(path)
    assert str(path) in msg and "'tokenizer.ggml.merges'" in msg and "'ab'" in msg and "zoo-gguf-tokenizer" not in msg
    path = small_llama(tmp_path / "p.gguf", keys={**keys, "tokenizer.ggml.pre": ("deepseek-llm", T.STRING)})
    assert "'tokenizer.ggml.pre': pre-tokenizer 'deepseek-llm' is not supported" in load_error(path)
    path = small_llama(tmp_path / "d.gguf", keys={**keys, "tokenizer.ggml.tokens": (["a", "b", "a"], T.ARRAY)})
    assert "token 'a' appears twice (ids 0 and 2)" in load_error(path)
    path = small_llama(tmp_path / "b.gguf", keys={**keys, "tokenizer.ggml.model": ("bert", T.STRING)})
    assert "'tokenizer.ggml.model': tokenizer model 'bert' is not supported" in load_error(path)


def test_cli_error_is_one_line_naming_the_file(tmp_path):
    path = small_llama(tmp_path / "m.gguf", arch="falcon")
    r = helpers.cli("convert", path, tmp_path / "out")
    helpers.assert_error(r, str(path), "general.architecture", status=1)
    assert not (tmp_path / "out").exists()
