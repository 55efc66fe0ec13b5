"""kill -9 at seeded random points of a run that saves and prunes a checkpoint at every step
(--save-every 1 --keep-checkpoints 2), then --resume. After each kill: every published
checkpoints/step-* folder loads and has its trainer state and optimizer moments; a final model
at the top of --out, if there is one, is the whole final model. The resumed run ends with the
losses and the weights of an uninterrupted run, and leaves no temporary or half-deleted file.

The kill delays are drawn per seed from the timing of an uninterrupted run (measured once
here): most over the span from its first checkpoint to its last, where every step writes one
checkpoint and prunes another; every fifth after its last checkpoint, over the first part of
what follows, where the final model is published (then the loss plot written)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fuzz
import numpy as np
import pytest

import zoo
from zoo.io.safetensors import SafetensorsFile
from zoo.train.config import DEMO_DATA
from zoo.io.run_folder import checkpoint_dirs
from zoo.train.checkpoint import read_state

SEEDS = list(range(20))
STEPS = 10
# What a kill may leave: a checkpoint being written or pruned, a file being replaced.
LEFTOVER_PREFIXES = (".tmp-", ".trash-")


def command(out: Path, cache: Path, *extra) -> list[str]:
    args = ["train", "--preset", "tiny-gpt2", "--data", DEMO_DATA / "001.txt", "--out", out, "--cache-dir", cache,
            "--steps", STEPS, "--batch-size", 2, "--seq-len", 16, "--eval-every", 4, "--save-every", 1,
            "--keep-checkpoints", 2, "--threads", 1, "--no-progress", "--sample-tokens", 0, *extra]
    return [sys.executable, "-c", "import sys; from zoo.cli import main; sys.exit(main())", *map(str, args)]


def start(out: Path, cache: Path) -> subprocess.Popen:
    """A run in a subprocess, once it has written its first checkpoint."""
    out.mkdir(parents=True)
    log = open(out.parent / f"{out.name}.console", "wb")
    p = subprocess.Popen(command(out, cache), stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_for(p, out, 1)
    return p


def wait_for(p: subprocess.Popen, out: Path, step: int) -> float:
    """When the run `p` in `out` has published checkpoint `step`."""
    deadline = time.monotonic() + fuzz.TIMEOUT_S
    while not (out / "checkpoints" / f"step-{step:08d}").is_dir():
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"no checkpoint {step} from {out} (exit {p.wait()}):\n"
                                 + (out.parent / f"{out.name}.console").read_text())
        time.sleep(0.001)
    return time.monotonic()


def records(out: Path) -> list[tuple]:
    """What must equal between runs: (step, loss) and (step, val_loss), in order (not the speed)."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in recs]


def leftovers(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.name.startswith(LEFTOVER_PREFIXES) or p.name.endswith(".tmp")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its records, its final weights, and its timing after its first
    checkpoint: until its last one (`steps`), then until it ends (`end`)."""
    root = tmp_path_factory.mktemp("kill9")
    cache, out = root / "cache", root / "reference"
    p = start(out, cache)
    first = time.monotonic()
    last = wait_for(p, out, STEPS)
    assert p.wait(timeout=fuzz.TIMEOUT_S) == 0, (root / "reference.console").read_text()
    end = time.monotonic()
    return {"root": root, "cache": cache, "steps": last - first, "end": end - last, "records": records(out),
            "weights": (out / "model.safetensors").read_bytes(), "kills": {}}


@pytest.mark.parametrize("seed", SEEDS)
def test_kill9_then_resume(reference, seed):
    out = reference["root"] / f"trial-{seed}"
    rng = np.random.default_rng(seed)
    at_end = seed % 5 == 4
    p = start(out, reference["cache"])
    if at_end:
        wait_for(p, out, STEPS)
        time.sleep(rng.uniform(0.0, 0.3) * reference["end"])
    else:
        time.sleep(rng.uniform(0.0, 1.0) * reference["steps"])
    p.send_signal(signal.SIGKILL)
    status = p.wait()
    left = leftovers(out)
    reference["kills"][seed] = (status == -signal.SIGKILL, [p.name for p in left])

    # Every published checkpoint is whole.
    for ckpt in checkpoint_dirs(out):
        zoo.Model.from_pretrained(ckpt)
        assert read_state(ckpt)["step"] == int(ckpt.name.split("-")[1])
        with SafetensorsFile(ckpt / "optimizer.safetensors") as f:
            assert set(f.tensors) == {"m", "v"}, ckpt
    # A final model at the top of --out is there whole, or not at all (no config.json).
    if (out / "config.json").exists():
        zoo.Model.from_pretrained(out)
        assert (out / "model.safetensors").read_bytes() == reference["weights"]

    r = fuzz.run(command(out, reference["cache"], "--resume"))
    assert r.returncode == 0, r.stderr
    if left:
        assert f"note: removed what an interrupted run left in {out}" in r.stderr
    assert leftovers(out) == []
    assert records(out) == reference["records"]
    assert (out / "model.safetensors").read_bytes() == reference["weights"]
    assert [c.name for c in checkpoint_dirs(out)] == [f"step-{STEPS - 1:08d}", f"step-{STEPS:08d}"]


def test_the_kills_landed_in_runs_and_in_their_writes(reference):
    """The trials above tested something: most kills stopped a run before its end, and some
    stopped it in the middle of writing or pruning a checkpoint (what they left shows it)."""
    kills = reference["kills"]
    if len(kills) < len(SEEDS):
        pytest.skip("runs only after all the trials")
    mid_run = sum(killed for killed, _ in kills.values())
    in_writes = sum(bool(left) for _, left in kills.values())
    print(f"{mid_run} of {len(kills)} kills before the end; {in_writes} left temporary or half-deleted files: "
          + "; ".join(f"{seed}: {', '.join(left)}" for seed, (_, left) in kills.items() if left))
    assert mid_run >= len(kills) // 2 and in_writes >= 1
