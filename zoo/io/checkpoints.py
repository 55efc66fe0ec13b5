"""Hugging Face checkpoint folders in and out: config.json + safetensors weights (+ tokenizer).

Names: zoo's parameter names are the Hugging Face ones (layout.py, from the config's family).
A checkpoint of the bare model may drop the family's base prefix (`transformer.` of GPT2Model
and OpenAI's upload, `model.` of LlamaModel). Weights a family stores (in, out), as GPT-2's
Conv1D, are transposed. The buffers a family's checkpoints may carry (GPT-2's causal mask,
Llama's rotary inv_freq) are not parameters and are skipped; any other tensor zoo has no
place for is an error, since ignoring it would silently change the model.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from .. import families
from ..arch.config import ModelConfig
from ..arch.layout import ParamSpec, parameter_layout
from ..core.atomic import copy_file, write_bytes, write_json
from ..core.errors import CheckpointError
from ..core.files import parse_model, read_json, regular_file
from ..text.tokenizers import TOKENIZER_FILES, IdsConfig, Tokenizer, has_tokenizer
from .hf_config import (
    CONFIG_FILE,
    config_to_hf,
    config_to_zoo,
    hf_incompatibility,
    read_config,
    read_config_json,
)
from .safetensors import (
    DEFAULT_MAX_SHARD_BYTES,
    DTYPE_NAMES,
    FLOAT_DTYPES,
    CheckpointReader,
    count_nonfinite,
    write_checkpoint,
)

# transformers' generation settings (bos/eos ids, sampling defaults): the model's, carried from
# the folder it was loaded from unchanged, or written from the tokenizer's ids.
GENERATION_FILE = "generation_config.json"


def is_buffer(cfg: ModelConfig, name: str) -> bool:
    """Tensors some checkpoints store that are not parameters (recomputed by every runtime)."""
    return name.endswith(families.get(cfg.family).names.buffers)


@dataclass(frozen=True)
class TensorMatch:
    spec: ParamSpec  # zoo's parameter
    stored: str  # its name in the checkpoint


def match_tensors(cfg: ModelConfig, reader: CheckpointReader) -> list[TensorMatch]:
    """Pair every zoo parameter with a checkpoint tensor of the right shape; errors name the file
    and tensor for a missing tensor, a wrong shape or a tensor zoo has no place for."""
    prefix = families.get(cfg.family).names.base_prefix
    matches = []
    for spec in parameter_layout(cfg):
        stored = spec.name
        if stored not in reader and stored.startswith(prefix) and stored[len(prefix):] in reader:
            stored = stored[len(prefix):]
        if stored not in reader:
            raise CheckpointError(reader.source, "tensor missing from the checkpoint", key=spec.name)
        info = reader.info(stored)
        expected = tuple(reversed(spec.shape)) if spec.hf_transposed else spec.shape
        if info.shape != expected:
            raise CheckpointError(reader.file_of(stored).path,
                                  f"shape {list(info.shape)}, expected {list(expected)} from {CONFIG_FILE}", key=stored)
        matches.append(TensorMatch(spec, stored))
    used = {m.stored for m in matches}
    head = families.get(cfg.family).names.head + ".weight"
    for name in reader.names:
        if name in used or is_buffer(cfg, name) or (name == head and cfg.tied_embeddings):
            continue  # a tied head stored anyway is the embedding again
        raise CheckpointError(reader.file_of(name).path,
                              f"tensor has no place in the model {CONFIG_FILE} describes", key=name)
    return matches


def check_tensors(cfg: ModelConfig, reader: CheckpointReader) -> list[TensorMatch]:
    """Every check loading makes before it reads a weight, past those of the headers, byte ranges
    and index (made when `reader` opened them): names, shapes and dtypes. `zoo inspect`'s verdict
    runs this same function, so it cannot say "can load" of a checkpoint that loading refuses."""
    matches = match_tensors(cfg, reader)
    for m in matches:
        info = reader.info(m.stored)
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(reader.file_of(m.stored).path, f"dtype {info.dtype} is not a floating-point weight "
                                                                 f"(supported: {', '.join(FLOAT_DTYPES)})", key=m.stored)
    return matches


# Tensors named in a non-finite weights message; the rest are counted.
_NONFINITE_SHOWN = 5


def nonfinite_message(counts: dict[str, int], n_tensors: int) -> str:
    """How many NaN/Inf values, in how many of n_tensors tensors, the first few with their counts.
    counts: stored tensor name -> its non-finite values, only tensors that have some."""
    shown = ", ".join(f"{name!r} ({n:,})" for name, n in list(counts.items())[:_NONFINITE_SHOWN])
    more = f" and {len(counts) - _NONFINITE_SHOWN} more" if len(counts) > _NONFINITE_SHOWN else ""
    return (f"{sum(counts.values()):,} non-finite values (NaN or Inf) in {len(counts)} of {n_tensors} tensors: "
            f"{shown}{more}")


def nonfinite_error(reader: CheckpointReader, counts: dict[str, int], n_tensors: int) -> CheckpointError:
    files = {reader.file_of(name).path for name in counts}
    where = files.pop() if len(files) == 1 else reader.source
    return CheckpointError(where, f"{nonfinite_message(counts, n_tensors)}; a model with them computes NaN. "
                                  "To load it anyway (e.g. to inspect or repair it): --allow-nonfinite (zoo "
                                  "generate, zoo convert) or allow_nonfinite=True (zoo.Model.from_pretrained)")


def scan_nonfinite(reader: CheckpointReader, matches: list[TensorMatch]) -> dict[str, int]:
    """Non-finite values per stored tensor (only those with some), read from the files chunk by
    chunk, as loading would convert them: `zoo inspect --scan`."""
    counts = {}
    for m in matches:
        n = reader.file_of(m.stored).count_nonfinite(m.stored)
        if n:
            counts[m.stored] = n
    return counts


def checkpoint_folder(path: str | os.PathLike) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        if folder.is_file() and folder.suffix.lower() == ".gguf":
            raise CheckpointError(folder, f"a GGUF file, not a checkpoint folder: zoo convert {folder} DIR makes one")
        raise CheckpointError(folder, "not a checkpoint folder (expected config.json and model.safetensors)")
    return folder


def load_pretrained(path: str | os.PathLike, model_class, *, max_seq_len: Optional[int] = None, ad="manual",
                    allow_nonfinite: bool = False, lora=None, base_dtype: Optional[str] = None,
                    precision: str = "fp32", checkpointing: bool = False, adapter_seed: int = 0):
    """A model_class (zoo.Model) from a Hugging Face checkpoint folder (config.json + safetensors,
    one file or shards). Every other form a model comes in is io/load.py's.

    max_seq_len: cap the context of a RoPE model (its positions are computed, so this changes
    no weight; it keeps arenas small for models with 128K-token configs).
    ad: the pullback backend, as zoo.Model takes it ("manual", "clad" or a per-block mapping).
    allow_nonfinite: load weights holding NaN or Inf (refused by default: such a model computes
    NaN, or garbage from greedy decoding) with a RuntimeWarning that says how many and where.
    lora, base_dtype: a frozen base with LoRA adapters (zoo.Model's arguments); the weights are
    stored in the base's format as they are read, a block of rows at a time; the adapters start
    as PEFT starts them, drawn from adapter_seed.
    """
    folder = checkpoint_folder(path)
    cfg = read_config(folder, max_seq_len=max_seq_len)
    with CheckpointReader(folder) as reader:
        matches = check_tensors(cfg, reader)  # all checks before the arena is allocated
        model = model_class(cfg, seed=None, ad=ad, lora=lora, base_dtype=base_dtype, precision=precision,
                            checkpointing=checkpointing)
        params = model.parameters()
        family = families.get(cfg.family)
        nonfinite: dict[str, int] = {}
        for m in matches:
            if family.row_order(cfg, m.spec.name) is not None:  # rows reordered: read whole
                value = family.rows_from_checkpoint(cfg, m.spec.name, reader.read(m.stored))
                if model.frozen:
                    model.set_base_tensor(m.spec.name, value)
                else:
                    params[m.spec.name][...] = value
                n = count_nonfinite(value)
            elif _maps_from_file(cfg, reader, m, model):
                n = _map_frozen(reader, m, model)
            elif model.frozen:
                n = _load_frozen(reader, m, model)
            else:
                reader.copy_into(m.stored, params[m.spec.name], transpose=m.spec.hf_transposed)
                n = count_nonfinite(params[m.spec.name])  # counted in the arena: no second copy of the weights
            if n:
                nonfinite[m.stored] = n
        if nonfinite:
            error = nonfinite_error(reader, nonfinite, len(matches))
            if not allow_nonfinite:
                raise error
            warnings.warn(f"{error.path}: loaded with {nonfinite_message(nonfinite, len(matches))} "
                          "(allow_nonfinite=True)", RuntimeWarning, stacklevel=2)
    if lora is not None:
        model.init_adapters(adapter_seed)
    model.pretrained_path = folder  # save_pretrained copies this folder's tokenizer files
    model.pretrained_generation_config = _read_generation_config(folder)  # read now: written back on save
    return model


# Values read at a time into a frozen base: the widest tensor's fp32 copy would cost gigabytes.
_FROZEN_CHUNK_VALUES = 1 << 24


# A safetensors dtype -> the frozen base's format that holds its bytes unchanged.
_SAME_FORMAT = {"BF16": "bf16", "F32": "fp32"}


def _maps_from_file(cfg: ModelConfig, reader: CheckpointReader, m: TensorMatch, model) -> bool:
    """Whether a frozen base reads this tensor from the checkpoint's file (a memory map) rather
    than holding a copy: the token embedding of a model whose LM head has its own matrix (a step
    reads one row of it per token; a tied head would read every row), stored in the base's own
    format (a bf16 base from a BF16 checkpoint), in the layout zoo reads."""
    if not model.frozen or cfg.tied_embeddings or m.spec.role != "wte" or m.spec.hf_transposed:
        return False
    info = reader.info(m.stored)
    itemsize = 2 if info.dtype == "BF16" else 4
    return (_SAME_FORMAT.get(info.dtype) == model.base_format(m.spec.name)
            and reader.file_of(m.stored).data_offset(m.stored) % itemsize == 0)


def _map_frozen(reader: CheckpointReader, m: TensorMatch, model) -> int:
    """Maps the tensor from its file into the frozen base (Model.map_base_tensor); returns its
    non-finite values (the scan releases the pages it read: none stays resident)."""
    source = reader.file_of(m.stored)
    bad = source.count_nonfinite(m.stored)
    try:
        model.map_base_tensor(m.spec.name, source.path, source.data_offset(m.stored))
    except ValueError as e:  # the file changed since it was opened (cut short, replaced by a folder...)
        raise CheckpointError(source.path, str(e).removeprefix(f"zoo: {source.path}: "), key=m.stored) from None
    return bad


def _load_frozen(reader: CheckpointReader, m: TensorMatch, model) -> int:
    """Stores one checkpoint tensor in a frozen base, a block of rows at a time (a transposed
    GPT-2 Conv1D weight whole); returns its non-finite values."""
    if m.spec.hf_transposed:
        value = reader.read(m.stored).T
        model.set_base_tensor(m.spec.name, value)
        return count_nonfinite(value)
    rows = m.spec.shape[0]
    cols = math.prod(m.spec.shape[1:])
    step = max(1, _FROZEN_CHUNK_VALUES // max(cols, 1))
    source = reader.file_of(m.stored)
    bad = 0
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        block = source.read_flat(m.stored, r0 * cols, r1 * cols)
        bad += count_nonfinite(block)
        model.set_base_tensor(m.spec.name, block, first_row=r0)
        del block  # (an F32 block is a view of the map)
        source.release(m.stored, r0 * cols, r1 * cols)  # the file's pages read: not resident past the block
    return bad


def stop_ids(folder: str | os.PathLike) -> list[int]:
    """The ids generation stops at for a checkpoint folder read without a tokenizer: the
    eos_token_id of generation_config.json, else of config.json (as transformers' generate)."""
    for name in (GENERATION_FILE, CONFIG_FILE):
        path = Path(folder) / name
        if path.exists():
            ids = parse_model(path, IdsConfig, read_json(path, name), name).eos_token_id
            if ids is not None:
                return list(ids) if isinstance(ids, list) else [ids]
    return []


def _read_generation_config(folder: Path) -> Optional[bytes]:
    path = folder / GENERATION_FILE
    if not path.exists():
        return None
    try:
        return regular_file(path, "generation config").read_bytes()  # a FIFO would block
    except OSError as e:
        raise CheckpointError(path, f"cannot read it ({e.strerror or e})") from None


def save_pretrained(model, path: str | os.PathLike, *, tokenizer: Union[Tokenizer, str, os.PathLike, None] = None,
                    tokenizer_dir: Union[str, os.PathLike, None] = None, dtype: str = "float32",
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write `model` as a Hugging Face checkpoint folder that transformers loads:
    config.json, model.safetensors (or shards + index above max_shard_bytes), and the tokenizer.
    A config transformers has no class for (e.g. RoPE with LayerNorm) gets zoo's own config.json,
    with a warning: zoo loads it, transformers does not.

    tokenizer: a Tokenizer (its files are written) or a folder whose tokenizer files are
    copied; by default the model's own: the folder it was loaded from, if it had any, or the
    tokenizer of the GGUF file it was loaded from. Either way the folder gets the files
    transformers needs to encode as zoo does (Tokenizer.handover_files), and
    generation_config.json: the loaded model's, else the tokenizer folder's, else one with the
    bos/eos ids. dtype: float32, bfloat16 or float16 storage.
    """
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPE_NAMES)}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:  # the model's own: a GGUF file's (made from its metadata), or its folder's files
        tokenizer = tokenizer_dir if tokenizer_dir is not None else (getattr(model, "pretrained_tokenizer", None)
                                                                     or getattr(model, "pretrained_path", None))
    bos, eos = _special_ids(tokenizer)
    cfg = model.config
    problem = hf_incompatibility(cfg)
    if problem is None:
        hf = config_to_hf(cfg, dtype=dtype, bos_token_id=bos, eos_token_id=eos)
    else:
        warnings.warn(f"{folder / CONFIG_FILE}: {problem[1]}; writing zoo's own config (model_type 'zoo'), "
                      "which zoo loads and transformers does not", stacklevel=2)
        hf = config_to_zoo(cfg, dtype=dtype, bos_token_id=bos, eos_token_id=eos)
    if getattr(model, "lora", None) is not None:
        raise ValueError("this model has LoRA adapters over a frozen base: save the adapters "
                         "(zoo.io.peft.save_adapter, PEFT's format) or merge them into the base (zoo merge)")
    family = families.get(cfg.family)
    tensors = [(spec.name, family.rows_to_checkpoint(
        cfg, spec.name, model.base_tensor(spec.name).T if spec.hf_transposed else model.base_tensor(spec.name)))
        for spec in parameter_layout(cfg)]
    write_checkpoint(folder, tensors, DTYPE_NAMES[dtype], max_shard_bytes)
    if isinstance(tokenizer, Tokenizer):
        tokenizer.save(folder)
    elif tokenizer is not None:
        _copy_tokenizer_files(Path(tokenizer), folder)
    generation = _generation_config(model, tokenizer, bos, eos)
    if generation is not None:
        write_bytes(folder / GENERATION_FILE, generation)
    write_json(folder / CONFIG_FILE, hf)  # last: a folder with a config.json is complete
    return folder


def _generation_config(model, tokenizer, bos, eos) -> Optional[bytes]:
    """generation_config.json's content: the loaded model's unchanged, else the tokenizer
    folder's, else the bos/eos ids config.json gets (none if neither is known)."""
    own = getattr(model, "pretrained_generation_config", None)
    if own is not None:
        return own
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        theirs = _read_generation_config(Path(tokenizer))
        if theirs is not None:
            return theirs
    if bos is None and eos is None:
        return None
    return (json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2) + "\n").encode()


def _special_ids(tokenizer) -> tuple[Optional[int], Union[int, list[int], None]]:
    """bos/eos ids for config.json: from a Tokenizer, or from a source folder's own config files."""
    if tokenizer is None:
        return None, None
    if isinstance(tokenizer, Tokenizer):
        eos = list(tokenizer.eos_ids)
        return tokenizer.bos_id, (eos[0] if len(eos) == 1 else eos or None)
    folder = Path(tokenizer)
    if (folder / CONFIG_FILE).exists():  # the source checkpoint says it directly (a FIFO is refused by name)
        ids = parse_model(folder / CONFIG_FILE, IdsConfig, read_config_json(folder), CONFIG_FILE)
        if ids.bos_token_id is not None or ids.eos_token_id is not None:
            return ids.bos_token_id, ids.eos_token_id
    if has_tokenizer(folder):
        return _special_ids(Tokenizer.from_pretrained(folder))
    return None, None


def _copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy a folder's tokenizer files unchanged, then add the hand-over files it lacks."""
    if not src.is_dir():
        raise CheckpointError(src, "tokenizer folder not found")
    if src.resolve() != dst.resolve():
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                copy_file(regular_file(src / name, "tokenizer file"), dst / name)  # copying a FIFO would block
    if not has_tokenizer(src):
        return
    try:
        missing = Tokenizer.from_pretrained(src).handover_files()
    except CheckpointError as e:
        # Passengers zoo cannot read (e.g. a WordPiece tokenizer.json) still go along as they are.
        warnings.warn(f"{dst}: tokenizer files copied as they are, without the files that hand them over to "
                      f"transformers (zoo cannot read them: {e})", stacklevel=3)
        return
    for name, content in missing.items():
        write_bytes(dst / name, content)
