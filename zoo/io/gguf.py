"""GGUF files <-> zoo models, for the families llama.cpp defines an architecture for
(zoo/families/: each family's gguf_arch, the metadata it reads and writes, and its q/k
permutation).

Names: each zoo parameter (Hugging Face names, layout.py) gets its GGUF name from llama.cpp's own
map (gguf.get_tensor_name_map, the one its converter uses): model.layers.N.self_attn.q_proj ->
blk.N.attn_q, transformer.h.N.attn.c_attn -> blk.N.attn_qkv, lm_head -> output, ... GGUF
matrices are stored with rows of in_features, which is zoo's (out, in) layout: nothing is
transposed, GPT-2's Conv1D weights included (llama.cpp's converter transposes those).

The q/k permutation: llama.cpp rotates pairs of adjacent values of a head (x0, x1), (x2, x3) ...,
Hugging Face (and zoo) pairs each value with the one half a head away (x0, x_{d/2}) ... So its
converter reorders the rows of q_proj and k_proj (weights and biases) within each head, taking
row i of the first half to 2i and row i of the second half to 2i + 1:
    gguf = hf.reshape(n_heads, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(hf.shape)
Reading undoes it (reshape(n_heads, head_dim // 2, 2, -1).swapaxes(1, 2)); writing applies it;
n_heads is n_head for q and n_kv_head for k.

Config: from the architecture's keys (llama.context_length, embedding_length, block_count,
feed_forward_length, attention.head_count, head_count_kv, layer_norm_rms_epsilon,
rope.freq_base, attention.key_length ...), the vocabulary size from token_embd.weight's rows,
tied embeddings where the file has no output.weight (or one equal to token_embd.weight, as
llama.cpp's GPT-2 converter writes it). Llama 3's RoPE scaling travels as the tensor
rope_freqs.weight (one divisor per frequency, as llama.cpp applies it); zoo recovers the
scaling's parameters from it and checks that they give back every divisor.
"""

from __future__ import annotations

import json
import math
import os
import stat
import warnings
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from pydantic import ValidationError

from .. import families
from ..arch.config import ModelConfig
from ..arch.layout import ParamSpec, parameter_layout
from ..core.atomic import atomic_path
from ..core.errors import CheckpointError
from ..core.files import first_field_error
from ..core.rope import RopeScaling, rope_inv_freq
from ..text.chat_template import FALLBACK_TEMPLATE, ChatTemplate
from ..text.tokenizers import TOKENIZER_FILES, Tokenizer
from .checkpoints import nonfinite_message
from .hf_config import hf_incompatibility
from .safetensors import count_nonfinite

ROPE_FREQS = "rope_freqs.weight"
# Export: what --dtype names -> the GGUF type of the 2-D weights (norms, biases, GPT-2's positions
# and rope_freqs stay F32, as llama.cpp's converter keeps them) and general.file_type.
EXPORT_TYPES = {"float32": ("F32", 0), "float16": ("F16", 1), "bfloat16": ("BF16", 32), "q8_0": ("Q8_0", 7),
                "q4_0": ("Q4_0", 2)}
# What a file without a vocabulary says in its tokenizer key: llama.cpp then loads it with
# {arch}.vocab_size placeholder tokens and runs token ids (it cannot tokenize text with it).
NO_VOCABULARY = "none"
# Which ModelConfig field each metadata key feeds (for errors), with {arch} filled in.
_KEY_OF_FIELD = {"vocab_size": "token_embd.weight", "max_seq_len": "{arch}.context_length",
                 "d_model": "{arch}.embedding_length", "n_layer": "{arch}.block_count",
                 "n_head": "{arch}.attention.head_count", "n_kv_head": "{arch}.attention.head_count_kv",
                 "head_dim": "{arch}.attention.key_length", "d_ff": "{arch}.feed_forward_length",
                 "norm_eps": "{arch}.attention.layer_norm_rms_epsilon", "rope_theta": "{arch}.rope.freq_base"}


