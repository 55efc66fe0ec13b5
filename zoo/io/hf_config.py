"""Hugging Face config.json <-> ModelConfig, for every family of zoo/families/.

The family its model_type names reads the keys (each family's read_config): every key that
changes the math is read; a missing key takes the default of the transformers config class
(transformers omits keys equal to its defaults when it saves). A value zoo cannot compute
exactly (another activation, another rope type, cross-attention...) is an error naming the
file and key, never an approximation. Keys that only matter to training-time dropout, caching
or generation are ignored. This module does what is common to all: the file, the checks of
model_type and architectures, validation with errors mapped back to the family's keys, zoo's
own config.json, and the keys every saved config carries.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from .. import families
from ..arch.config import ModelConfig
from ..core.errors import CheckpointError
from ..core.files import first_field_error, read_json, show_value

CONFIG_FILE = "config.json"
ZOO_MODEL_TYPE = "zoo"  # zoo's own config.json, for configs transformers has no class for


def config_file(path: str | os.PathLike) -> Path:
    """The config.json of a checkpoint folder, or the path itself when it is not a folder."""
    path = Path(path)
    return path / CONFIG_FILE if path.is_dir() else path


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of a checkpoint folder (or the file itself)."""
    return _read_config_file(config_file(path))


def _read_config_file(file: Path) -> dict[str, Any]:
    """A config.json: a regular file (a FIFO is refused, not opened; a folder in its place too),
    within files.py's size bound, a JSON object. Its fields are typed where they are read
    (config_from_hf), each error naming the key."""
    if not file.exists():
        raise CheckpointError(file, "not found: a checkpoint folder needs its config.json")
    hf = read_json(file, CONFIG_FILE)
    if not isinstance(hf, dict):
        raise CheckpointError(file, f"not a JSON object (a {_json_type(hf)}): a config.json is {{\"model_type\": ...}}")
    return hf


def _json_type(value) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}.get(
        type(value), type(value).__name__)


def read_config(path: str | os.PathLike, max_seq_len: Optional[int] = None) -> ModelConfig:
    """ModelConfig of a checkpoint folder's config.json (max_seq_len: as config_from_hf)."""
    file = config_file(path)
    return config_from_hf(_read_config_file(file), file, max_seq_len)


def _with_context(fields: dict, max_seq_len: Optional[int], source) -> dict:
    """fields with the context capped to max_seq_len, before validation: a RoPE model's positions
    are computed, so its config.json may name a context beyond zoo's bound (a 4M-token Llama)
    that a smaller max_seq_len makes loadable. Learned positions are a fixed table. A larger
    context than the checkpoint's is refused: zoo computes a model within its context only (a
    sliding window, for one, caps it: families/mistral.py)."""
    if max_seq_len is None or fields.get("max_seq_len") == max_seq_len:
        return fields
    if fields.get("positions", "learned") != "rope":
        raise ValueError(f"max_seq_len: {source} has learned positions; its context is fixed at "
                         f"{fields.get('max_seq_len')}")
    if isinstance(fields.get("max_seq_len"), int) and max_seq_len > fields["max_seq_len"]:
        raise ValueError(f"max_seq_len: {max_seq_len} is beyond the context of {source}, "
                         f"{fields['max_seq_len']} tokens; zoo computes a model within its context")
    return {**fields, "max_seq_len": max_seq_len}


def config_from_hf(hf: dict[str, Any], source: str | os.PathLike = CONFIG_FILE,
                   max_seq_len: Optional[int] = None) -> ModelConfig:
    """ModelConfig of a parsed config.json; `source` names the file in errors; max_seq_len caps
    the context of a RoPE model (_with_context)."""
    model_type = hf.get("model_type")
    readable = ", ".join([*families.model_types(), ZOO_MODEL_TYPE])
    if not isinstance(model_type, str):
        raise CheckpointError(source, f"expected a string (zoo reads: {readable}), "
                                      f"got {_json_type(model_type)} {show_value(model_type)}", key="model_type")
    if model_type == ZOO_MODEL_TYPE:
        return _zoo_config(hf, source, max_seq_len)
    family = families.by_model_type(model_type)
    if family is None:
        raise CheckpointError(source, f"unsupported model_type {show_value(model_type)} (zoo reads: {readable})",
                              key="model_type")
    archs = hf.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not all(a in family.architectures for a in archs):
            raise CheckpointError(source, f"unsupported architectures {show_value(archs)} for model_type {model_type!r} "
                                          f"(zoo reads: {', '.join(family.architectures)})", key="architectures")
    fields = _with_context(family.read_config(hf, families.Getter(hf, source)), max_seq_len, source)
    try:
        return ModelConfig(**fields)
    except ValidationError as e:
        field, msg = first_field_error(e)
        raise CheckpointError(source, f"invalid value: {msg}", key=family.hf_keys.get(field)) from None


def _zoo_config(hf: dict, source, max_seq_len: Optional[int] = None) -> ModelConfig:
    fields = hf.get("zoo_config")
    if not isinstance(fields, dict):
        raise CheckpointError(source, "model_type 'zoo' needs a zoo_config object", key="zoo_config")
    fields = _with_context(fields, max_seq_len, source)
    try:
        return ModelConfig(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise CheckpointError(source, f"invalid value: {first['msg']}",
                              key=f"zoo_config.{where}" if where else "zoo_config") from None


# --- writing ---------------------------------------------------------------------------------


def hf_incompatibility(cfg: ModelConfig) -> tuple[str, str] | None:
    """(field, why) when the class cfg's family saves as cannot express cfg, else None."""
    return families.get(cfg.family).cannot_express(cfg)


def config_to_hf(cfg: ModelConfig, *, dtype: str = "float32", bos_token_id: int | list[int] | None = None,
                 eos_token_id: int | list[int] | None = None, target: str | os.PathLike = CONFIG_FILE) -> dict:
    """The config.json for `cfg`, as transformers reads it. A config outside what its family's
    class can express is an error naming the field (`target` names the file)."""
    problem = hf_incompatibility(cfg)
    if problem is not None:
        raise CheckpointError(target, problem[1], key=problem[0])
    return {**families.get(cfg.family).write_config(cfg), **_common(cfg, dtype, bos_token_id, eos_token_id)}


def config_to_zoo(cfg: ModelConfig, *, dtype: str = "float32", bos_token_id: int | list[int] | None = None,
                  eos_token_id: int | list[int] | None = None) -> dict:
    """zoo's own config.json (model_type "zoo"), for mixes transformers has no class for
    (e.g. RoPE with LayerNorm and GELU): zoo reads it back, transformers does not."""
    return {"model_type": ZOO_MODEL_TYPE, "zoo_config": cfg.model_dump(mode="json"),
            **_common(cfg, dtype, bos_token_id, eos_token_id)}


def _common(cfg: ModelConfig, dtype: str, bos_token_id, eos_token_id) -> dict:
    # pad_token_id null: zoo trains every embedding row, and a class's default pad id (OLMo-2's 1,
    # SmolLM3's 128004) would freeze one in transformers, or fall outside a smaller vocabulary.
    return {"tie_word_embeddings": cfg.tied_embeddings, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
            "pad_token_id": None, "dtype": dtype, "torch_dtype": dtype}  # torch_dtype: the key transformers 4.x reads
