"""Fuzz cases of a training run's own files and faults: a damaged trainer_state.json or
metrics.jsonl, what a killed run left, a second run on a folder in use, a full disk. Each ends
in one `zoo: error: ...` line naming the file (and the field, or the line), or is handled (the
run goes on, and says what it dropped or removed); the last good checkpoint stays loadable.
Each case runs in its own subprocess through tests/helpers.py, on a copy of one short run made
here; a full disk is forced by a snippet that makes one write site fail with ENOSPC."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import helpers
import numpy as np
import pytest

import zoo
from zoo.core.errors import EXIT_INPUT, EXIT_RESOURCES
from zoo.train.config import DEMO_DATA
from zoo.train.plot import read_metrics

STEPS = 3
STATE = "checkpoints/step-00000003/trainer_state.json"


def train_args(out: Path, cache: Path, *extra) -> list[str]:
    return ["train", "--preset", "tiny-gpt2", "--data", DEMO_DATA / "001.txt", "--out", out, "--cache-dir", cache,
            "--steps", STEPS, "--batch-size", 2, "--seq-len", 16, "--save-every", 1, "--keep-checkpoints", 2,
            "--threads", 1, "--no-progress", "--sample-tokens", 0, *extra]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, Path]:
    """(run folder, token cache) of a complete 3-step run, checkpoints at steps 2 and 3."""
    root = tmp_path_factory.mktemp("fuzz_runs")
    out, cache = root / "run", root / "cache"
    r = helpers.cli(*train_args(out, cache))
    assert r.returncode == 0, r.stderr
    return out, cache


@pytest.fixture
def run(made, tmp_path) -> Path:
    """A copy of the made run, for one case to damage."""
    out = tmp_path / "run"
    shutil.copytree(made[0], out)
    return out


def resume(run: Path, cache: Path, *extra, patch: str = "") -> helpers.Result:
    """`zoo train ... --resume` on `run` (after the Python lines `patch`, which force a fault)."""
    argv = [str(a) for a in train_args(run, cache, "--resume", *extra)]
    return helpers.python(f"import sys\n{patch}\nfrom zoo.cli import main\nsys.exit(main({argv!r}))")


def edit_state(run: Path, change) -> Path:
    path = run / STATE
    state = json.loads(path.read_text())
    path.write_text(json.dumps(change(state)))
    return path


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# --- trainer_state.json ---------------------------------------------------------------------


def test_state_that_is_a_list(run, made):
    (run / STATE).write_text("[1, 2, 3]\n")
    helpers.assert_error(resume(run, made[1]), str(run / STATE), "(top level)", "valid dictionary", status=EXIT_INPUT)


def test_state_without_config(run, made):
    path = edit_state(run, lambda s: {k: v for k, v in s.items() if k != "config"})
    helpers.assert_error(resume(run, made[1]), str(path), "config: Field required", status=EXIT_INPUT)


def test_state_without_step(run, made):
    path = edit_state(run, lambda s: {k: v for k, v in s.items() if k != "step"})
    helpers.assert_error(resume(run, made[1]), str(path), "step: Field required", status=EXIT_INPUT)


def test_state_with_a_string_step(run, made):
    path = edit_state(run, lambda s: {**s, "step": "3"})
    helpers.assert_error(resume(run, made[1]), str(path), "step: Input should be a valid integer", status=EXIT_INPUT)


def test_state_with_a_wrong_config_field(run, made):
    path = edit_state(run, lambda s: {**s, "config": {**s["config"], "lr": "fast"}})
    helpers.assert_error(resume(run, made[1]), str(path), "config.lr", status=EXIT_INPUT)


def test_state_cut_short(run, made):
    path = run / STATE
    path.write_bytes(path.read_bytes()[:100])
    helpers.assert_error(resume(run, made[1]), str(path), "not valid JSON (line", status=EXIT_INPUT)


def test_checkpoint_without_its_state(run, made):
    (run / STATE).unlink()
    helpers.assert_error(resume(run, made[1]), str(run / STATE), "not a zoo training checkpoint", status=EXIT_INPUT)


# --- metrics.jsonl --------------------------------------------------------------------------


def test_resume_drops_metrics_lines_that_are_no_records(run, made):
    """A line cut by a kill (the last one, no newline), garbage, a record with a string step:
    the resumed run drops each, naming the line, and its metrics.jsonl is whole again."""
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines.insert(2, "garbage")
    lines.insert(3, '{"step": "2", "loss": 1.0}')
    metrics.write_text("\n".join(lines) + '\n{"step": 4, "lo')
    r = resume(run, made[1], "--steps", 5)
    assert r.returncode == 0, r.stderr
    assert f"note: {metrics}: line 3 is not JSON" in r.stderr
    assert f"note: {metrics}: line 4 does not hold what zoo expects: step: Input should be a valid integer" in r.stderr
    train, _ = read_metrics(run)
    assert [step for step, _ in train] == [1, 2, 3, 4, 5]
    for line in metrics.read_text().splitlines():
        json.loads(line)


def test_plot_names_the_line_that_is_no_record_and_skips_an_unfinished_last_line(run):
    metrics = run / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text(good + '{"step": 9, "lo')  # a run writing (or killed while writing) its last line
    r = helpers.cli("plot", run)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    metrics.write_text(good + "[1, 2]\n")
    n = len(good.splitlines()) + 1
    helpers.assert_error(helpers.cli("plot", run), str(metrics), f"line {n} does not hold what zoo expects",
                      status=EXIT_INPUT)


# --- what killed runs left; a folder in use -------------------------------------------------


def test_the_leftovers_of_dead_runs_are_removed_at_start_and_a_live_writers_kept(run, made):
    dead = dead_pid()
    ckpts = run / "checkpoints"
    left = [ckpts / f".tmp-step-00000004-{dead}", ckpts / f".trash-step-00000001-{dead}",
            run / f".trash-checkpoints-{dead}"]
    for folder in left:
        helpers.write(folder / "model.safetensors", b"partial")
    left += [helpers.write(run / f".config.json.{dead}.tmp", "{"),
             helpers.write(run / f".loss.png.{dead}.0a1b2c3d.tmp", b"partial")]
    # A file being replaced by a live process (`zoo plot` takes no lock): this one's, with a
    # random part of digits only, which must not be read as the (dead) pid.
    live = helpers.write(run / f".loss.png.{os.getpid()}.0a1b2c3d.tmp", b"being written")
    live_digits = helpers.write(run / f".metrics.png.{os.getpid()}.{dead:08d}.tmp", b"being written")
    mine = helpers.write(ckpts / "notes.txt", "the user's")  # no name of zoo's: never touched
    r = resume(run, made[1], "--steps", 4)
    assert r.returncode == 0, r.stderr
    assert [p for p in left if p.exists()] == []
    assert f"note: removed what an interrupted run left in {run}" in r.stderr
    assert live.exists() and live_digits.exists() and mine.exists()
    assert sorted(p.name for p in ckpts.iterdir()) == ["notes.txt", "step-00000003", "step-00000004"]


def test_a_folder_in_use_by_a_live_run_is_refused_and_left_alone(run, made):
    left = helpers.write(run / "checkpoints" / f".tmp-step-00000004-{os.getpid()}" / "model.safetensors", b"partial")
    with open(run / ".zoo-run.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a live run holds
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        r = resume(run, made[1], "--steps", 4)
        helpers.assert_error(r, f"another zoo run is using {run} (pid {os.getpid()})", status=EXIT_INPUT)
        assert left.exists()  # the live run's checkpoint being written
        r = helpers.cli(*train_args(run, made[1], "--overwrite"))
        helpers.assert_error(r, f"another zoo run is using {run}", status=EXIT_INPUT)
        assert (run / "checkpoints" / "step-00000003").is_dir() and (run / "metrics.jsonl").exists()
    r = resume(run, made[1], "--steps", 4)  # the lock given up: the folder is free again
    assert r.returncode == 0, r.stderr
    assert not left.exists()


# --- a full disk ------------------------------------------------------------------------------


def disk_full_at(where: str) -> str:
    """Patch lines after which every file opened for writing whose path contains `where`
    fails its first write with ENOSPC, as on a full disk: the atomic writer's files (os.fdopen)
    and the appended ones (open)."""
    return f"""