def is_gguf(path: str | os.PathLike) -> bool:
    """A file that starts with GGUF's magic, or a path named *.gguf that is no folder (loading it
    then says why it is no GGUF file it can read: missing, a FIFO, another format)."""
    p = Path(path)
    try:
        if not stat.S_ISREG(os.stat(p).st_mode):  # a folder; a FIFO would block open()
            return not p.is_dir() and p.suffix.lower() == ".gguf"
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF" or p.suffix.lower() == ".gguf"
    except OSError:
        return p.suffix.lower() == ".gguf"


# --- names and the permutation -------------------------------------------------------------


def tensor_names(cfg: ModelConfig) -> list[tuple[ParamSpec, str]]:
    """(zoo parameter, its GGUF name) for every parameter of cfg, by llama.cpp's name map."""
    import gguf  # imported only where a GGUF file is read or written

    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == _gguf_arch(cfg))
    names = gguf.get_tensor_name_map(arch, cfg.n_layer)
    out = []
    for spec in parameter_layout(cfg):
        name = names.get_name(spec.name, try_suffixes=(".weight", ".bias"))
        if name is None:  # a layout.py name llama.cpp's map lacks: a bug here, not bad input
            raise RuntimeError(f"gguf's {_gguf_arch(cfg)} name map has no name for {spec.name}")
        out.append((spec, name))
    return out


def _gguf_arch(cfg: ModelConfig) -> str:
    """The GGUF architecture cfg's family writes; an error for a family llama.cpp has none for."""
    arch = families.get(cfg.family).gguf_arch
    if arch is None:
        raise ValueError(f"llama.cpp defines no GGUF architecture for the {cfg.family} family")
    return arch


def _rope_heads(cfg: ModelConfig, spec: ParamSpec) -> Optional[int]:
    """How many heads a tensor's rows are permuted over in GGUF (the family says: Llama's q over
    n_head, k over n_kv_head), else None."""
    return families.get(cfg.family).gguf_rope_heads(cfg, spec.name)


# The norm weights: llama.cpp stores a (1 + w) norm's (rmsnorm_1p, Gemma's) as 1 + w, which
# its kernels multiply by, where zoo and Hugging Face keep w.
_NORM_WEIGHTS = ("ln1_w", "ln2_w", "lnf_w", "q_norm_w", "k_norm_w", "post_attn_w", "post_mlp_w")


def _stored_offset(cfg: ModelConfig, spec: ParamSpec) -> float:
    return 1.0 if cfg.norm == "rmsnorm_1p" and spec.role in _NORM_WEIGHTS else 0.0


def to_gguf_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows (Hugging Face order -> GGUF order)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_gguf_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of to_gguf_rows (GGUF order -> Hugging Face order)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- GGUF -> zoo ---------------------------------------------------------------------------


def config_from_gguf(f, max_seq_len: Optional[int] = None) -> ModelConfig:
    """The ModelConfig a GGUFFile's metadata and tensor shapes describe; errors name the file and key."""
    arch = f.value("general.architecture", str, why=" (it says which model the file holds)")
    family = families.by_gguf_arch(arch)
    if family is None:
        raise CheckpointError(f.path, f"unsupported architecture {arch!r} (zoo reads {', '.join(families.gguf_archs())})",
                              key="general.architecture")

    def key(name: str, kind: type, default=...):
        return f.value(f"{arch}.{name}", kind, default, why=f" (the {arch} architecture needs it)")

    d_model, n_head = key("embedding_length", int), key("attention.head_count", int)
    embedding = f.tensor("token_embd.weight")
    vocab_size = embedding.shape[0]
    declared = key("vocab_size", int, vocab_size)
    if declared != vocab_size:
        raise CheckpointError(f.path, f"{declared}, but token_embd.weight has {vocab_size} rows",
                              key=f"{arch}.vocab_size")
    fields = dict(vocab_size=vocab_size, max_seq_len=key("context_length", int), d_model=d_model,
                  n_layer=key("block_count", int), n_head=n_head, d_ff=key("feed_forward_length", int),
                  tied_embeddings=_tied(f), **family.read_gguf(key, f))
    if fields["positions"] == "rope" and ROPE_FREQS in f.tensors:
        fields["rope_scaling"] = _llama3_scaling(f, fields["rope_theta"], fields["head_dim"])
    if max_seq_len is not None and fields["positions"] == "rope":
        fields["max_seq_len"] = max_seq_len
    elif max_seq_len is not None and max_seq_len != fields["max_seq_len"]:
        raise ValueError(f"max_seq_len: {f.path} has learned positions; its context is fixed at "
                         f"{fields['max_seq_len']}")
    try:
        return ModelConfig(**fields)
    except ValidationError as e:
        field, msg = first_field_error(e)
        raise CheckpointError(f.path, f"invalid value: {msg}",
                              key=_KEY_OF_FIELD.get(field, "general.architecture").format(arch=arch)) from None


