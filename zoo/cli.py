"""The `zoo` command. Each verb is a pair of small functions: `_add_<verb>(subparsers)` declares
its flags, `_cmd_<verb>(args)` runs it. Add a verb by writing both and listing it in VERBS."""

from __future__ import annotations

import argparse
import os
import sys
import typing
from pathlib import Path

from .train_config import DEMO, PATH_FIELDS, TrainConfig, read_config_file, validate

# Errors that are the user's to fix: shown as one line, without a traceback.
# ValueError covers bad files and configs (CheckpointError, DataError, pydantic's ValidationError).
_USER_ERRORS = (ValueError, OSError, KeyError)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _run_verb(argv)
        finally:  # after --help's SystemExit too
            sys.stdout.flush()  # so that a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        # The reader has all it wanted (`zoo inspect DIR | head -n 1`): end quietly with 0, like
        # other Unix tools. Stdout goes to /dev/null so that the flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zoo", description="GPT-2 and Llama models: train, finetune, generate.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for add in VERBS:
        add(sub)
    for verb_parser in sub.choices.values():
        verb_parser.formatter_class = _HelpFormatter
    return parser


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help with "(default X)" after each option whose default is a value, unless its
    help already names the default. None (unset, or off) and on/off switches are left alone."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None
                or action.default is argparse.SUPPRESS or isinstance(action.default, bool)):
            return text
        return f"{text} (default %(default)s)".lstrip()


