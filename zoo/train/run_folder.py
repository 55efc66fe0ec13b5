"""A run folder (--out) as the run using it keeps it; its layout (where checkpoints are, what each
holds) is zoo/io/run_folder.py. A run folder holds:

  checkpoints/step-NNNNNNNN/  model (Hugging Face layout) + optimizer.safetensors + trainer_state.json
  metrics.jsonl               one JSON record per logged step and per evaluation
  loss.png                    train and validation loss, written whenever the run stops
  train.log                   what the console showed (progress lines even under the bar), and the error
  config.json, model.safetensors, tokenizer files: the final model, when the run completes
  .zoo-run.lock               locked (flock) by the run using the folder: two runs never share one

Older checkpoints are removed only after a newer one exists, and are renamed aside before they
are deleted, so a run killed while pruning leaves no step-* folder without its weights. What a
killed run leaves (temporary and half-deleted folders, files being replaced) is removed when
the next run takes the folder's lock. In a distributed run rank 0 alone has a RunFolder.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from ..core.atomic import fsync_dir, fsync_file, named, temp_file_pid, write_bytes
from ..core.errors import TrainError
from ..io.hf_config import CONFIG_FILE
from ..io.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ..io.run_folder import (
    CHECKPOINTS,
    OPTIMIZER_FILE,
    STATE_FILE,
    checkpoint_dirs,
    latest_checkpoint,
)
from ..io.safetensors import INDEX_FILE
from ..text.tokenizers import TOKENIZER_FILES
from .plot import METRICS_FILE, PLOT_FILE, plot_run, read_records
from .tensorboard import event_files

LOG_FILE = "train.log"
LOCK_FILE = ".zoo-run.lock"
# Checkpoint files that are not part of the Hugging Face model (not published to --out).
_TRAINER_FILES = {STATE_FILE, OPTIMIZER_FILE}
# Files of a model published at the top of --out, by an earlier run or this one.
_WEIGHT_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
_MODEL_FILES = {CONFIG_FILE, INDEX_FILE, *TOKENIZER_FILES, "generation_config.json", ADAPTER_CONFIG, ADAPTER_WEIGHTS}
# The file whose presence makes a published folder complete, put in place last: config.json, or
# a LoRA run's adapter_config.json.
_LAST_FILES = (CONFIG_FILE, ADAPTER_CONFIG)

# What a run writes for a moment only, under names with its pid: a checkpoint being written
# (.tmp-step-N-PID) or pruned (.trash-step-N-PID), replaced checkpoints (.trash-checkpoints-PID),
# the write probe; atomic.temp_file_pid for files being replaced. Found later, they are what a
# killed run left.
_CHECKPOINT_LEFTOVER = re.compile(r"^\.(tmp|trash)-step-\d+-\d+$")
_RUN_LEFTOVER = re.compile(r"^\.(trash-checkpoints|write-test)-\d+$")


def lock_run_folder(out: Path):
    """The open lock file of a run folder, locked (flock, exclusive) for as long as it stays
    open; TrainError naming the holder's pid if another process has it. The kernel drops the
    lock when its process ends, by kill -9 too, so a lock never outlives its run."""
    path = out / LOCK_FILE
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+", encoding="utf-8")  # created if missing; not emptied before it is ours
    except OSError as e:
        raise unwritable_out(out, e) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise TrainError(f"another zoo run is using {out} (pid {holder}); wait for it to end, "
                         "or give another --out") from None
    try:
        f.truncate(0)
        f.write(f"{os.getpid()}\n")  # for the message above, in the run refused
        f.flush()
    except OSError as e:
        f.close()
        raise named(e, path) from None
    return f


def remove_leftovers(out: Path) -> list[str]:
    """Remove what killed runs left in a run folder, and return their names. Call it holding the
    folder's lock: no live run writes there then. Files being replaced (atomic.temp_file_pid)
    are removed only when the process named in them is gone, as `zoo plot` replaces loss.png
    without the lock."""
    found = []
    root = out / CHECKPOINTS
    if root.is_dir():
        found += [p for p in root.iterdir() if _CHECKPOINT_LEFTOVER.match(p.name)]
    if out.is_dir():
        for p in out.iterdir():
            pid = temp_file_pid(p.name)
            if _RUN_LEFTOVER.match(p.name) or (pid is not None and not _process_exists(pid)):
                found.append(p)
    for p in found:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return [str(p.relative_to(out)) for p in found]


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process; or no pid at all (a name that only looks like one)
    return True


def _check_writable(folder: Path) -> None:
    try:
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise unwritable_out(folder, e) from None


def unwritable_out(folder: Path, e: OSError) -> OSError:
    """A filesystem error (the CLI's status 4) that names the folder and the flag."""
    return OSError(e.errno, f"cannot write there, as --out ({e.strerror or e})", str(folder))


def _discard(folder: Path, trash: Path) -> None:
    """Delete a folder in one step as others see it: renamed aside (one rename, the same
    filesystem), then deleted. A process killed on the way leaves `trash`, which the next run
    removes (remove_leftovers), never a half-deleted folder under its own name."""
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


class RunLog:
    """What a run says: console lines (above the progress bar), each also written to train.log.
    Rank 0's alone in a distributed run (writer); the other ranks say nothing."""

    def __init__(self, writer: bool):
        self.writer = writer
        self.path: Optional[Path] = None  # train.log, set once this run owns the folder
        self._early_lines: list[str] = []  # what was said before that

    def say(self, msg: str) -> None:
        """A console line, also written to train.log (first: the log keeps it whatever happens
        to the console)."""
        if not self.writer:
            return
        self.record(msg)
        tqdm.write(msg, file=sys.stderr)

    def record(self, line: str) -> None:
        """A line for train.log only; held back until the run owns its folder (see start), so a
        refused run never writes into another run's log."""
        if not self.writer:
            return
        if self.path is None:
            self._early_lines.append(line)
            return
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as e:
            raise named(e, self.path) from None

    def start(self, path: Path) -> None:
        """From here on lines go to `path` (train.log): appended for a resumed run (one log for
        the whole run, like metrics.jsonl), a new file for a fresh one (RunFolder.clear removed
        the old)."""
        self.path = path
        early, self._early_lines = self._early_lines, []
        for line in early:
            self.record(line)


class RunFolder:
    """The run folder of the run that holds its lock: taking it, clearing it for a fresh run,
    pruning old checkpoints, publishing the final model at its top, its metrics and plot."""

    def __init__(self, out: Path, log: RunLog):
        self.out, self.log = out, log
        self._lock = None  # the open lock file of --out while this run uses it

    def take(self) -> None:
        """Lock the folder for this run, remove what killed runs left there, check it is writable."""
        self._lock = lock_run_folder(self.out)
        left = remove_leftovers(self.out)  # before this run writes anything
        if left:
            self.log.say(f"note: removed what an interrupted run left in {self.out}: {', '.join(left)}")
        _check_writable(self.out)

    def close(self) -> None:
        """Give the folder up: another run may take it then."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def start_log(self) -> None:
        self.log.start(self.out / LOG_FILE)

    def clear(self, from_dir: Optional[str]) -> None:
        """A fresh run: drop what an earlier run left (checkpoints and model only with --overwrite).
        from_dir: the folder the run starts from (--from)."""
        if latest_checkpoint(self.out) is not None:
            self.log.say(f"--overwrite: replacing the run in {self.out}")
            # The model at the top of --out goes too, unless it is the one this run starts from
            # (--from the same folder): its tokenizer and generation files are copied from there.
            if from_dir is None or Path(os.path.abspath(from_dir)) != self.out:
                self.unpublish(keep=set())
            _discard(self.out / CHECKPOINTS, self.out / f".trash-{CHECKPOINTS}-{os.getpid()}")
        for name in (METRICS_FILE, PLOT_FILE, LOG_FILE):
            (self.out / name).unlink(missing_ok=True)
        for events in event_files(self.out):  # an earlier run's TensorBoard events (--report-to)
            events.unlink(missing_ok=True)

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` checkpoints (--keep-checkpoints). After each save, and at a
        resume: a kill between a save and its pruning leaves one too many, and a run resumed at
        its last step saves nothing more."""
        root = self.out / CHECKPOINTS
        for old in checkpoint_dirs(self.out)[:-keep]:
            try:
                _discard(old, root / f".trash-{old.name}-{os.getpid()}")
            except OSError as e:  # the run goes on: an extra checkpoint costs disk, not correctness
                self.log.say(f"note: cannot remove the old checkpoint {old} ({e.strerror or e})")

    def publish(self, ckpt: Optional[Path]) -> None:
        """Put the final model at the top of --out, so the run folder itself loads in transformers
        and in `zoo finetune --from`. config.json (a LoRA run's adapter_config.json) is what makes a
        folder a model: it goes first
        (a folder without it is refused by every loader, naming the file), then what an earlier
        publish left that this model lacks, then each file of this model is put in place
        atomically (a hard link under a temporary name, renamed over the old), config.json
        last. A process killed on the way leaves a folder that is no model (the next --resume
        publishes again), never one whose config and weights disagree."""
        if ckpt is None:
            return
        names = sorted(f.name for f in ckpt.iterdir() if f.is_file() and f.name not in _TRAINER_FILES)
        self.unpublish(keep=set(names))
        for name in sorted(names, key=lambda n: n in _LAST_FILES):
            src, dst = ckpt / name, self.out / name
            if dst.exists() and os.path.samefile(src, dst):
                continue  # published already (a rename onto the same file would do nothing)
            tmp = self.out / f".{name}.{os.getpid()}.tmp"
            try:
                tmp.unlink(missing_ok=True)
                try:
                    os.link(src, tmp)  # same filesystem: no copy; checkpoint files are never modified in place
                except OSError:
                    shutil.copyfile(src, tmp)
                    fsync_file(tmp)
                os.replace(tmp, dst)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise named(e, dst) from None
        fsync_dir(self.out)

    def unpublish(self, keep: set[str]) -> None:
        """Remove the model published at the top of --out, config.json first (see publish),
        except the files named in `keep` (about to be replaced)."""
        for last in _LAST_FILES:
            config = self.out / last
            if config.exists():
                config.unlink()
                fsync_dir(self.out)
        for p in self.out.iterdir():
            if (p.name in _MODEL_FILES or _WEIGHT_FILE.match(p.name)) and p.name not in keep and p.is_file():
                p.unlink()

    def truncate_metrics(self, step: int) -> None:
        """Drop metric records past the checkpoint we resume from (an interrupted run wrote them),
        and lines that are no records (a line cut by a kill), each named in a note."""
        path = self.out / METRICS_FILE
        if not path.exists():
            return

        def dropped(why: str) -> None:
            self.log.say(f"note: {path}: {why}; dropped")

        kept = [line for line, rec in read_records(path, on_bad_line=dropped) if rec.step <= step]
        write_bytes(path, "".join(line + "\n" for line in kept).encode("utf-8"))

    def plot(self) -> Optional[Path]:
        """loss.png from metrics.jsonl; None (and a note) where it cannot be drawn."""
        try:
            return plot_run(self.out)
        except (OSError, ValueError) as e:
            self.log.say(f"note: no loss plot ({e})")
            return None