import builtins, errno, io, os
class _Full:
    def __init__(self, f): self._f = f
    def write(self, data): raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    def __getattr__(self, name): return getattr(self._f, name)
    def __enter__(self): return self
    def __exit__(self, *exc): self._f.close()
def _full(f, path):
    return _Full(f) if {where!r} in str(path) else f
_fdopen, _open = os.fdopen, builtins.open
os.fdopen = lambda fd, *a, **k: _full(_fdopen(fd, *a, **k), os.readlink(f"/proc/self/fd/{{fd}}"))
builtins.open = lambda file, mode="r", *a, **k: _full(_open(file, mode, *a, **k), file) if set(mode) & set("wa") \\
    else _open(file, mode, *a, **k)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="the snippet finds a file's path in /proc")
def test_full_disk_while_writing_a_checkpoint_names_the_file_and_keeps_the_last_one(run, made):
    r = resume(run, made[1], "--steps", 5, patch=disk_full_at(".tmp-step-00000005-"))
    line = helpers.assert_error(r, "cannot write checkpoint", str(run / "checkpoints" / "step-00000005"),
                             "no space left on the device writing", "model.safetensors",
                             f"the previous checkpoint {run / 'checkpoints' / 'step-00000004'} is intact",
                             status=EXIT_RESOURCES)
    assert "free" in line and "--resume" in line
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000003", "step-00000004"]
    zoo.Model.from_pretrained(ckpts / "step-00000004")
    r = resume(run, made[1], "--steps", 5)  # space again: the run goes on
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", ["metrics.jsonl", "train.log"])
def test_full_disk_while_appending_to_a_run_file_names_it(run, made, name):
    r = resume(run, made[1], "--steps", 4, patch=disk_full_at(str(run / name)))
    helpers.assert_error(r, str(run / name), "not enough disk space", status=EXIT_RESOURCES)
    zoo.Model.from_pretrained(run / "checkpoints" / "step-00000003")