def _run_verb(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    from .trainer import TrainError, TrainInterrupted

    try:
        return args.run(args) or 0
    except BrokenPipeError:
        raise  # an OSError, but no error: main() ends quietly
    except TrainInterrupted as e:
        print(f"zoo: {e}; continue with the same command and --resume", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("zoo: interrupted", file=sys.stderr)
        return 130
    except (TrainError, *_USER_ERRORS) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"zoo: error: {msg}", file=sys.stderr)
        return 1


# --- train, finetune, demo ------------------------------------------------------------


def _add_train_flags(p: argparse.ArgumentParser, defaults: dict) -> None:
    """One flag per TrainConfig field (--batch-size for batch_size, --from for from_dir).

    Flags default to SUPPRESS, so that only the flags given override a config file or a resumed
    run; argparse cannot show such a default, so the help text states it: `defaults` (the
    verb's own, as DEMO for the demo) over the field's."""
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file of training settings; flags override it")
    for name, field in TrainConfig.model_fields.items():
        if name == "model":  # a whole ModelConfig: config files only
            continue
        flag = "--from" if name == "from_dir" else "--" + name.replace("_", "-")
        kind = field.annotation
        if typing.get_origin(kind) is typing.Union:  # Optional[X] -> X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        kw = {"dest": name, "default": argparse.SUPPRESS, "help": _help_with_default(name, field, defaults)}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:
            kw["nargs"] = "+"
            kw["metavar"] = "PATH"
        elif typing.get_origin(kind) is typing.Literal:
            kw["choices"] = typing.get_args(kind)
        else:
            kw["type"] = kind
            kw["metavar"] = "DIR" if name in PATH_FIELDS else {int: "N", float: "X"}.get(kind, "TEXT")
        p.add_argument(flag, **kw)


def _help_with_default(name: str, field, defaults: dict) -> str:
    """The field's description with "(default X)": the verb's default if it has one (replacing a
    default the description names), else the field's, unless the description already names it."""
    text = field.description
    if name in defaults:
        cut = text.find(" (default")
        return f"{text[:cut] if cut >= 0 and text.endswith(')') else text} (default {_shown(defaults[name])})"
    value = field.get_default(call_default_factory=True)
    if "default" in text or value is None or value == []:  # unset: the description says what happens
        return text
    return f"{text} (default {_shown(value)})"


def _shown(value) -> str:
    """A default as a flag would take it: on/off for switches, 3e-4 as 0.0003, '' for no text."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return " ".join(map(str, value))
    if isinstance(value, str) and (not value or value != value.strip()):
        return repr(value)
    return str(value)


def _train_config(args: argparse.Namespace, defaults: dict) -> TrainConfig:
    """Settings by precedence: flags, then --config file, then the resumed run's, then defaults."""
    from .trainer import saved_config

    flags = {k: getattr(args, k) for k in TrainConfig.model_fields if hasattr(args, k)}
    # Absolute paths, so a resumed run finds its files from any working directory.
    for key in PATH_FIELDS:
        if flags.get(key) is not None:
            flags[key] = str(Path(flags[key]).absolute())
    if "data" in flags:
        flags["data"] = [str(Path(p).absolute()) for p in flags["data"]]
    from_file = read_config_file(args.config) if args.config else {}
    resume = {**defaults, **from_file, **flags}.get("resume")
    if resume:
        out = {**defaults, **from_file, **flags}.get("out", TrainConfig.model_fields["out"].default)
        defaults = saved_config(out)
    return validate(_layer(defaults, from_file, flags), f"config file {args.config}" if args.config else "settings")


# Settings of which one is given: a layer that sets one replaces the whole group below it
# (`--epochs 2` over the demo's steps, `--from DIR` over a file's preset).
_EXCLUSIVE = (("steps", "epochs", "tokens"), ("from_dir", "preset", "model"))


def _layer(*layers: dict) -> dict:
    merged: dict = {}
    for layer in layers:
        for group in _EXCLUSIVE:
            if any(k in layer for k in group):
                for k in group:
                    merged.pop(k, None)
        merged.update(layer)
    return merged


def _run_training(cfg: TrainConfig) -> int:
    from .trainer import Trainer, sample_text

    real_stderr = sys.stderr
    sys.stderr = _ConsoleThatOutlivesItsReader(real_stderr)
    try:
        trainer = Trainer(cfg)
        trainer.run()  # its last line ("done: ...") names the run folder in full
        if cfg.sample_tokens:
            print("--- sample ---", file=sys.stderr)
            sample_text(trainer.model, trainer.tokenizer, cfg.sample_prompt, cfg.sample_tokens, cfg.seed)
    finally:
        sys.stderr = real_stderr
    return 0


class _ConsoleThatOutlivesItsReader:
    """stderr during a training run. If its reader goes away (`zoo train 2>&1 | head`), the run
    goes on without a console, train.log keeping every line, instead of dying at the next
    progress update: a closed console is no reason to lose hours of training."""

    def __init__(self, stream):
        self._stream, self.gone = stream, False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._lose()

    def _lose(self) -> None:
        self.gone = True
        # The real stream's buffer still holds what could not be written: point its descriptor at
        # /dev/null so that flushing it (here, or at interpreter exit) succeeds.
        os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())

    def __getattr__(self, name):  # isatty, fileno, encoding ... of the real stream
        return getattr(self._stream, name)


def _add_train(sub) -> None:
    demo = ", ".join(("--" if v else "--no-") + k.replace("_", "-") if isinstance(v, bool)
                     else f"--{k.replace('_', '-')} {_shown(v)}" for k, v in DEMO.items() if k != "data")
    p = sub.add_parser("train", help="train from scratch (--preset or --config); "
                                     "with no model and data, the embedded demo",
                       epilog="With none of --preset, --from, --data, --config and --resume, zoo train runs the "
                              "embedded demo (as zoo demo does): a tiny Llama learns the stories in zoo/assets/demo, "
                              f"with settings of its own over the defaults above: {demo} "
                              "(DEMO in zoo/train_config.py; zoo demo --help lists them in place). Any flag given "
                              "overrides them.")
    _add_train_flags(p, {})
    p.set_defaults(run=_cmd_train)


def _cmd_train(args) -> int:
    chosen = {k for k in ("from_dir", "preset", "data") if hasattr(args, k)}
    demo = not chosen and not args.config and not getattr(args, "resume", False)
    if demo:
        print("zoo: no --preset/--data given: the embedded demo (a tiny Llama learns the stories in zoo/assets/demo)",
              file=sys.stderr)
    return _run_training(_train_config(args, DEMO if demo else {}))


