"""kill -9 in every phase of writing a run folder, then --resume, for a run that saves and prunes
a checkpoint at every step (--save-every 1 --keep-checkpoints 2). After each kill: every
published checkpoints/step-* folder loads and has its trainer state and optimizer moments; a
final model at the top of --out, if there is one, is the whole final model; what the kill left
is what that phase leaves. The run is resumed and killed again in the next phase, and the last
resume ends with the losses and the weights of an uninterrupted run, leaving no temporary or
half-deleted file.

The kills are deterministic: an audit hook (sys.addaudithook, installed before zoo runs) sees
every file operation of the run under --out and sends the process SIGKILL just before the n-th
operation of the kind a phase names, so each phase is hit on every machine, however fast."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import helpers
import pytest

import zoo
from zoo.io.run_folder import checkpoint_dirs
from zoo.io.safetensors import SafetensorsFile
from zoo.train.checkpoint import read_state
from zoo.train.config import DEMO_DATA, TrainConfig
from zoo.train.trainer import Trainer

STEPS = 10
RUN = dict(preset="tiny-gpt2", data=[str(DEMO_DATA / "001.txt")], steps=STEPS, batch_size=2, seq_len=16, eval_every=4,
           save_every=1, keep_checkpoints=2, threads=1, progress=False, sample_tokens=0)
# What a kill may leave: a checkpoint being written or pruned, a file being replaced.
LEFTOVER_PREFIXES = (".tmp-", ".trash-")

# `zoo train` behind an audit hook. The hook describes each file operation under $ZOO_TEST_OUT
# as "<event> <path relative to it>" and kills the process just before the $ZOO_TEST_KILL_AT-th
# one (counted from 1) that matches the regular expression $ZOO_TEST_KILL, after writing that
# description to $ZOO_TEST_KILLED.
KILLER = r'''
import os, re, signal, sys
WATCHED = os.path.realpath(os.environ["ZOO_TEST_OUT"]) + os.sep
PATTERN = re.compile(os.environ["ZOO_TEST_KILL"])
AT = int(os.environ["ZOO_TEST_KILL_AT"])
seen = 0

def _hook(event, args):
    global seen
    if event == "open":  # builtins.open and os.open: (path, mode, flags); writes only
        if not isinstance(args[0], (str, os.PathLike)) or not (args[2] or 0) & (os.O_WRONLY | os.O_RDWR):
            return
    elif event not in ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.link"):
        return
    path = os.path.realpath(os.fspath(args[0])) if isinstance(args[0], (str, os.PathLike)) else ""
    if not path.startswith(WATCHED):
        return
    what = f"{event} {path[len(WATCHED):]}"
    if PATTERN.fullmatch(what):
        seen += 1
        if seen == AT:
            with open(os.environ["ZOO_TEST_KILLED"], "w") as f:
                f.write(what)
            os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(_hook)
from zoo.cli import main
sys.exit(main(sys.argv[1:]))
'''

# (phase, the operation to die before: a regular expression over "<event> <path>", which one of
# those the resumed process does it for (from 1), and what the kill must leave).
STEP_DIR = r"checkpoints/\.tmp-step-\d{8}-\d+"
PHASES = [
    # A fresh run: the third checkpoint's folder half written (its weights in, its moments not).
    ("writing a checkpoint's files", rf"open {STEP_DIR}/\.optimizer\.safetensors\.\d+\.[0-9a-f]{{8}}\.tmp", 3,
     r"checkpoints/\.tmp-step-00000003-\d+"),
    # Resumed at step 2: the folder of step 4 whole, not yet renamed into place.
    ("publishing a checkpoint", rf"os\.rename {STEP_DIR}", 2, r"checkpoints/\.tmp-step-00000004-\d+"),
    # Resumed at step 3: saving step 4 prunes step 2, renamed aside and about to be deleted.
    ("pruning a checkpoint", r"shutil\.rmtree checkpoints/\.trash-step-\d{8}-\d+", 1,
     r"checkpoints/\.trash-step-00000002-\d+"),
    # Resumed at step 4: at the end the final model replaces nothing yet, config.json goes last.
    ("publishing the final model", r"os\.rename \.model\.safetensors\.\d+\.tmp", 1, r"\.model\.safetensors\.\d+\.tmp"),
    # Resumed at its last step: it publishes again and writes the loss plot.
    ("writing the loss plot", r"os\.rename \.loss\.png\.\d+\.[0-9a-f]{8}\.tmp", 1,
     r"\.loss\.png\.\d+\.[0-9a-f]{8}\.tmp"),
]


def command(out: Path, cache: Path, *extra) -> list[str]:
    args = ["train", "--preset", RUN["preset"], "--data", RUN["data"][0], "--out", out, "--cache-dir", cache,
            "--steps", STEPS, "--batch-size", RUN["batch_size"], "--seq-len", RUN["seq_len"], "--eval-every",
            RUN["eval_every"], "--save-every", 1, "--keep-checkpoints", 2, "--threads", 1, "--no-progress",
            "--sample-tokens", 0, *extra]
    return [sys.executable, "-c", KILLER, *map(str, args)]


def records(out: Path) -> list[tuple]:
    """What must equal between runs: (step, loss) and (step, val_loss), in order (not the speed)."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in recs]