def _tied(f) -> bool:
    """No output.weight, or one byte for byte equal to token_embd.weight (GPT-2's converter
    writes the tied head out again)."""
    if "output.weight" not in f.tensors:
        return True
    out, emb = f.tensor("output.weight"), f.tensor("token_embd.weight")
    return (out.type, out.shape) == (emb.type, emb.shape) and np.array_equal(f.raw("output.weight"),
                                                                            f.raw("token_embd.weight"))


def _inv_freq(theta: float, head_dim: int) -> np.ndarray:
    """RoPE's unscaled inverse frequencies (float64)."""
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def _llama3_scaling(f, theta: float, head_dim: int) -> Optional[RopeScaling]:
    """Llama 3 RoPE scaling from llama.cpp's rope_freqs.weight divisors d_i (freq_i / d_i is used).
    Llama 3 divides long wavelengths by `factor`, keeps short ones, and blends in between:
    1 / d = (1 - s) / factor + s with s linear in 1 / wavelength, s = 0 at low_wavelen
    (= original_max_position_embeddings / low_freq_factor) and 1 at high_wavelen. Only the two
    wavelengths matter, so original_max_position_embeddings is taken as low_wavelen rounded and
    the factors follow; the result is checked against every divisor."""
    if f.tensor(ROPE_FREQS).shape != (head_dim // 2,):
        raise CheckpointError(f.path, f"shape {list(f.tensor(ROPE_FREQS).shape)}, expected [{head_dim // 2}] "
                                      "(one divisor per rotated pair)", key=ROPE_FREQS)
    divisors = f.read(ROPE_FREQS).astype(np.float64)
    if np.all(divisors == 1.0):
        return None
    unsupported = CheckpointError(f.path, "these frequency divisors are not Llama 3 RoPE scaling, the one "
                                          "zoo computes", key=ROPE_FREQS)
    if not np.all(np.isfinite(divisors)) or divisors.min() < 1.0 - 1e-6:
        raise unsupported
    x = 1.0 / (2 * math.pi / _inv_freq(theta, head_dim))  # 1 / wavelength
    factor = float(divisors.max())
    ones = np.isclose(divisors, 1.0, rtol=1e-6, atol=0)
    full = np.isclose(divisors, factor, rtol=1e-6, atol=0)
    mid = ~ones & ~full
    s = (1.0 / divisors - 1.0 / factor) / (1.0 - 1.0 / factor)  # the blend, 0 at full, 1 at ones
    x_full = x[full].max()  # full scaling below x_low, none above x_high
    if mid.sum() >= 2:
        slope, intercept = np.polyfit(x[mid], s[mid], 1)  # s = (x - x_low) / (x_high - x_low)
        x_low = -intercept / slope
        x_high = x_low + 1.0 / slope
    elif mid.sum() == 1:
        x_low = (x_full + x[mid][0]) / 2
        x_high = x_low + (x[mid][0] - x_low) / s[mid][0]
    else:
        x_one = x[ones].min() if ones.any() else 2 * x_full
        x_low, x_high = x_full + (x_one - x_full) / 3, x_full + 2 * (x_one - x_full) / 3
    if not 0 < x_low < x_high:
        raise unsupported
    original = max(1, round(1.0 / x_low))
    try:
        scaling = RopeScaling(factor=factor, low_freq_factor=original * x_low, high_freq_factor=original * x_high,
                              original_max_position_embeddings=original)
    except ValidationError:
        raise unsupported from None
    cfg = ModelConfig(vocab_size=1, max_seq_len=1, d_model=head_dim, n_layer=1, n_head=1, positions="rope",
                      norm="rmsnorm", mlp="swiglu", rope_theta=theta, rope_scaling=scaling)
    expected = _inv_freq(theta, head_dim) / divisors
    if not np.allclose(rope_inv_freq(cfg), expected, rtol=1e-5, atol=0):
        raise unsupported
    return scaling


def check_tensors(cfg: ModelConfig, f) -> list[tuple[ParamSpec, str]]:
    """Pair every zoo parameter with a GGUF tensor of the right shape and a type zoo reads; any
    tensor left over is an error (ignoring it would change the model silently)."""
    pairs = tensor_names(cfg)
    for spec, name in pairs:
        t = f.tensor(name)
        if t.shape != spec.shape:
            raise CheckpointError(f.path, f"shape {list(t.shape)}, expected {list(spec.shape)} from the metadata",
                                  key=name)
        f.check_type(name)
    used = {name for _, name in pairs} | {ROPE_FREQS}
    if cfg.tied_embeddings:
        used.add("output.weight")  # absent, or equal to token_embd.weight
    for name in f.tensors:
        if name not in used:
            raise CheckpointError(f.path, f"tensor has no place in the {_gguf_arch(cfg)} model the metadata describes",
                                  key=name)
    return pairs


def load_gguf(path: str | os.PathLike, model_class, *, max_seq_len: Optional[int] = None, ad="manual",
              allow_nonfinite: bool = False, lora=None, base_dtype: Optional[str] = None, precision: str = "fp32",
              checkpointing: bool = False, adapter_seed: int = 0):
    """A model_class (zoo.Model) from a GGUF file: weights dequantized to float32 (or stored in
    a frozen base's format, one tensor at a time), the q/k permutation undone, the tokenizer the
    metadata carries as model.pretrained_tokenizer (save_pretrained writes it). The other
    arguments are checkpoints.load_pretrained's."""
    from ..text.gguf_tokenizer import (
        tokenizer_from_gguf,  # these two import the gguf package: only for a .gguf
    )
    from .gguf_file import GGUFFile

    with GGUFFile(path) as f:
        cfg = config_from_gguf(f, max_seq_len)
        pairs = check_tensors(cfg, f)
        tokenizer = tokenizer_from_gguf(f, cfg.vocab_size)  # all checks before the arena is allocated
        model = model_class(cfg, seed=None, ad=ad, lora=lora, base_dtype=base_dtype, precision=precision,
                            checkpointing=checkpointing)
        params = None if model.frozen else model.parameters()
        nonfinite: dict[str, int] = {}
        for spec, name in pairs:
            w = f.read(name)
            heads = _rope_heads(cfg, spec)
            w = w if heads is None else from_gguf_rows(w, heads)
            if _stored_offset(cfg, spec):
                w = w - np.float32(_stored_offset(cfg, spec))
            if params is None:
                model.set_base_tensor(spec.name, w)
                n = count_nonfinite(w)
            else:
                params[spec.name][...] = w
                n = count_nonfinite(params[spec.name])
            if n:
                nonfinite[name] = n
        if nonfinite:
            message = nonfinite_message(nonfinite, len(pairs))
            if not allow_nonfinite:
                raise CheckpointError(f.path, f"{message}; a model with them computes NaN. To load it anyway: "
                                              "--allow-nonfinite (zoo convert) or allow_nonfinite=True "
                                              "(zoo.Model.from_pretrained)")
            warnings.warn(f"{f.path}: loaded with {message} (allow_nonfinite=True)", RuntimeWarning, stacklevel=3)
    if lora is not None:
        model.init_adapters(adapter_seed)
    model.pretrained_tokenizer = tokenizer
    return model


def chat_template_from_gguf(path: str | os.PathLike):
    """The chat template a GGUF file carries (tokenizer.chat_template), with its bos/eos texts;
    zoo's fallback where it has none."""
    from ..text.gguf_tokenizer import (
        tokenizer_files,  # these two import the gguf package: only for a .gguf
    )
    from .gguf_file import GGUFFile

    with GGUFFile(path) as f:
        files = tokenizer_files(f, f.tensor("token_embd.weight").shape[0])
    config = json.loads(files["tokenizer_config.json"]) if files else {}
    bos, eos = config.get("bos_token"), config.get("eos_token")
    if config.get("chat_template") is None:
        return ChatTemplate(FALLBACK_TEMPLATE, f"zoo's fallback chat template ({path} has none)", bos, eos)
    return ChatTemplate(config["chat_template"], f"{path} tokenizer.chat_template", bos, eos)


# --- zoo -> GGUF ---------------------------------------------------------------------------


def save_gguf(model, path: str | os.PathLike, *, dtype: str = "float32", tokenizer=None,
              name: Optional[str] = None) -> Path:
    """Write `model` as one GGUF file for llama.cpp, atomically (a temporary file renamed over
    `path`). dtype: float32, float16, bfloat16, q8_0 or q4_0 for the matrices (norms, biases,
    GPT-2's positions stay F32). tokenizer: a Tokenizer or a folder holding one, written as the
    tokenizer.ggml.* keys with its tokenizer_config.json's chat template and bos/eos settings; by
    default the model's own (the GGUF or folder it was loaded from). Without one the file says
    tokenizer.ggml.model = "none" with {arch}.vocab_size, which llama.cpp loads and runs on token
    ids but cannot tokenize text with; a RuntimeWarning says so in one line. A tokenizer that
    llama.cpp would encode differently is refused (gguf_tokenizer.py says which). name:
    general.name (default: the file's stem), by which llama.cpp also sets Phi-3's token rules."""
    import gguf  # the gguf package, and the module over it: imported only when a GGUF file is written

    from ..text.gguf_tokenizer import gguf_tokenizer_metadata, tokenizer_settings

    if dtype not in EXPORT_TYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(EXPORT_TYPES)}")
    path = Path(path)
    cfg = model.config
    problem = hf_incompatibility(cfg)
    if problem is not None:
        raise CheckpointError(path, f"GGUF's {_gguf_arch(cfg)} architecture, as llama.cpp computes it, is the "
                                    f"transformers one: {problem[1]}", key=problem[0])
    folder = None
    if tokenizer is None:
        tokenizer = getattr(model, "pretrained_tokenizer", None)
        folder = getattr(model, "pretrained_path", None)
        if tokenizer is None and folder is not None and any((Path(folder) / n).exists() for n in TOKENIZER_FILES):
            tokenizer = Tokenizer.from_pretrained(folder)
    elif not isinstance(tokenizer, Tokenizer):
        folder = Path(tokenizer)
        tokenizer = Tokenizer.from_pretrained(folder)
    name = name or path.stem
    keys = _architecture_keys(cfg, name, EXPORT_TYPES[dtype][1])
    if tokenizer is not None:
        keys.update(gguf_tokenizer_metadata(tokenizer, cfg.vocab_size,
                                            tokenizer_settings(tokenizer, Path(folder) if folder else None),
                                            folder or "the tokenizer", name))
    else:
        # the gguf package: imported only where a GGUF file is written
        from gguf.constants import GGUFValueType as T

        keys["tokenizer.ggml.model"] = (NO_VOCABULARY, T.STRING)
        warnings.warn(f"{path}: no tokenizer to write (the model has none; give one with tokenizer=, or put its files "
                      "beside the checkpoint): llama.cpp will load the file and run token ids, but cannot turn text "
                      "into tokens or tokens into text with it", RuntimeWarning, stacklevel=2)
    tensors = _export_tensors(model, EXPORT_TYPES[dtype][0])
    with atomic_path(path) as tmp:
        writer = gguf.GGUFWriter(tmp, _gguf_arch(cfg))
        try:
            for key, (value, kind) in keys.items():
                sub = gguf.GGUFValueType.get_type(value[0]) if kind == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, value, kind, sub_type=sub)
            for gguf_name, shape, qtype, _ in tensors:  # the table first: shapes in numpy order
                block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
                writer.add_tensor_info(gguf_name, shape, np.dtype(np.float32), math.prod(shape) // block * block_bytes,
                                       raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for _, _, qtype, make in tensors:  # one converted tensor in memory at a time
                writer.write_tensor_data(make())
        finally:
            writer.close()
    return path


def _architecture_keys(cfg: ModelConfig, name: str, file_type: int) -> dict[str, tuple]:
    from gguf.constants import (
        GGML_QUANT_VERSION,  # the gguf package: only where a GGUF file is written
    )
    from gguf.constants import GGUFValueType as T

    arch = _gguf_arch(cfg)
    keys = {"general.name": (name, T.STRING), "general.file_type": (file_type, T.UINT32),
            "general.quantization_version": (GGML_QUANT_VERSION, T.UINT32),
            f"{arch}.context_length": (cfg.max_seq_len, T.UINT32),
            f"{arch}.embedding_length": (cfg.d_model, T.UINT32), f"{arch}.block_count": (cfg.n_layer, T.UINT32),
            f"{arch}.feed_forward_length": (cfg.d_ff, T.UINT32), f"{arch}.attention.head_count": (cfg.n_head, T.UINT32)}
    for key, (value, kind) in families.get(cfg.family).write_gguf(cfg).items():
        keys[f"{arch}.{key}"] = (value, T[kind])
    return keys


def _export_tensors(model, matrix_type: str) -> list[tuple[str, tuple[int, ...], object, Callable[[], np.ndarray]]]:
    """(GGUF name, shape, GGML type, a function making its stored bytes) for every tensor written:
    matrices in matrix_type (F16 where a row does not divide into Q8_0's or Q4_0's blocks of 32, as
    llama.cpp's converter falls back), 1-D tensors and positions in F32; llama's q/k rows permuted."""
    import gguf  # only where a GGUF file is written
    from gguf.constants import GGMLQuantizationType as Q

    cfg = model.config
    if getattr(model, "lora", None) is not None:
        raise ValueError("this model has LoRA adapters over a frozen base: merge them first (zoo merge), "
                         "then convert the merged checkpoint")
    params = None if model.frozen else model.parameters()
    out = []
    for spec, gguf_name in tensor_names(cfg):
        qtype = Q[matrix_type]
        if len(spec.shape) == 1 or gguf_name == "position_embd.weight":
            qtype = Q.F32
        elif spec.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = Q.F16
        heads = _rope_heads(cfg, spec)

        def make(name=spec.name, heads=heads, qtype=qtype, offset=_stored_offset(cfg, spec)) -> np.ndarray:
            value = params[name] if params is not None else model.base_tensor(name)  # a frozen base: widened now
            w = value if heads is None else to_gguf_rows(value, heads)
            w = w + np.float32(offset) if offset else w
            return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype) \
                if qtype != Q.F32 else np.ascontiguousarray(w, dtype=np.float32)

        out.append((gguf_name, spec.shape, qtype, make))
    if families.get(cfg.family).gguf_writes_tied_head and cfg.tied_embeddings:  # as llama.cpp's converter does
        out.append(("output.weight",) + out[0][1:])
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3":  # (linear: a key, the family's)
        divisors = (_inv_freq(cfg.rope_theta, cfg.head_dim) / rope_inv_freq(cfg).astype(np.float64)).astype(np.float32)
        out.append((ROPE_FREQS, divisors.shape, Q.F32, lambda: divisors))
    return out