def _add_finetune(sub) -> None:
    p = sub.add_parser("finetune", help="finetune a checkpoint folder (--from) on text (--data)")
    _add_train_flags(p, {})
    p.set_defaults(run=_cmd_finetune)


def _cmd_finetune(args) -> int:
    cfg = _train_config(args, {})
    if cfg.from_dir is None:
        raise ValueError("finetune: --from DIR is required (a checkpoint folder in Hugging Face layout)")
    return _run_training(cfg)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the embedded demo: a tiny model trained from scratch (about 15 s on 2 cores)")
    _add_train_flags(p, DEMO)
    p.set_defaults(run=lambda args: _run_training(_train_config(args, DEMO)))


# --- generate, plot -------------------------------------------------------------------


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a checkpoint (KV cache, streamed)")
    p.add_argument("--from", dest="from_dir", required=True, metavar="DIR", help="checkpoint folder")
    p.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    p.add_argument("--no-echo", dest="echo", action="store_false",
                   help="print only the continuation, not the prompt before it")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                   help="tokens to add at most (fewer at an end-of-text token or the model's context length)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="X", help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample from the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample from the likeliest tokens that together reach probability p (default: 1, all)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the sampling")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="CPU threads (default: all)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer folder (default: --from)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="of the matrix products (default fp32; bf16 needs a CPU with bf16 dot products)")
    p.set_defaults(run=_cmd_generate)


def _cmd_generate(args) -> int:
    import zoo

    from .checkpoints import load_pretrained
    from .generate import TextStream, generate, prompt_tokens
    from .tokenizers import Tokenizer

    if args.threads:
        zoo.set_threads(args.threads)
    src = Path(args.from_dir)
    if not src.is_dir():
        raise ValueError(f"--from {src}: no such checkpoint folder")
    model = load_pretrained(src)
    model.set_precision(args.precision)
    tokenizer = Tokenizer.from_pretrained(args.tokenizer or src)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer {args.tokenizer or src}: {tokenizer.vocab_size} tokens, more than the "
                         f"model's vocab_size {model.config.vocab_size}")
    ids = prompt_tokens(tokenizer, args.prompt)
    stream = TextStream(tokenizer, ids)
    if args.echo:  # as the trainer's sample: the continuation reads on from the prompt
        sys.stdout.write(args.prompt)
        sys.stdout.flush()  # shown while the model reads the prompt
    generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
             stop_ids=tokenizer.eos_ids, on_token=stream)
    stream.finish()
    return 0


def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="plot a run's train and validation loss to RUN_DIR/loss.png")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(run=_cmd_plot)


def _cmd_plot(args) -> int:
    from .plot import plot_run

    print(plot_run(args.run_dir))
    return 0


# --- inspect, convert -----------------------------------------------------------------


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="a checkpoint folder: architecture, parameters, dtypes, memory to finetune")
    p.add_argument("path", metavar="PATH", help="checkpoint folder (config.json + safetensors)")
    p.add_argument("--batch", type=int, default=1, metavar="N", help="micro-batch size for the memory estimate")
    p.add_argument("--seq-len", type=int, default=None, metavar="N", help="tokens per sequence (default: min(context, 1024))")
    p.set_defaults(run=_cmd_inspect)


def _cmd_inspect(args) -> int:
    from .checkpoints import format_inspection, inspect_checkpoint

    print(format_inspection(inspect_checkpoint(args.path, batch=args.batch, seq_len=args.seq_len)))
    return 0


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="rewrite a checkpoint folder: storage dtype, shard size")
    p.add_argument("src", metavar="SRC", help="checkpoint folder to read")
    p.add_argument("dst", metavar="DST", help="folder to write (tokenizer files are copied along)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="how the weights are stored")
    p.add_argument("--max-shard-gb", type=float, default=2.0, metavar="GB", help="shard the weights above this size")
    p.set_defaults(run=_cmd_convert)


def _cmd_convert(args) -> int:
    from .checkpoints import load_pretrained, save_pretrained

    model = load_pretrained(args.src)
    out = save_pretrained(model, args.dst, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 1024**3))
    print(f"wrote {out} ({args.dtype})")
    return 0