def leftovers(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")
                  if p.name.startswith(LEFTOVER_PREFIXES) or p.name.endswith(".tmp"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run (in this process: the same steps as the command's, one thread)."""
    root = tmp_path_factory.mktemp("kill9")
    out = root / "reference"
    Trainer(TrainConfig(**RUN, out=str(out), cache_dir=str(root / "cache"))).run()
    return {"root": root, "records": records(out), "weights": (out / "model.safetensors").read_bytes()}


def assert_whole(out: Path, reference: dict) -> None:
    """Every published checkpoint loads with its state and moments; a final model at the top of
    --out is there whole (the reference's), or not at all (no config.json)."""
    for ckpt in checkpoint_dirs(out):
        zoo.Model.from_pretrained(ckpt)
        assert read_state(ckpt)["step"] == int(ckpt.name.split("-")[1])
        with SafetensorsFile(ckpt / "optimizer.safetensors") as f:
            assert set(f.tensors) == {"m", "v"}, ckpt
    if (out / "config.json").exists():
        zoo.Model.from_pretrained(out)
        assert (out / "model.safetensors").read_bytes() == reference["weights"]


def test_kill9_in_each_write_phase_then_resume(reference, tmp_path):
    out, cache = tmp_path / "run", reference["root"] / "cache"
    out.mkdir()
    resume: tuple[str, ...] = ()
    left_before: list[str] = []
    for phase, pattern, at, leaves in PHASES:
        killed = tmp_path / "killed.txt"
        r = helpers.run(command(out, cache, *resume), env={"ZOO_TEST_OUT": str(out), "ZOO_TEST_KILL": pattern,
                                                           "ZOO_TEST_KILL_AT": str(at), "ZOO_TEST_KILLED": str(killed)})
        assert r.returncode == -signal.SIGKILL, f"{phase}: not killed (exit {r.returncode}):\n{r.stderr}"
        assert re.fullmatch(pattern, killed.read_text()), (phase, killed.read_text())
        if left_before:
            assert f"note: removed what an interrupted run left in {out}" in r.stderr, (phase, r.stderr)
        left = leftovers(out)
        assert any(re.fullmatch(leaves, name) for name in left), (phase, left)
        assert_whole(out, reference)
        resume, left_before = ("--resume",), left

    r = helpers.run(command(out, cache, "--resume"), env={"ZOO_TEST_OUT": str(out), "ZOO_TEST_KILL": "never",
                                                          "ZOO_TEST_KILL_AT": "1", "ZOO_TEST_KILLED": "-"})
    assert r.returncode == 0, r.stderr
    assert f"note: removed what an interrupted run left in {out}" in r.stderr
    assert leftovers(out) == []
    assert records(out) == reference["records"]
    assert (out / "model.safetensors").read_bytes() == reference["weights"]
    assert [c.name for c in checkpoint_dirs(out)] == [f"step-{STEPS - 1:08d}", f"step-{STEPS:08d}"]
    assert_whole(out, reference)
