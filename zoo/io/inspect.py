"""`zoo inspect`: what a model is and what it needs, read from its config, headers and metadata
(weights only with scan=True): a preset, a config.json, or any form loading takes (load.py):
a Hugging Face folder, a run folder or checkpoint, a PEFT adapter over its base, a GGUF file.
Its verdict runs the checks loading runs, so it cannot say "can load" of what loading refuses."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Optional

from ..arch.config import ModelConfig
from ..arch.layout import num_parameters
from ..arch.memory import (
    available_memory_bytes,
    finetune_memory_bytes,
    finetune_ways,
    human_bytes,
)
from ..arch.presets import PRESETS, preset
from ..core.errors import CheckpointError
from ..text.tokenizers import TOKENIZER_FILES
from . import load
from .checkpoints import (
    check_tensors,
    checkpoint_folder,
    is_buffer,
    nonfinite_error,
    scan_nonfinite,
)
from .gguf import check_tensors as check_gguf_tensors
from .gguf import is_gguf
from .hf_config import CONFIG_FILE, config_from_hf, read_config_json
from .peft import ADAPTER_WEIGHTS, read_adapter
from .safetensors import INDEX_FILE, CheckpointReader, count_nonfinite


def inspect_checkpoint(path: str | os.PathLike, batch: int = 1, seq_len: Optional[int] = None,
                       scan: bool = False, lora_r: int = 16) -> dict:
    """What `zoo inspect` prints: of a checkpoint folder, from config.json and the safetensors
    headers; of a preset name, a config.json file or a folder holding only config.json, from
    the config alone (no weights needed). Its verdict runs the checks loading runs (a config,
    header, range or index that loading refuses fails here the same way; names, shapes and
    dtypes give "no: <loading's error>"). The weights' values are read only with scan=True, for
    NaN/Inf, chunk by chunk. The memory table: full finetuning, LoRA (rank lora_r) over each
    base format, and generation, at (batch, seq_len), against what this machine has."""
    names = [p.name for p in PRESETS]
    given = Path(path)
    if not given.exists() and str(path) in names:
        cfg = preset(str(path))
        report = {"path": f"preset {path}", "architecture": f"zoo preset ({cfg.family} names)", "model_type": "-",
                  "weights": None}
    elif (given.is_file() and not is_gguf(given)) or (given.is_dir() and (given / CONFIG_FILE).is_file()
                                                       and not _has_weights(given)):
        config_file = given if given.is_file() else given / CONFIG_FILE
        hf = read_config_json(config_file)
        cfg = config_from_hf(hf, config_file)
        report = {"path": str(config_file), "architecture": (hf.get("architectures") or [f"zoo model, {cfg.family} names"])[0],
                  "model_type": hf["model_type"], "weights": None}
    elif not given.exists():
        raise CheckpointError(given, f"no such file or folder (PATH takes a preset name ({', '.join(names)}), a "
                                     f"config.json, or {load.EXPECTED})")
    else:
        source = load.resolve(given, "PATH")
        if source.form == "gguf":
            report = _inspect_gguf(source.model, scan)
        elif source.is_adapter:
            report = _inspect_adapter(source, scan)
        else:
            report = _inspect_weights(source.model, scan)
        report["form"] = source.described + (f" (its model: {source.model})" if source.model != source.path else "")
        cfg = report["config"]
    seq_len = seq_len or min(cfg.max_seq_len, 1024)
    report.update(config=cfg, parameters=num_parameters(cfg), batch=batch, seq_len=seq_len,
                  finetune_memory=finetune_memory_bytes(cfg, batch, seq_len),
                  finetune_memory_checkpointing=finetune_memory_bytes(cfg, batch, seq_len, checkpointing=True),
                  memory_options=memory_options(cfg, batch, seq_len, lora_r), available=available_memory_bytes(),
                  lora_r=lora_r)
    return report


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or (folder / INDEX_FILE).is_file()


def _inspect_weights(path: Path, scan: bool) -> dict:
    folder = checkpoint_folder(path)
    hf = read_config_json(folder)
    cfg = config_from_hf(hf, folder / CONFIG_FILE)
    with CheckpointReader(folder) as reader:
        infos = [reader.info(n) for n in reader.names]
        try:
            matches = check_tensors(cfg, reader)
            if scan:
                nonfinite = scan_nonfinite(reader, matches)
                if nonfinite:
                    raise nonfinite_error(reader, nonfinite, len(matches))
            loadable = "yes"
        except CheckpointError as e:
            loadable = f"no: {e}"
        files = sorted({reader.file_of(n).path for n in reader.names})
    dtypes = Counter()
    for info in infos:
        if not is_buffer(cfg, info.name):
            dtypes[info.dtype] += 1
    tokenizer_files = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    return {
        "path": str(folder), "architecture": (hf.get("architectures") or [f"zoo model, {cfg.family} names"])[0],
        "model_type": hf["model_type"], "config": cfg, "weights": True, "tensors": len(infos), "dtypes": dict(dtypes),
        "files": [str(f.name) for f in files], "file_bytes": sum(f.stat().st_size for f in files),
        "tokenizer_files": tokenizer_files, "loadable": loadable, "scanned": scan,
    }


def _inspect_gguf(path: Path, scan: bool) -> dict:
    from .gguf_file import GGUFFile  # the gguf package, imported only for a .gguf

    with GGUFFile(path) as f:
        cfg = load.config_of(load.Source(path, "gguf", path))
        arch = f.value("general.architecture", str)
        types = Counter(f.tensor(name).type_name for name in f.tensors)
        try:
            pairs = check_gguf_tensors(cfg, f)
            if scan:
                bad = {name: n for _, name in pairs if (n := count_nonfinite(f.read(name)))}
                if bad:
                    raise CheckpointError(path, f"{sum(bad.values()):,} non-finite values (NaN or Inf) in "
                                                f"{len(bad)} tensors")
            loadable = "yes"
        except CheckpointError as e:
            loadable = f"no: {e}"
        has_vocab = f.value("tokenizer.ggml.model", str, None) not in (None, "none")
        n_tensors = len(f.tensors)
    return {"path": str(path), "architecture": f"GGUF {arch}", "model_type": cfg.family, "config": cfg,
            "weights": True, "tensors": n_tensors, "dtypes": dict(types), "files": [path.name],
            "file_bytes": path.stat().st_size, "tokenizer_files": ["in its metadata"] if has_vocab else [],
            "loadable": loadable, "scanned": scan}


def _inspect_adapter(source: "load.Source", scan: bool) -> dict:
    """An adapter: its base's report, with the adapter's own settings and a verdict on both."""
    base = load.resolve(load.adapter_base(source.model), "the adapter's base_model_name_or_path")
    report = _inspect_gguf(base.model, scan) if base.form == "gguf" else _inspect_weights(base.model, scan)
    try:
        adapter = read_adapter(source.model, report["config"])
        lora = adapter.lora
        report["adapter"] = (f"r={lora.r}, alpha={lora.alpha:g}, on {', '.join(lora.targets or [])} "
                             f"({len(adapter.adapters)} modules; {ADAPTER_WEIGHTS}) over {base.path}")
    except CheckpointError as e:
        report["adapter"] = f"does not load over {base.path}: {e}"
        report["loadable"] = f"no: {e}"
    report["path"] = str(source.path)
    return report


def memory_options(cfg: ModelConfig, batch: int, seq_len: int, lora_r: int = 16) -> list[tuple[str, int, int]]:
    """memory.finetune_ways with the LoRA runs' products as this machine takes them by default."""
    return finetune_ways(cfg, batch, seq_len, lora_r)


