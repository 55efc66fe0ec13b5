"""The command line behaves as the Unix tools people know: every --help lists the defaults,
generate echoes the prompt, files are created with the user's umask, and a closed pipe ends
a command quietly with status 0."""

import argparse
import ast
import os
import re
import stat
import subprocess
import sys

import pytest
from helpers import zoo_command

import zoo
from zoo.cli import build_parser, main
from zoo.text.tokenizers import Tokenizer
from zoo.tools import bench
from zoo.train.config import DEMO, DEMO_DATA, TrainConfig

FAST = ["--threads", "1", "--no-progress", "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    zoo.Model(zoo.preset("tiny-llama"), seed=0).save_pretrained(folder, tokenizer=Tokenizer.byte_level())
    return folder


# --- defaults in --help ----------------------------------------------------------------


def verb_parsers() -> dict:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    # zoo bench hands its command line to the benchmark's own parser (zoo/cli/bench.py)
    return {**sub.choices, "bench": bench.build_parser()}


def test_the_command_starts_without_the_tools():
    # zoo.tools is outside the runtime's import graph: zoo imports it only when bench, card or cards runs
    code = "import sys; from zoo.cli import build_parser; build_parser(); print(sorted(sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    loaded = ast.literal_eval(r.stdout)
    assert "zoo.cli.bench" in loaded and not [m for m in loaded if m.startswith("zoo.tools")]


def help_texts(text: str) -> dict:
    """--help output as {option string: its help text on one line}."""
    texts, current = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):  # an option: its flags, then (maybe) its help on the same line
            head, _, rest = line.strip().partition("  ")
            current = [rest.strip()]
            for flag in re.findall(r"(?:^|[ ,])(--?[\w-]+)", head):
                texts[flag] = current
        elif line.startswith("   ") and current is not None:  # the help, continued
            current.append(line.strip())
        else:
            current = None
    # argparse may wrap a word after a hyphen ("tiny-\nllama"): join it back.
    return {flag: " ".join(parts).strip().replace("- ", "-") for flag, parts in texts.items()}


def expected_default(verb: str, action: argparse.Action):
    """The value an option takes when not given, or None where it has none worth showing."""
    if isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return None  # a switch: its default is that it is not given
    if action.default is argparse.SUPPRESS:  # a TrainConfig field (see _add_train_flags)
        field = TrainConfig.model_fields[action.dest]
        value = DEMO[action.dest] if verb == "demo" and action.dest in DEMO else field.get_default(
            call_default_factory=True)
    else:
        value = action.default
    return None if value is None or value == [] else value


def states(shown: str, value) -> bool:
    """Whether the note "(default SHOWN)" states `value`."""
    if isinstance(value, bool):
        return shown == ("on" if value else "off")
    if isinstance(value, list):
        return shown == " ".join(map(str, value))
    if shown.startswith("'"):  # a text with spaces at its ends, or none
        return ast.literal_eval(shown) == value
    if value == "":  # no text: '', or the note says in words what that means
        return shown == "''" or shown[:1].isalpha()
    word = shown.split()[0].rstrip(",;")
    if isinstance(value, (int, float)):
        return float(word) == value
    return word == value


def test_help_of_every_verb_lists_every_default(capsys):
    checked = {}
    for verb, parser in verb_parsers().items():
        with pytest.raises(SystemExit) as e:
            main([verb, "--help"])
        assert e.value.code == 0
        texts = help_texts(capsys.readouterr().out)
        for action in parser._actions:
            value = expected_default(verb, action)
            if value is None:
                continue
            flag = action.option_strings[0]
            text = texts.get(flag)
            assert text is not None, f"zoo {verb} --help: {flag} is not listed"
            note = re.search(r"\(default:? (.*)\)$", text)
            assert note and states(note.group(1), value), \
                f"zoo {verb} --help: {flag} should show its default {value!r}: {text!r}"
            checked[verb, flag] = value
    # Not vacuous: every verb with options was looked at, and the train flags among them.
    assert {v for v, _ in checked} >= {"train", "finetune", "demo", "generate", "inspect", "convert", "bench"}
    assert checked["train", "--batch-size"] == 8 and checked["train", "--lr"] == 3e-4
    assert checked["demo", "--batch-size"] == DEMO["batch_size"]
    assert checked["train", "--progress"] is True and checked["generate", "--max-new-tokens"] == 200
    assert len(checked) > 80