def test_full_disk_while_writing_the_plot_names_it(run):
    r = helpers.python(disk_full_at("loss.png")
                       + f"import sys\nfrom zoo.cli import main\nsys.exit(main(['plot', {str(run)!r}]))")
    helpers.assert_error(r, str(run / "loss.png"), "not enough disk space", status=EXIT_RESOURCES)
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]


# --- killed while pruning, or while publishing the final model -------------------------------


def test_killed_while_pruning_leaves_every_checkpoint_whole(run, made):
    """kill -9 after the first file of the pruned checkpoint is deleted: the folder had been
    renamed aside, so no step-* folder lacks its weights; the next run removes what is left."""
    kill = """
import os, signal
_unlink = os.unlink
def _unlink_then_die(path, *a, **k):
    _unlink(path, *a, **k)
    if os.path.basename(path) == "model.safetensors":  # only pruning deletes a checkpoint's weights
        os.kill(os.getpid(), signal.SIGKILL)
os.unlink = _unlink_then_die
"""
    r = resume(run, made[1], "--steps", 4, patch=kill)
    assert r.returncode == -9, r.stderr
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-")) == ["step-00000003", "step-00000004"]
    for ckpt in ("step-00000003", "step-00000004"):
        zoo.Model.from_pretrained(ckpts / ckpt)
    assert [p.name for p in ckpts.glob(".trash-step-00000002-*")]
    r = resume(run, made[1], "--steps", 5)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000004", "step-00000005"]


def test_killed_while_publishing_leaves_no_model_that_mixes_two(run, made):
    """kill -9 as the extended run's weights replace the earlier ones at the top of --out: the
    folder holds no config.json then (it went first), so it never loads as a mix of two models
    (zoo takes a run folder without a final model as its latest checkpoint, whole); --resume
    publishes the whole final model and removes the temporary file."""
    kill = f"""
import os, signal
_replace = os.replace
def _replace_then_die(src, dst, *a, **k):
    if str(dst) == {str(run / "model.safetensors")!r}:
        os.kill(os.getpid(), signal.SIGKILL)
    return _replace(src, dst, *a, **k)
os.replace = _replace_then_die
"""
    r = resume(run, made[1], "--steps", 4, patch=kill)
    assert r.returncode == -9, r.stderr
    assert not (run / "config.json").exists()
    assert [p.name for p in run.glob(".model.safetensors.*.tmp")]
    loaded, latest = zoo.Model.from_pretrained(run), zoo.Model.from_pretrained(run / "checkpoints" / "step-00000004")
    assert all(np.array_equal(v, latest.parameters()[k]) for k, v in loaded.parameters().items())
    for _ in range(2):  # published whole; then published again, onto the same files
        r = resume(run, made[1], "--steps", 4)
        assert r.returncode == 0 and "complete at step 4" in r.stderr, r.stderr
        assert not list(run.glob(".*.tmp"))
    final = run / "checkpoints" / "step-00000004"
    for name in ("config.json", "model.safetensors"):
        assert (run / name).read_bytes() == (final / name).read_bytes(), name
    zoo.Model.from_pretrained(run)