def variant_summary(cfg: ModelConfig) -> str:
    """The options of the Llama variants cfg sets (biases unlike Llama's included), in a line; ""
    for none."""
    parts = []
    if cfg.attention_bias and not cfg.attention_out_bias:
        parts.append("q/k/v biases, none on the output projection")
    if cfg.qk_norm != "none":
        parts.append(f"q/k {cfg.norm} over each {'head' if cfg.qk_norm == 'head' else 'projection'}")
    if cfg.branch_norms != "pre":
        parts.append({"post": "norms on the branch outputs (none on their inputs)",
                      "both": "norms on the branch inputs and outputs"}[cfg.branch_norms])
    if cfg.sliding_window is not None:
        where = "every layer" if cfg.sliding_layers is None else f"layers {_ranges(cfg.sliding_layers)}"
        parts.append(f"window of {cfg.sliding_window} keys on {where}")
    if cfg.nope_layers:
        parts.append(f"no RoPE on layers {_ranges(cfg.nope_layers)}")
    for field, words in (("embedding_scale", "embeddings x"), ("residual_scale", "branches x"),
                         ("logit_scale", "logits x")):
        if getattr(cfg, field) != 1.0:
            parts.append(f"{words} {getattr(cfg, field):g}")
    if cfg.attention_scale is not None:
        parts.append(f"softmax scale {cfg.attention_scale:g}")
    for field, what in (("attention_softcap", "scores"), ("logit_softcap", "logits")):
        if getattr(cfg, field) is not None:
            parts.append(f"{what} soft-capped at {getattr(cfg, field):g}")
    if cfg.sliding_rope_theta is not None:
        parts.append(f"sliding layers' rope theta {cfg.sliding_rope_theta:g}")
    if cfg.rotary_dim is not None:
        parts.append(f"rope on {cfg.rotary_dim} of {cfg.head_dim} values per head")
    if cfg.layer != "sequential":
        parts.append({"parallel": "parallel residual, one norm",
                      "parallel_two_norms": "parallel residual, two norms"}.get(cfg.layer, f"layer {cfg.layer}"))
    return "; ".join(parts)


