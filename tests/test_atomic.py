"""Writes that survive a power loss (zoo/core/atomic.py, the trainer's checkpoints): a file's
bytes reach the disk (fsync) before the rename that publishes it, and the folder holding the
rename is synced after it. kill -9 cannot show a missing fsync (the page cache survives a killed
process), so these tests record the order of the calls themselves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zoo.core import atomic
from zoo.train.config import DEMO_DATA, TrainConfig
from zoo.train.trainer import Trainer


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, str]]:
    """(call, path) for every os.fsync (the path its descriptor is open on), os.replace and
    os.rename, in order."""
    log: list[tuple[str, str]] = []
    fsync, replace, rename = os.fsync, os.replace, os.rename

    def logged_fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def logged_replace(src, dst, *a, **k):
        log.append(("rename", f"{os.path.realpath(src)} -> {os.path.realpath(dst)}"))
        return replace(src, dst, *a, **k)

    def logged_rename(src, dst, *a, **k):
        log.append(("rename", f"{os.path.realpath(src)} -> {os.path.realpath(dst)}"))
        return rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    monkeypatch.setattr(os, "rename", logged_rename)
    return log


def synced_before_published(calls, src: str, dst: str) -> None:
    """`src` was fsynced, then renamed to `dst`, then dst's folder was fsynced."""
    rename = calls.index(("rename", f"{src} -> {dst}"))
    assert ("fsync", src) in calls[:rename], f"{src} renamed to {dst} before its bytes were synced: {calls}"
    assert ("fsync", os.path.dirname(dst)) in calls[rename:], f"{dst}'s folder not synced after the rename: {calls}"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds a descriptor's path in /proc")
def test_an_atomic_write_syncs_the_file_then_its_folder(tmp_path, calls):
    target = tmp_path / "out.json"
    atomic.write_json(target, {"a": 1})
    (rename,) = [c for _, c in calls if "->" in c]
    synced_before_published(calls, rename.split(" -> ")[0], str(target.resolve()))
    assert target.read_text() == '{\n  "a": 1\n}\n'


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds a descriptor's path in /proc")
def test_a_checkpoint_folder_is_synced_whole_before_it_is_published(tmp_path, calls):
    run = tmp_path / "run"
    Trainer(TrainConfig(preset="tiny-gpt2", data=[str(DEMO_DATA / "001.txt")], out=str(run), cache_dir=str(tmp_path),
                        steps=1, batch_size=2, seq_len=16, save_every=1, threads=1, progress=False,
                        sample_tokens=0)).run()
    final = (run / "checkpoints" / "step-00000001").resolve()
    publish = next(i for i, (call, what) in enumerate(calls) if call == "rename" and what.endswith(f"-> {final}"))
    tmp = Path(calls[publish][1].split(" -> ")[0])
    synced = {what for call, what in calls[:publish] if call == "fsync"}
    for f in final.iterdir():  # each file of the folder, by its name in the temporary folder
        assert str(tmp / f.name) in synced, f"{f.name} not synced before the checkpoint was published"
    assert str(tmp) in synced, "the temporary folder's entries not synced before it was renamed"
    assert ("fsync", str(final.parent)) in calls[publish:], "checkpoints/ not synced after the rename"
