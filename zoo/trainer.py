"""One trainer for every model zoo builds: finetuning a checkpoint or training from scratch.

A step is `grad_accum` native forward+pullback calls (each adds its scaled gradients into the
arena) and one native AdamW call (global-norm clipping, decay per tensor). Nothing else in
Python touches parameters inside a step.

A run folder (--out) holds:
  checkpoints/step-NNNNNNNN/  model (Hugging Face layout) + optimizer.safetensors + trainer_state.json
  metrics.jsonl               one JSON record per logged step and per evaluation
  loss.png                    train and validation loss, written whenever the run stops
  train.log                   what the console showed (progress lines even under the bar), and the error
  config.json, model.safetensors, tokenizer files: the final model, when the run completes
  .zoo-run.lock               locked (flock) by the run using the folder: two runs never share one

Checkpoints are written to a temporary folder and renamed into place, so a step-* folder is
always complete; older ones are removed only after a newer one exists, and are renamed aside
before they are deleted, so a run killed while pruning leaves no step-* folder without its
weights. What a killed run leaves (temporary and half-deleted folders, files being replaced) is
removed when the next run takes the folder's lock. Resuming is exact:
the data order is a function of (seed, step), the schedule a function of step, and the
optimizer moments are saved bit for bit. A resume with a larger budget extends the run: from
the checkpoint on, the schedule is the one of the new total, as if the run had been planned so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Callable, Optional

import numpy as np
from pydantic import BaseModel, Field

from .atomic import fsync_dir, fsync_file, named, temp_file_pid, write_json
from .data import DataError, all_token_ids, batches_for, tokenize_files
from .errors import CheckpointError, ResourceError
from .evaluate import validation_loss
from .files import read_json_model
from .hf_config import CONFIG_FILE
from .memory import finetune_memory_bytes, human_bytes
from .gemm import check_precision, gemm_info
from .plot import METRICS_FILE, PLOT_FILE, read_records
from .safetensors_io import INDEX_FILE, SafetensorsFile, write_file
from .tokenizers import TOKENIZER_FILES, has_tokenizer
from .train_config import BUDGET_FIELDS, TrainConfig

CHECKPOINTS = "checkpoints"
LOG_FILE = "train.log"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
LOCK_FILE = ".zoo-run.lock"
# Checkpoint files that are not part of the Hugging Face model (not published to --out).
_TRAINER_FILES = {STATE_FILE, OPTIMIZER_FILE}
# Files of a model published at the top of --out, by an earlier run or this one.
_WEIGHT_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
_MODEL_FILES = {CONFIG_FILE, INDEX_FILE, *TOKENIZER_FILES, "generation_config.json"}

# What a run writes for a moment only, under names with its pid: a checkpoint being written
# (.tmp-step-N-PID) or pruned (.trash-step-N-PID), replaced checkpoints (.trash-checkpoints-PID),
# the write probe; atomic.temp_file_pid for files being replaced. Found later, they are what a
# killed run left.
_CHECKPOINT_LEFTOVER = re.compile(r"^\.(tmp|trash)-step-\d+-\d+$")
_RUN_LEFTOVER = re.compile(r"^\.(trash-checkpoints|write-test)-\d+$")


class TrainError(RuntimeError):
    """A run that cannot start or go on; the message says why and what was kept."""


class TrainInterrupted(Exception):
    """Ctrl-C: a checkpoint was saved (see .checkpoint) and the run stopped."""

    def __init__(self, step: int, checkpoint: Path):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(f"interrupted at step {step}; checkpoint saved to {checkpoint}")


# --- schedule -------------------------------------------------------------------------


def lr_at(cfg: TrainConfig, step: int, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then the schedule
    from lr down to the final lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - 1 - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    coeff = 0.5 * (1.0 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1.0 - frac
    return cfg.final_lr + (cfg.lr - cfg.final_lr) * coeff


# --- run folders ----------------------------------------------------------------------


def checkpoint_dirs(out: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders are not listed)."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def latest_checkpoint(out: str | os.PathLike) -> Optional[Path]:
    dirs = checkpoint_dirs(out)
    return dirs[-1] if dirs else None


Count = Annotated[int, Field(ge=0, strict=True)]  # strict: "5" is not a step count


class TrainerState(BaseModel):
    """trainer_state.json: what a checkpoint holds besides the weights and the moments, so that
    a resumed run goes on exactly where it stopped."""

    step: Count
    optimizer_step: Count
    total_steps: Annotated[int, Field(gt=0, strict=True)]
    tokens: Count
    val_loss: Optional[float] = None
    data_key: Annotated[str, Field(strict=True)]
    threads: Optional[Annotated[int, Field(gt=0, strict=True)]] = None
    rng: dict = {}
    config: TrainConfig


def _config_json(cfg: TrainConfig) -> dict:
    """A TrainConfig as trainer_state.json stores it (plain JSON values, field names)."""
    return json.loads(cfg.model_dump_json())


def load_state(checkpoint: Path) -> TrainerState:
    """A checkpoint's trainer_state.json, every field checked: errors name the file and the field."""
    path = checkpoint / STATE_FILE
    if not path.exists():
        raise CheckpointError(path, f"missing; {checkpoint} is not a zoo training checkpoint")
    return read_json_model(path, TrainerState, "trainer state")


