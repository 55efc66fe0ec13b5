"""zoo eval: the mean loss and perplexity of a model over a data set, masked as in training."""

from __future__ import annotations

from pathlib import Path

from ..core.atomic import write_json
from ..core.errors import CheckpointError
from ..io import load
from ..train.data import all_token_ids, batches_for, tokenize_files
from ..train.evaluate import evaluate
from ..train.records import parse_columns
from .flags import FROM_HELP, add_model_flags, apply_threads, check_flag, model_for

EVAL_SETTINGS = {"batch_size": 8, "seq_len": 128, "val_fraction": 0.1, "eval_batches": 8, "seed": 0,
                 "train_on_everything": False}


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="mean loss and perplexity of a checkpoint over a data set (any training "
                                    "format, masked as in training)")
    p.add_argument("--from", dest="from_dir", required=True, metavar="MODEL",
                   help=FROM_HELP + "; a run's training settings are the defaults")
    p.add_argument("--data", nargs="+", metavar="PATH", help="data files or folders (default: the run's)")
    p.add_argument("--data-columns", dest="data_columns", default=None, metavar="FIELD=COLUMN,...",
                   help="the data's column names for zoo's record fields, e.g. prompt=question,completion=answer "
                        "(default: the run's)")
    p.add_argument("--split", choices=["all", "val"], default="all",
                   help="all the data, or the validation split the trainer evaluates (default all)")
    for name, flag, kind, what in [("batch_size", "--batch-size", int, "sequences per batch"),
                                   ("seq_len", "--seq-len", int, "tokens per sequence"),
                                   ("val_fraction", "--val-fraction", float, "tail of the data held out as --split val"),
                                   ("eval_batches", "--eval-batches", int, "batches in --split val")]:
        p.add_argument(flag, dest=name, type=kind, default=None, metavar="N" if kind is int else "X",
                       help=f"{what} (default: the run's, else {EVAL_SETTINGS[name]})")
    p.add_argument("--train-on-everything", dest="train_on_everything", action="store_true", default=None,
                   help="loss on prompts and user turns too (default: the run's setting)")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    p.add_argument("--cache-dir", metavar="DIR", help="where tokenized data is cached (default: $ZOO_CACHE or ~/.cache/zoo)")
    add_model_flags(p)
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load weights holding NaN or Inf too (refused by default), saying how many and where")
    p.set_defaults(run=_cmd_eval)


def _cmd_eval(args) -> int:
    apply_threads(args)
    source = load.resolve(args.from_dir)
    src = source.path
    run = source.settings()
    s = {k: getattr(args, k, None) if getattr(args, k, None) is not None else run.get(k, default)
         for k, default in EVAL_SETTINGS.items()}
    for flag, name in (("--batch-size", "batch_size"), ("--seq-len", "seq_len"), ("--eval-batches", "eval_batches")):
        check_flag(flag, s[name], isinstance(s[name], int) and s[name] > 0, "a positive integer")
    check_flag("--val-fraction", s["val_fraction"], 0 <= s["val_fraction"] <= 0.5, "a number in [0, 0.5]")
    data = args.data or run.get("data")
    if not data:
        raise ValueError(f"--data: none given, and {src} is not a run folder whose data zoo could reuse")
    model = model_for(source, args.allow_nonfinite, args)
    if s["seq_len"] > model.config.max_seq_len:
        raise ValueError(f"--seq-len {s['seq_len']}: beyond the model's max_seq_len {model.config.max_seq_len}")
    tokenizer = load.tokenizer_for(source, model, args.tokenizer)
    if tokenizer is None and not all_token_ids(data):
        raise CheckpointError(src, "no tokenizer here to read the data with; give a tokenizer folder with --tokenizer")
    template = load.chat_template_for(source, args.tokenizer) if tokenizer is not None else None
    try:
        columns = parse_columns(args.data_columns if args.data_columns is not None else run.get("data_columns"))
    except ValueError as e:
        raise ValueError(f"--data-columns: {e}") from None
    token_file = tokenize_files(data, tokenizer, args.cache_dir, template, vocab_size=model.config.vocab_size,
                                columns=columns)
    windows = batches_for(token_file, s["batch_size"], s["seq_len"], s["val_fraction"] if args.split == "val" else 0.0,
                          s["eval_batches"], s["seed"], f"data {', '.join(map(str, data))}", s["train_on_everything"])
    result = evaluate(model, windows, args.split)
    if not result["tokens"]:
        raise ValueError(f"--split {args.split}: no tokens that carry loss to evaluate (add data, or a larger "
                         "--val-fraction)")
    print(f"{src}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} over {result['tokens']:,} tokens "
          f"({args.split}; {windows.describe()}), {result['tokens_per_s']:,.0f} tokens/s")
    if args.json:
        write_json(Path(args.json), {"schema": "zoo-eval/1", "from": str(src), "data": [str(d) for d in data],
                                     "split": args.split, "precision": model.precision, **s, **result})
    return 0