# --- bench ------------------------------------------------------------------------------


def _add_bench(sub) -> None:
    from .tools.bench import add_arguments

    p = sub.add_parser("bench", help="time a training step of zoo and of PyTorch eager, side by side "
                                     "(see docs/benchmarks.md)")
    add_arguments(p)
    p.set_defaults(run=_cmd_bench)


def _cmd_bench(args) -> int:
    from .tools.bench import run_from_args

    return run_from_args(args)


# --- presets ----------------------------------------------------------------------------


def _add_presets(sub) -> None:
    p = sub.add_parser("presets", help="list the named architectures with their parameter counts")
    p.set_defaults(run=_cmd_presets)


def _cmd_presets(args) -> int:
    from .presets import PRESETS

    print(f"{'preset':16} {'parameters':>15}  {'layers':>6} {'d_model':>7} {'heads':>9}  blocks")
    for p in PRESETS:
        c = p.config
        heads = f"{c.n_head}/{c.n_kv_head}"
        blocks = f"{c.norm}, {c.mlp}, {c.positions}{', tied' if c.tied_embeddings else ''}"
        print(f"{p.name:16} {c.num_parameters():>15,}  {c.n_layer:>6} {c.d_model:>7} {heads:>9}  {blocks}")
    return 0


# --- card, cards ------------------------------------------------------------------------


def _add_card(sub) -> None:
    p = sub.add_parser("card", help="print a preset's model card (Markdown; see model_cards/)")
    p.add_argument("name", metavar="NAME", help="a preset name (zoo presets lists them)")
    p.add_argument("--benchmarks", metavar="DIR", default=None,
                   help="zoo bench --json results to show (default: benchmarks/ at the repository root)")
    p.add_argument("--json", action="store_true", help="print the machine-readable card instead")
    p.set_defaults(run=_cmd_card)


def _cmd_card(args) -> int:
    from .tools import cards

    bench_dir = Path(args.benchmarks) if args.benchmarks else cards.default_root() / cards.BENCHMARKS_DIR
    data = cards.card_data(cards.find_preset(args.name), cards.read_benchmarks(bench_dir))
    print(cards.card_json(data) if args.json else cards.card_markdown(data), end="")
    return 0


def _add_cards(sub) -> None:
    p = sub.add_parser("cards", help="regenerate model_cards/ from the presets and benchmarks/ (--check: only compare)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 listing the cards that differ from what would be generated")
    p.add_argument("--out", metavar="DIR", default=None, help="cards folder (default: model_cards/ at the repository root)")
    p.add_argument("--benchmarks", metavar="DIR", default=None,
                   help="zoo bench --json results to show (default: benchmarks/ at the repository root)")
    p.set_defaults(run=_cmd_cards)


def _cmd_cards(args) -> int:
    from .tools import cards

    root = cards.default_root()
    out = Path(args.out) if args.out else root / cards.CARDS_DIR
    files = cards.render_all(Path(args.benchmarks) if args.benchmarks else root / cards.BENCHMARKS_DIR)
    if args.check:
        bad = cards.differing(out, files)
        for line in bad:
            print(line)
        if bad:
            print(f"zoo cards: {len(bad)} card(s) out of date; run `zoo cards` to regenerate", file=sys.stderr)
            return 1
        print(f"zoo cards: {len(files)} files in {out} are up to date", file=sys.stderr)
        return 0
    done = cards.write_all(out, files)
    for line in done:
        print(line)
    print(f"zoo cards: {len(files)} files in {out}, {len(done)} changed", file=sys.stderr)
    return 0


VERBS = [_add_presets, _add_train, _add_finetune, _add_demo, _add_generate, _add_plot, _add_inspect, _add_convert, _add_bench, _add_card, _add_cards]

if __name__ == "__main__":
    sys.exit(main())