def read_state(checkpoint: Path) -> dict:
    """A checkpoint's trainer_state.json as plain JSON, checked as load_state checks it."""
    return json.loads(load_state(checkpoint).model_dump_json())


def saved_config(out: str | os.PathLike) -> dict:
    """The training config stored with a run's latest checkpoint (the base for --resume)."""
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        raise TrainError(f"--resume: no checkpoint in {Path(out) / CHECKPOINTS} to resume from")
    return _config_json(load_state(ckpt).config)


def lock_run_folder(out: Path):
    """The open lock file of a run folder, locked (flock, exclusive) for as long as it stays
    open; TrainError naming the holder's pid if another process has it. The kernel drops the
    lock when its process ends, by kill -9 too, so a lock never outlives its run."""
    path = out / LOCK_FILE
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+", encoding="utf-8")  # created if missing; not emptied before it is ours
    except OSError as e:
        raise _unwritable_out(out, e) from None
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
        raise _unwritable_out(folder, e) from None


def _unwritable_out(folder: Path, e: OSError) -> OSError:
    """A filesystem error (the CLI's status 4) that names the folder and the flag."""
    return OSError(e.errno, f"cannot write there, as --out ({e.strerror or e})", str(folder))


def _discard(folder: Path, trash: Path) -> None:
    """Delete a folder in one step as others see it: renamed aside (one rename, the same
    filesystem), then deleted. A process killed on the way leaves `trash`, which the next run
    removes (remove_leftovers), never a half-deleted folder under its own name."""
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _log(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


# --- the trainer ----------------------------------------------------------------------


class Trainer:
    """Sets up a run (model, tokenizer, data, optimizer state) from a TrainConfig; `run()`
    trains it to the end of its budget."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        # Absolute, so the messages name the run folder in full: a relative `out:` in a config
        # file resolves against the file's folder, which may not be where the user looks.
        self.out = Path(os.path.abspath(cfg.out))
        self.log_path: Optional[Path] = None  # train.log, set once this run owns the folder
        self._early_lines: list[str] = []  # what was said before that
        self._lock = None  # the open lock file of --out while this run uses it
        try:
            self._set_up()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Give the run folder up (run() does when it ends): another run may take it then."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _set_up(self) -> None:
        import zoo

        cfg = self.cfg
        if cfg.threads is not None:
            zoo.set_threads(cfg.threads)
        self.threads = zoo.get_threads()

        check_precision(cfg.precision)  # before any weights are read
        self._lock = lock_run_folder(self.out)
        left = remove_leftovers(self.out)  # before this run writes anything
        if left:
            self.say(f"note: removed what an interrupted run left in {self.out}: {', '.join(left)}")
        _check_writable(self.out)
        resume_from = self._check_run_folder()
        self.model, self.tokenizer, self.tokenizer_dir = self._load_model(resume_from)
        self.model.check_trainable()  # a forward-only block stops the run here, before any data work
        self.model.set_precision(cfg.precision)
        self._check_fit()
        if cfg.checkpointing:
            self.model.set_checkpointing(True)

        self.token_file = tokenize_files(cfg.data, self.tokenizer, cfg.cache_dir, self._chat_template(),
                                         vocab_size=self.model.config.vocab_size)
        self.windows = batches_for(self.token_file, cfg.batch_size, cfg.seq_len, cfg.val_fraction, cfg.eval_batches,
                                   cfg.seed, f"data {', '.join(cfg.data)}", cfg.train_on_everything)
        # what a resumed run must find again: the same tokens, masked the same way
        self.data_key = self.token_file.key + (":all-tokens" if cfg.train_on_everything else "")
        self.total_steps = cfg.total_steps(self.windows.n_train)
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
        self.eval_every = cfg.eval_interval(self.total_steps)
        self.print_every = cfg.print_interval(self.total_steps)

        self.step = 0
        self.last_checkpoint: Optional[Path] = None
        self.last_val_loss: Optional[float] = None
        if resume_from is not None:
            self._restore(resume_from)
            self._prune()
        else:
            self._clear_run()  # only now that everything above has been checked
        self._start_log()

    def _clear_run(self) -> None:
        """A fresh run: drop what an earlier run left (checkpoints and model only with --overwrite)."""
        if latest_checkpoint(self.out) is not None:
            self.say(f"--overwrite: replacing the run in {self.out}")
            # The model at the top of --out goes too, unless it is the one this run starts from
            # (--from the same folder): its tokenizer and generation files are copied from there.
            if self.cfg.from_dir is None or Path(os.path.abspath(self.cfg.from_dir)) != self.out:
                self._unpublish(keep=set())
            _discard(self.out / CHECKPOINTS, self.out / f".trash-{CHECKPOINTS}-{os.getpid()}")
        for name in (METRICS_FILE, PLOT_FILE, LOG_FILE):
            (self.out / name).unlink(missing_ok=True)

    # --- what the console shows, and train.log ----------------------------------------

    def say(self, msg: str) -> None:
        """A console line (above the progress bar), also written to train.log (first: the log
        keeps it whatever happens to the console)."""
        self._record(msg)
        _log(msg)

    def _record(self, line: str) -> None:
        """A line for train.log only; held back until the run owns its folder (see _start_log),
        so a refused run never writes into another run's log."""
        if self.log_path is None:
            self._early_lines.append(line)
            return
        try:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as e:
            raise named(e, self.log_path) from None

    def _start_log(self) -> None:
        """From here on lines go to train.log: appended for a resumed run (one log for the
        whole run, like metrics.jsonl), a new file for a fresh one (_clear_run removed the old)."""
        self.log_path = self.out / LOG_FILE
        early, self._early_lines = self._early_lines, []
        for line in early:
            self._record(line)

    # --- setup ------------------------------------------------------------------------

    def _check_run_folder(self) -> Optional[Path]:
        """The checkpoint to resume from (None for a fresh run); refuses to mix runs."""
        ckpt = latest_checkpoint(self.out)
        if not self.cfg.resume:
            if ckpt is not None and not self.cfg.overwrite:
                raise TrainError(f"--out {self.out} already holds a run (checkpoint {ckpt.name}); "
                                 "pass --resume to continue it, --overwrite to replace it, or another --out")
            return None
        if ckpt is None:
            raise TrainError(f"--resume: no checkpoint in {self.out / CHECKPOINTS} to resume from")
        saved = load_state(ckpt).config
        # A larger budget extends the run; _check_budget decides once the step count is known.
        changed = [k for k in self.cfg.trajectory_diff(saved) if k not in BUDGET_FIELDS]
        if changed:
            a, b = self.cfg.model_dump(), saved.model_dump()
            detail = "; ".join(f"{k}: {b[k]!r} -> {a[k]!r}" for k in changed)
            raise TrainError(f"--resume: these settings differ from the run in {self.out} and would change "
                             f"its losses: {detail}")
        return ckpt

    def _load_model(self, resume_from: Optional[Path]):
        """(model, tokenizer, tokenizer folder or None) for a resumed, finetuned or new run."""
        import zoo
        from .checkpoints import load_pretrained
        from .tokenizers import Tokenizer

        cfg = self.cfg
        if resume_from is not None or cfg.from_dir is not None:
            src = resume_from if resume_from is not None else Path(cfg.from_dir)
            if not src.is_dir():
                gguf = src.is_file() and src.suffix.lower() == ".gguf"
                raise TrainError(f"--from {src}: " + (f"a GGUF file; a run starts from a folder: zoo convert {src} DIR, "
                                                      "then --from DIR" if gguf else "no such checkpoint folder"))
            model = load_pretrained(src, ad=cfg.ad)
            tok_dir = Path(cfg.tokenizer) if cfg.tokenizer and resume_from is None else src
            if not cfg.tokenizer and not has_tokenizer(tok_dir) and cfg.data and all_token_ids(cfg.data):
                return model, None, None  # token ids need no tokenizer, and this checkpoint has none
            return model, Tokenizer.from_pretrained(tok_dir), tok_dir
        if cfg.model is not None:
            model_cfg = cfg.model
        else:
            model_cfg = zoo.preset(cfg.preset or "tiny-llama")
        model = zoo.Model(model_cfg, seed=cfg.seed, ad=cfg.ad)
        if cfg.tokenizer:
            return model, Tokenizer.from_pretrained(cfg.tokenizer), Path(cfg.tokenizer)
        return model, Tokenizer.byte_level(), None

    def _chat_template(self):
        """What chats in the data are rendered with: the tokenizer folder's template, else zoo's
        fallback (docs/chat_templates.md); none where there is no tokenizer (token ids)."""
        from .chat_template import FALLBACK_TEMPLATE, ChatTemplate

        if self.tokenizer_dir is not None:
            return ChatTemplate.for_folder(self.tokenizer_dir)
        if self.tokenizer is None:
            return None
        return ChatTemplate(FALLBACK_TEMPLATE, "zoo's fallback chat template (training from scratch)",
                            self.tokenizer.bos_token, self.tokenizer.eos_token)

    def _check_fit(self) -> None:
        mc, cfg = self.model.config, self.cfg
        where = cfg.from_dir or cfg.preset or "the model config"
        if self.tokenizer is not None and self.tokenizer.vocab_size > mc.vocab_size:
            tok = cfg.tokenizer or self.tokenizer_dir or "the byte-level tokenizer"
            raise TrainError(f"tokenizer {tok}: its vocabulary has {self.tokenizer.vocab_size} tokens but the model "
                             f"({where}) has vocab_size {mc.vocab_size}; use the tokenizer the model was trained with")
        if cfg.seq_len > mc.max_seq_len:
            raise TrainError(f"seq_len: {cfg.seq_len} is beyond the model's max_seq_len {mc.max_seq_len} ({where})")

    def _restore(self, ckpt: Path) -> None:
        state = load_state(ckpt)
        if state.data_key != self.data_key:
            raise TrainError(f"--resume: the data or tokenizer changed since {ckpt} was written; "
                             "resume needs the same data (or start a new run)")
        self._check_budget(state)
        if state.threads != self.threads:
            self.say(f"note: the run used {state.threads} threads, this one {self.threads}: "
                     "losses may differ from an uninterrupted run in the last bits")
        opt = self.model.optimizer_state()
        path = ckpt / OPTIMIZER_FILE
        try:
            with SafetensorsFile(path) as f:
                f.copy_into("m", opt["m"])
                f.copy_into("v", opt["v"])
        except ValueError as e:
            raise TrainError(f"--resume: {e}") from None
        self.model.set_optimizer_step(state.optimizer_step)
        self.step = state.step
        self.last_checkpoint = ckpt
        self.last_val_loss = state.val_loss
        self._truncate_metrics(self.step)

    def _check_budget(self, state: TrainerState) -> None:
        """A resumed run's budget: the one it was planned with (an exact resume), or a larger one
        (the run is extended: from the checkpoint on, the learning rate follows the schedule of
        the new total, as if the run had been planned with it). It cannot shrink."""
        step, planned, total = state.step, state.total_steps, self.total_steps
        given = next((name for name in BUDGET_FIELDS if getattr(self.cfg, name) is not None), None)
        budget = f"--{given} {getattr(self.cfg, given):g}" if given else f"the default {total} steps"
        if given in ("epochs", "tokens"):
            budget += f" ({total} steps)"
        if total == planned:
            if step == planned:  # finished (or stopped after its last step): publish and plot again
                self.say(f"note: the run in {self.out} is complete at step {step}: nothing to train; "
                         "give a larger --steps, --epochs or --tokens to extend it")
            return
        if total <= step:
            raise TrainError(f"--resume: {budget} ends at or before step {step}, where the run in {self.out} "
                             "already is; a run cannot be shrunk (give a larger budget to extend it)")
        if total < planned:
            raise TrainError(f"--resume: {budget} is fewer than the {planned} steps the run in {self.out} was "
                             "planned for; a run's budget can only grow")
        # Steps counted from 1 as on the console and in metrics.jsonl: step n uses lr_at(n - 1).
        self.say(f"extending the run in {self.out} from {planned} to {total} steps: the learning rate follows "
                 f"the schedule for {total} steps from here on (step {step + 1}: lr {lr_at(self.cfg, step, total):.3g}; "
                 f"step {step} had {lr_at(self.cfg, step - 1, planned):.3g})")

    # --- the loop ---------------------------------------------------------------------

    def run(self, on_step: Optional[Callable[[int, float], None]] = None) -> dict:
        """Train to the end of the budget. on_step(step, loss) runs after each step (tests, notebooks).
        Raises TrainInterrupted after Ctrl-C (checkpoint saved) and TrainError on divergence.
        However it stops, loss.png and train.log are written and the last line names the run folder;
        then the run folder is given up (close)."""
        try:
            self._print_header()
            interrupted = threading.Event()
            old_handler = self._catch_sigint(interrupted)
            try:
                loss = self._train(interrupted, on_step)
                self._publish(self.last_checkpoint)
            except BaseException as e:
                self._stopped(e)
                raise
            finally:
                if old_handler is not None:
                    signal.signal(signal.SIGINT, old_handler)
            plot = self._plot()
            self.say(f"done: step {self.step}"
                     + (f", train loss {loss:.4f}" if loss is not None else "")
                     + (f", val loss {self.last_val_loss:.4f}" if self.last_val_loss is not None else "")
                     + f"; the final model{', ' + PLOT_FILE if plot else ''} and {LOG_FILE} are in {self.out}")
            return {"step": self.step, "loss": loss,
                    "val_loss": self.last_val_loss, "checkpoint": self.last_checkpoint, "plot": plot}
        finally:
            self.close()

    def _train(self, interrupted: threading.Event, on_step) -> Optional[float]:
        """The steps from self.step to the end of the budget; the last step's loss."""
        from tqdm import tqdm

        cfg, model, windows = self.cfg, self.model, self.windows
        metrics = open(self.out / METRICS_FILE, "a", encoding="utf-8")
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=not cfg.progress, file=sys.stderr)
        start_time, start_step = time.perf_counter(), self.step
        loss = None
        try:
            if self.step == 0:
                self._evaluate(metrics)
            scale = 1.0 / cfg.grad_accum
            while self.step < self.total_steps:
                step = self.step
                lr = lr_at(cfg, step, self.total_steps)
                model.zero_grads()
                loss = 0.0
                for micro in range(cfg.grad_accum):
                    batch = windows.train_batch(step, micro)
                    loss += model.forward_backward(batch.x, batch.y, scale, positions=batch.positions)
                loss *= scale
                if not math.isfinite(loss):
                    raise self._diverged("loss", loss, step + 1)
                grad_norm = model.adamw_step(lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay,
                                             cfg.max_grad_norm or None)
                if not math.isfinite(grad_norm):
                    raise self._diverged("gradient norm", grad_norm, step + 1)
                self.step = done = step + 1

                elapsed = time.perf_counter() - start_time
                tok_s = (done - start_step) * self.tokens_per_step / max(elapsed, 1e-9)
                last = done == self.total_steps
                if done % cfg.log_every == 0 or last:
                    self._write(metrics, {"step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                          "tokens": done * self.tokens_per_step, "tokens_per_s": round(tok_s, 1)})
                bar.set_postfix_str(f"loss {loss:.4f}  {tok_s:,.0f} tok/s"
                                    + (f"  val {self.last_val_loss:.4f}" if self.last_val_loss is not None else ""),
                                    refresh=False)
                bar.update(1)
                if last or (self.eval_every and done % self.eval_every == 0):
                    self._evaluate(metrics)
                if done % self.print_every == 0 or last:
                    line = (f"step {done}/{self.total_steps}: loss {loss:.4f}, lr {lr:.3g}, {tok_s:,.0f} tok/s"
                            + (f", val loss {self.last_val_loss:.4f}" if self.last_val_loss is not None else ""))
                    if cfg.progress:
                        self._record(line)  # the bar shows the same on the console
                    else:
                        self.say(line)
                if last or (cfg.save_every and done % cfg.save_every == 0):
                    self.save_checkpoint()
                if on_step is not None:
                    on_step(done, loss)
                if interrupted.is_set():
                    self.save_checkpoint()
                    raise TrainInterrupted(done, self.last_checkpoint)
        finally:
            bar.close()
            metrics.close()
        return loss

    def _stopped(self, e: BaseException) -> None:
        """A run that stops early still gets its plot, its log and a last line naming the run folder."""
        try:
            plot = self._plot()
            kept = [f"checkpoint {self.last_checkpoint.name}" if self.last_checkpoint else "no checkpoint",
                    *([PLOT_FILE] if plot else []), LOG_FILE]
            why = "Ctrl-C" if isinstance(e, (TrainInterrupted, KeyboardInterrupt)) else "error"
            self.say(f"stopped at step {self.step} ({why}): {', '.join(kept)} in {self.out}")
            # The caller shows the error itself (zoo's one-line message, or a traceback): the log keeps it too.
            if isinstance(e, TrainInterrupted):
                self._record(str(e))
            elif isinstance(e, KeyboardInterrupt):
                self._record("interrupted (a second Ctrl-C stops at once)")
            elif isinstance(e, (TrainError, ValueError, OSError, ResourceError)):
                self._record(f"error: {e}")
            else:
                self._record(f"error: {type(e).__name__}: {e}")
        except Exception:
            pass  # the error that stopped the run matters more than its plot or log

    def _catch_sigint(self, flag: threading.Event):
        """First Ctrl-C: finish the step, save, stop. A second one stops at once."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            flag.set()
            self.say("Ctrl-C: saving a checkpoint after this step (press again to stop at once)")
            signal.signal(signal.SIGINT, signal.default_int_handler)

        return signal.signal(signal.SIGINT, handler)

    def _diverged(self, what: str, value, step: int) -> TrainError:
        where = (f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint
                 else "no checkpoint had been written")
        return TrainError(f"{what} became {value} at step {step}; stopping ({where}). "
                          "Try a lower --lr, more --warmup-steps or --max-grad-norm.")

    def _evaluate(self, metrics) -> None:
        loss, n_tokens = validation_loss(self.model, self.windows.val_batches())
        if not n_tokens:
            return
        self.last_val_loss = loss
        self._write(metrics, {"step": self.step, "val_loss": self.last_val_loss})
        self.say(f"step {self.step}: val loss {self.last_val_loss:.4f}")

    @staticmethod
    def _write(metrics, record: dict) -> None:
        try:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        except OSError as e:
            raise named(e, metrics.name) from None

    def _print_header(self) -> None:
        m, cfg = self.model, self.cfg
        # The same estimator as zoo inspect and the model cards.
        mem = finetune_memory_bytes(m.config, cfg.batch_size, cfg.seq_len, m.checkpointing, m.precision)
        tf = self.token_file
        gemm = gemm_info()
        products = (f"bf16 products on {gemm['bf16']} ({gemm['onednn_isa']})" if m.precision == "bf16"
                    else f"fp32 products on {gemm['fp32']}")
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        self.say(f"model: {m.config.family}-style, {m.n_params:,} parameters; {threads}; {products}")
        self.say(f"memory: {human_bytes(mem.total)} = weights {human_bytes(mem.parameters)} + gradients "
                 f"{human_bytes(mem.gradients)} + AdamW moments {human_bytes(mem.optimizer)} + activations "
                 f"{human_bytes(mem.activations)} at batch {cfg.batch_size} x {cfg.seq_len}"
                 f"{' with activation checkpointing' if m.checkpointing else ''}")
        formats = ", ".join(f"{n} {kind}" for kind, n in sorted(Counter(tf.formats).items()))
        trained = (f", {int(tf.trained.sum()):,} carrying loss" + (" (--train-on-everything: all of them)"
                                                                   if self.cfg.train_on_everything else "")
                   if tf.masked else "")
        self.say(f"data: {len(tf.files)} file(s) ({formats}), {len(tf.tokens):,} tokens{trained}; "
                 f"{self.windows.describe()}{' (from cache)' if tf.reused else ''}")
        what = f"resuming at step {self.step}" if self.step else "starting"
        evals = (f"evaluation every {self.eval_every} step{'s' if self.eval_every > 1 else ''}" if self.eval_every
                 else "evaluation at start and end")
        self.say(f"{what}: {self.total_steps} steps of {self.tokens_per_step:,} tokens, {evals}; "
                 f"run folder {self.out}")

    # --- checkpoints ------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Write checkpoints/step-N atomically (temp folder, fsync, rename); keep the newest few."""
        from .checkpoints import save_pretrained

        root = self.out / CHECKPOINTS
        final = root / f"step-{self.step:08d}"
        if self.last_checkpoint == final:
            return final
        if not all(np.isfinite(v).all() for v in self.model.parameters().values()):
            raise self._diverged("a parameter", "non-finite", self.step)  # never save broken weights
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            save_pretrained(self.model, tmp, tokenizer=self.tokenizer)
            opt = self.model.optimizer_state()
            write_file(tmp / OPTIMIZER_FILE, [("m", opt["m"]), ("v", opt["v"])])
            write_json(tmp / STATE_FILE, {
                "step": self.step, "optimizer_step": int(opt["step"]), "total_steps": self.total_steps,
                "tokens": self.step * self.tokens_per_step, "val_loss": self.last_val_loss,
                "data_key": self.data_key, "threads": self.threads,
                # The data order is drawn from a generator seeded by (seed, step, micro-batch):
                # seed and step are the whole random state of the run.
                "rng": {"kind": "numpy-default_rng(seed, step, micro)", "seed": self.cfg.seed},
                "config": _config_json(self.cfg),
            })
            for f in tmp.iterdir():
                fsync_file(f)
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(root)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._unwritten(final, e) from None
        self.last_checkpoint = final
        self._prune()
        return final

    def _prune(self) -> None:
        """Keep the newest --keep-checkpoints checkpoints. After each save, and at a resume: a
        kill between a save and its pruning leaves one too many, and a run resumed at its last
        step saves nothing more."""
        root = self.out / CHECKPOINTS
        for old in checkpoint_dirs(self.out)[:-self.cfg.keep_checkpoints]:
            try:
                _discard(old, root / f".trash-{old.name}-{os.getpid()}")
            except OSError as e:  # the run goes on: an extra checkpoint costs disk, not correctness
                self.say(f"note: cannot remove the old checkpoint {old} ({e.strerror or e})")

    def _unwritten(self, final: Path, e: OSError) -> Exception:
        """The error of a checkpoint that could not be written: the file, why, and what was kept."""
        kept = (f"the previous checkpoint {self.last_checkpoint} is intact" if self.last_checkpoint
                else "no earlier checkpoint exists")
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            # weights, and the two AdamW moments, in float32
            need = 12 * self.model.n_params
            free = shutil.disk_usage(final.parent if final.parent.is_dir() else self.out).free
            return ResourceError(
                f"cannot write checkpoint {final}: no space left on the device writing {e.filename or final} "
                f"(a checkpoint takes about {human_bytes(need)}, {human_bytes(free)} is free); {kept}; "
                "free some space, or lower --keep-checkpoints, then run the same command with --resume")
        where = f"{e.filename}: " if e.filename else ""
        return TrainError(f"cannot write checkpoint {final}: {where}{e.strerror or e} ({kept})")

    def _publish(self, ckpt: Optional[Path]) -> None:
        """Put the final model at the top of --out, so the run folder itself loads in transformers
        and in `zoo finetune --from`. config.json is what makes a folder a model: it goes first
        (a folder without it is refused by every loader, naming the file), then what an earlier
        publish left that this model lacks, then each file of this model is put in place
        atomically (a hard link under a temporary name, renamed over the old), config.json
        last. A process killed on the way leaves a folder that is no model (the next --resume
        publishes again), never one whose config and weights disagree."""
        if ckpt is None:
            return
        names = sorted(f.name for f in ckpt.iterdir() if f.is_file() and f.name not in _TRAINER_FILES)
        self._unpublish(keep=set(names))
        for name in sorted(names, key=lambda n: n == CONFIG_FILE):
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

    def _unpublish(self, keep: set[str]) -> None:
        """Remove the model published at the top of --out, config.json first (see _publish),
        except the files named in `keep` (about to be replaced)."""
        config = self.out / CONFIG_FILE
        if config.exists():
            config.unlink()
            fsync_dir(self.out)
        for p in self.out.iterdir():
            if (p.name in _MODEL_FILES or _WEIGHT_FILE.match(p.name)) and p.name not in keep and p.is_file():
                p.unlink()

    def _truncate_metrics(self, step: int) -> None:
        """Drop metric records past the checkpoint we resume from (an interrupted run wrote them),
        and lines that are no records (a line cut by a kill), each named in a note."""
        from .atomic import write_bytes

        path = self.out / METRICS_FILE
        if not path.exists():
            return

        def dropped(why: str) -> None:
            self.say(f"note: {path}: {why}; dropped")

        kept = [line for line, rec in read_records(path, on_bad_line=dropped) if rec.step <= step]
        write_bytes(path, "".join(line + "\n" for line in kept).encode("utf-8"))

    def _plot(self) -> Optional[Path]:
        from .plot import plot_run

        try:
            return plot_run(self.out)
        except (OSError, ValueError) as e:
            self.say(f"note: no loss plot ({e})")
            return None


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, seed: int, file=None) -> None:
    """Stream a short sample (temperature 0.8, top-k 40) to `file` (stdout)."""
    from .generate import TextStream, generate, prompt_tokens

    ids = prompt_tokens(tokenizer, prompt)
    stream = TextStream(tokenizer, ids, file=file)
    (file or sys.stdout).write(prompt)
    generate(model, ids, max_new_tokens, temperature=0.8, top_k=40, seed=seed,
             stop_ids=tokenizer.eos_ids, on_token=stream)
    stream.finish()


__all__ = ["Trainer", "TrainError", "TrainInterrupted", "DataError", "lr_at", "latest_checkpoint",
           "saved_config", "sample_text"]