def _ranges(layers) -> str:
    """Layer indices as written: 3, 7, 11 (all listed; a model has at most a few dozen)."""
    return ", ".join(str(i) for i in layers)


def _verdict(r: dict) -> str:
    if r["loadable"] != "yes":
        return r["loadable"]
    if r["scanned"]:
        return "yes (weights scanned: all finite)"
    return "yes, if its weights are finite (not scanned for NaN/Inf: zoo inspect --scan reads them)"


def format_inspection(r: dict) -> str:
    cfg: ModelConfig = r["config"]
    kv = f", {cfg.n_kv_head} kv heads" if cfg.n_kv_head != cfg.n_head else ""
    rope = ""
    if cfg.positions == "rope":
        rope = f", rope theta {cfg.rope_theta:g}" + (f" with {cfg.rope_scaling.rope_type} scaling" if cfg.rope_scaling else "")
    lines = [
        f"{r['path']}",
        *([f"  form           {r['form']}"] if r.get("form") else []),
        f"  architecture   {r['architecture']} (model_type {r['model_type']})",
        f"  shape          {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads{kv}, head_dim "
        f"{cfg.head_dim}, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}, context {cfg.max_seq_len}",
        f"  blocks         {cfg.norm}, {cfg.mlp}, {cfg.positions} positions{rope}, "
        f"{'tied' if cfg.tied_embeddings else 'untied'} embeddings",
        *([f"  variant        {variant}"] if (variant := variant_summary(cfg)) else []),
        f"  parameters     {r['parameters']:,}",
    ]
    if r["weights"]:
        lines += [
            f"  weights        {r['tensors']} tensors in {len(r['files'])} file(s), {human_bytes(r['file_bytes'])}; "
            + ", ".join(f"{k} x{v}" for k, v in sorted(r["dtypes"].items())),
            f"  tokenizer      {', '.join(r['tokenizer_files']) or 'none'}",
            *([f"  adapter        {r['adapter']}"] if r.get("adapter") else []),
            f"  zoo can load   {_verdict(r)}",
        ]
    else:
        lines.append("  weights        none read (a config alone): the figures below come from the shape")
    have = r["available"]
    lines.append(f"  memory at batch {r['batch']} x {r['seq_len']} tokens"
                 + (f" ({human_bytes(have[0])} available here, {have[1]})" if have else "") + ":")
    width = max(len(name) for name, _, _ in r["memory_options"])
    lines.append(f"    {'':{width}}  {'plain':>11}  {'checkpointing':>13}")
    for name, plain, ckpt in r["memory_options"]:
        fits = "" if not have else ("  fits" if min(plain, ckpt) <= have[0] else "  does not fit")
        lines.append(f"    {name:{width}}  {human_bytes(plain):>11}  "
                     f"{human_bytes(ckpt) if not name.startswith('generation') else '':>13}{fits}")
    m = r["finetune_memory"]
    lines.append(f"    full finetune: parameters {human_bytes(m.parameters)}, gradients {human_bytes(m.gradients)}, "
                 f"AdamW moments {human_bytes(m.optimizer)}, activations {human_bytes(m.activations)}")
    return "\n".join(lines)