def test_train_help_says_the_demo_has_settings_of_its_own(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    demo = text[text.index("embedded demo"):].replace("- ", "-")
    assert "DEMO in zoo/train/config.py" in demo
    for name in DEMO:
        if name != "data":
            assert "-" + name.replace("_", "-") in demo, name


# --- generate echoes the prompt --------------------------------------------------------


def test_generate_echoes_the_prompt_unless_told_not_to(checkpoint, capsys):
    from zoo import Model
    from zoo.generate import generate, prompt_tokens

    tok = Tokenizer.from_pretrained(checkpoint)
    ids = generate(Model.from_pretrained(checkpoint), prompt_tokens(tok, "Once upon"), 12, stop_ids=tok.eos_ids)
    continuation = tok.decode([i for i in ids if i not in tok.eos_ids])
    args = ["generate", "--from", checkpoint, "--prompt", "Once upon", "--temperature", 0,
            "--max-new-tokens", 12, "--threads", 1]

    assert main([str(a) for a in args]) == 0
    assert capsys.readouterr().out == "Once upon" + continuation + "\n"
    assert main([str(a) for a in args] + ["--no-echo"]) == 0
    assert capsys.readouterr().out == continuation + "\n"


# --- files made with the user's umask --------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_run_folder_modes_come_from_the_umask(tmp_path, umask):
    out, cache = tmp_path / "run", tmp_path / "cache"
    args = ["train", "--preset", "tiny-gpt2", "--data", DEMO_DATA, "--steps", 2, "--batch-size", 2,
            "--seq-len", 16, "--save-every", 1, "--out", out, "--cache-dir", cache, *FAST]
    proc = subprocess.run(zoo_command(*args), capture_output=True, text=True, umask=umask)
    assert proc.returncode == 0, proc.stderr

    files = [p for p in [*out.rglob("*"), *cache.rglob("*")] if p.is_file()]
    names = {p.name for p in files}
    assert {"config.json", "model.safetensors", "metrics.jsonl", "optimizer.safetensors"} <= names, names
    assert any(cache in p.parents for p in files)  # the token cache too
    for p in [*files, *(p for p in [*out.rglob("*"), *cache.rglob("*")] if p.is_dir())]:
        want = (0o777 if p.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(p.stat().st_mode) == want, f"{p}: {oct(stat.S_IMODE(p.stat().st_mode))}, not {oct(want)}"


# --- a closed pipe ---------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["inspect", "CKPT"], ["presets"], ["train", "--help"]])
def test_a_closed_pipe_ends_quietly_with_status_0(checkpoint, argv):
    argv = [str(checkpoint) if a == "CKPT" else a for a in argv]
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader: the first write fails with EPIPE, every time
    try:
        proc = subprocess.run(zoo_command(*argv), stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_inspect_into_head(checkpoint):
    # As a user types it. Unbuffered, zoo writes in pieces, so head has often gone by the last one.
    script = 'set -o pipefail; "$@" | head -n 1'
    for _ in range(3):
        proc = subprocess.run(["bash", "-c", script, "_", *zoo_command("inspect", checkpoint)], capture_output=True,
                              text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout == f"{checkpoint}\n"


def test_a_run_whose_console_closes_trains_to_the_end(tmp_path):
    """`zoo train 2>&1 | head`: the console's reader goes away, the run does not. It finishes,
    publishes its model and keeps every line in train.log."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    out = tmp_path / "run"
    try:
        proc = subprocess.run(zoo_command("demo", "--steps", "30", "--out", out, "--cache-dir", tmp_path / "c", *FAST),
                              stdout=write_end, stderr=write_end)
    finally:
        os.close(write_end)
    assert proc.returncode == 0
    assert (out / "model.safetensors").is_file() and (out / "loss.png").is_file()
    log = (out / "train.log").read_text()
    assert "step 30/30" in log and log.rstrip().splitlines()[-1].startswith("done: step 30")


def test_the_demo_spaces_its_evaluations_to_its_length(tmp_path):
    out = tmp_path / "run"
    assert main(["demo", "--steps", "20", "--out", str(out), "--cache-dir", str(tmp_path / "c"), *FAST]) == 0
    import json

    evals = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert evals == list(range(0, 21, 2))
