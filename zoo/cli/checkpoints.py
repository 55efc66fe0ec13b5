"""The verbs over checkpoints: zoo inspect (what a checkpoint, config or preset is and what it
needs), zoo convert (a folder's storage dtype and shards, GGUF in and out) and zoo merge (a
LoRA adapter folded into its base)."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

from ..io import load
from ..io.checkpoints import save_pretrained
from ..io.gguf import EXPORT_TYPES, save_gguf
from ..io.inspect import format_inspection, inspect_checkpoint
from ..io.safetensors import DTYPE_NAMES
from ..model import Model
from .flags import FROM_HELP, check_flag, model_for


def add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="a checkpoint folder, a config or a preset: architecture, parameters, dtypes, "
                                       "memory to finetune (full or LoRA) and to generate")
    p.add_argument("path", metavar="PATH", help="checkpoint folder (config.json + safetensors), a config.json (or a "
                                                "folder holding only one), or a preset name (zoo presets)")
    p.add_argument("--lora-r", type=int, default=16, metavar="R", help="LoRA rank for the memory table (default 16)")
    p.add_argument("--batch", type=int, default=1, metavar="N", help="micro-batch size for the memory estimate")
    p.add_argument("--seq-len", type=int, default=None, metavar="N", help="tokens per sequence (default: min(context, 1024))")
    p.add_argument("--scan", action="store_true",
                   help="also read every weight and count NaN/Inf, as loading does (slower: reads the whole checkpoint)")
    p.set_defaults(run=_cmd_inspect)


def _cmd_inspect(args) -> int:
    check_flag("--batch", args.batch, args.batch >= 1, ">= 1")
    if args.seq_len is not None:
        check_flag("--seq-len", args.seq_len, args.seq_len >= 1, ">= 1")
    check_flag("--lora-r", args.lora_r, 1 <= args.lora_r <= 4096, "an integer in [1, 4096]")
    print(format_inspection(inspect_checkpoint(args.path, batch=args.batch, seq_len=args.seq_len, scan=args.scan,
                                               lora_r=args.lora_r)))
    return 0


def add_convert(sub) -> None:
    p = sub.add_parser("convert", help="rewrite a checkpoint: a folder's storage dtype and shards, GGUF in and out",
                       epilog="A GGUF file (llama.cpp's format, llama and gpt2 architectures) is read as SRC like a "
                              "folder: its weights dequantized to float32, its tokenizer written as files. With "
                              "--to gguf, DST is one GGUF file for llama.cpp (docs/checkpoints.md, GGUF).")
    p.add_argument("src", metavar="SRC", help=FROM_HELP.replace("the model", "the model to rewrite", 1))
    p.add_argument("dst", metavar="DST", help="folder to write (tokenizer files are copied along), or the .gguf file "
                                              "that --to gguf writes")
    p.add_argument("--to", choices=["hf", "gguf"], default=None,
                   help="what to write: a Hugging Face folder (hf) or one GGUF file for llama.cpp (gguf) "
                        "(default: gguf when DST ends in .gguf, else hf)")
    p.add_argument("--dtype", choices=list(EXPORT_TYPES), default="float32",
                   help="how the weights are stored (q8_0, q4_0: GGUF only; a GGUF keeps norms and biases in float32)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, metavar="GB",
                   help="shard the weights above this size (folders only)")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="convert weights holding NaN or Inf too (refused by default), saying how many and where")
    p.set_defaults(run=_cmd_convert)


def _cmd_convert(args) -> int:
    check_flag("--max-shard-gb", args.max_shard_gb, math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0,
               "a finite number > 0")
    to = args.to or ("gguf" if str(args.dst).lower().endswith(".gguf") else "hf")
    if to == "hf":
        check_flag("--dtype", args.dtype, args.dtype in DTYPE_NAMES,
                   f"one of {', '.join(DTYPE_NAMES)} for a folder ({args.dtype} is a GGUF type: --to gguf)")
    elif Path(args.dst).is_dir():
        raise ValueError(f"DST {args.dst}: a folder; --to gguf writes one file (e.g. {Path(args.dst) / 'model.gguf'})")
    source = load.resolve(args.src, "SRC")
    if source.is_adapter:
        raise load.refuse("convert", source, f"merge it into its base first: zoo merge BASE {source.path} OUT_DIR")
    model = model_for(source, args.allow_nonfinite)
    if to == "gguf":
        out = _printing_warnings(lambda: save_gguf(model, args.dst, dtype=args.dtype))
        print(f"wrote {out} (GGUF, {args.dtype})")
        return 0
    out = save_pretrained(model, args.dst, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 1024**3))
    print(f"wrote {out} ({args.dtype})")
    return 0


def add_merge(sub) -> None:
    p = sub.add_parser("merge", help="merge a PEFT LoRA adapter into its base: one Hugging Face checkpoint folder",
                       epilog="Every adapted weight becomes W + (lora_alpha / r) * B A, computed in float32; the "
                              "base's tokenizer and generation files are carried over (docs/checkpoints.md, LoRA "
                              "adapters).")
    p.add_argument("base", metavar="BASE", help="the base the adapter was trained on: " + FROM_HELP[4:])
    p.add_argument("adapter", metavar="ADAPTER", help="adapter folder (adapter_config.json + "
                                                       "adapter_model.safetensors, PEFT's format), or a LoRA run's "
                                                       "folder or checkpoint")
    p.add_argument("dst", metavar="OUT_DIR", help="folder to write the merged checkpoint to")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="how the merged weights are stored")
    p.set_defaults(run=_cmd_merge)


def _cmd_merge(args) -> int:
    base, adapter = load.resolve(args.base, "BASE"), load.resolve(args.adapter, "ADAPTER")
    if base.is_adapter:
        raise load.refuse("merge", base, "as BASE; give the base model first, then the adapter")
    if not adapter.is_adapter:
        raise load.refuse("merge", adapter, "as ADAPTER; give a PEFT adapter folder or a LoRA run's folder")
    out = _printing_warnings(lambda: load.merge(base.path, adapter.model, args.dst, Model, dtype=args.dtype))
    print(f"wrote {out} ({args.dtype})")
    return 0


def _printing_warnings(work):
    """work(), its warnings printed as one `zoo: warning:` line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = work()
    for w in caught:
        print(f"zoo: warning: {w.message}", file=sys.stderr)
    return result
