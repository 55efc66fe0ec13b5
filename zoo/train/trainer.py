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

A distributed run (several processes, its ranks, under mpirun, srun or `zoo launch`; a
distributed.Group) splits every global batch across the ranks (data.batch_share), sums their
gradients in place in the arena, and clips by the norm of the sum; every rank then holds the
same weights. Rank 0 alone owns the run folder: it takes the lock, reads the checkpoint it resumes
from and sends the others what they need (the model, the weights, the moments), and writes
every file; the other ranks never open anything in it. docs/distributed.md.
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
import zlib
from collections import Counter
from pathlib import Path
from typing import Annotated, Callable, Optional

import numpy as np
from pydantic import BaseModel, Field

from ..core.atomic import fsync_dir, fsync_file, named, temp_file_pid, write_json
from ..core.native import get_threads, set_threads
from ..arch.presets import preset
from ..io import load
from ..io.load import load_model
from ..io.run_folder import CHECKPOINTS, OPTIMIZER_FILE, STATE_FILE, checkpoint_dirs, checkpoint_name, latest_checkpoint
from ..model import Model
from .data import DataError, all_token_ids, batch_share, batches_for, tokenize_files
from .distributed import Group, shard_bounds
from ..core.errors import CheckpointError, DistributedError, ResourceError
from .evaluate import validation_loss
from ..core.files import read_json_model
from ..io.hf_config import CONFIG_FILE
from ..arch.memory import available_memory_bytes, describe, human_bytes
from ..io.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ..core.gemm import check_precision, products_report
from .plot import METRICS_FILE, PLOT_FILE, read_records
from .preference_step import PreferenceRun
from ..io.safetensors import INDEX_FILE, Pieces, SafetensorsFile, write_file
from ..text.tokenizers import TOKENIZER_FILES, has_tokenizer
from .config import BUDGET_FIELDS, TrainConfig
from ..arch.layout import num_parameters

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
    threads: Optional[Annotated[int, Field(gt=0, strict=True)]] = None  # per rank
    ranks: Optional[Annotated[int, Field(gt=0, strict=True)]] = None  # None: written before distributed runs, 1
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

    def __init__(self, cfg: TrainConfig, group: Optional[Group] = None):
        """group: the ranks of a distributed run (distributed.world()); None for one process."""
        self.cfg = cfg
        self.group = group
        self.writer = group is None or group.is_root  # the one process that touches the run folder
        # Absolute, so the messages name the run folder in full: a relative `out:` in a config
        # file resolves against the file's folder, which may not be where the user looks.
        self.out = Path(os.path.abspath(cfg.out))
        self.log_path: Optional[Path] = None  # train.log, set once this run owns the folder
        self._early_lines: list[str] = []  # what was said before that
        self._lock = None  # the open lock file of --out while this run uses it
        self.last_checkpoint: Optional[Path] = None  # named by a fault report from the start
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

        cfg, group = self.cfg, self.group
        if cfg.threads is not None:
            set_threads(cfg.threads)
        elif group is not None and "OMP_NUM_THREADS" not in os.environ:
            set_threads(group.default_threads())
        self.threads = get_threads()

        check_precision(cfg.precision)  # before any weights are read
        resume_from = None
        if self.writer:
            self._lock = lock_run_folder(self.out)
            left = remove_leftovers(self.out)  # before this run writes anything
            if left:
                self.say(f"note: removed what an interrupted run left in {self.out}: {', '.join(left)}")
            _check_writable(self.out)
            resume_from = self._check_run_folder()
            self._check_memory_up_front()
            self.model, self.tokenizer, self.tokenizer_dir = self._load_model(resume_from)
            self.chat_template = self._chat_template()
        resuming = resume_from is not None
        if group is not None:
            resuming = self._join_model(resuming)
        self.model.check_trainable()  # a forward-only block stops the run here, before any data work
        self.model.set_precision(cfg.precision)
        self._check_fit()
        if cfg.checkpointing:
            self.model.set_checkpointing(True)
        self._plan_ranks()

        # Preference methods (--method dpo, ipo, orpo, simpo): pairs, their objective and reference
        # (preference_step.py); its hooks below are the lines that test self.preference.
        self.preference = PreferenceRun(self, resuming) if cfg.method != "sft" else None
        if self.preference is not None:
            self.token_file, self.windows = self.preference.pair_file, self.preference.splits
        else:
            self.token_file = tokenize_files(cfg.data, self.tokenizer, cfg.cache_dir, self.chat_template,
                                             vocab_size=self.model.config.vocab_size)
            self.windows = batches_for(self.token_file, cfg.batch_size, cfg.seq_len, cfg.val_fraction,
                                       cfg.eval_batches, cfg.seed, f"data {', '.join(cfg.data)}",
                                       cfg.train_on_everything)
        # what a resumed run must find again: the same tokens, masked the same way
        self.data_key = self.token_file.key + (":all-tokens" if cfg.train_on_everything else "")
        if group is not None:
            self._check_same_data()
        self.total_steps = cfg.total_steps(self.windows.n_train)
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
        self.eval_every = cfg.eval_interval(self.total_steps)
        self.print_every = cfg.print_interval(self.total_steps)

        self.step = 0
        self.last_checkpoint: Optional[Path] = None
        self.last_val_loss: Optional[float] = None
        if resuming:
            self._restore(resume_from)
            if self.writer:
                self._prune()
        elif self.writer:
            self._clear_run()  # only now that everything above has been checked
        if self.writer:
            self._start_log()

    # --- the ranks of a distributed run ---------------------------------------------------

    def _join_model(self, resuming: bool) -> bool:
        """Rank 0 has loaded the model and tokenizer (from a checkpoint, --from, or new); the
        other ranks build the same from its model config and tokenizer files, then every rank
        takes rank 0's weights. Returns whether the run resumes (rank 0 knows)."""
        import tempfile

        from ..text.chat_template import ChatTemplate
        from ..arch.config import ModelConfig
        from ..text.tokenizers import Tokenizer

        group = self.group
        sent = None
        if group.is_root:
            template = self.chat_template
            sent = {"model": self.model.config.model_dump(), "tokenizer": _tokenizer_source(self.tokenizer_dir),
                    "resuming": resuming, "chat_template": None if template is None else
                    (template.source, template.origin, template.bos_token, template.eos_token)}
        sent = group.broadcast("the model's settings", sent)
        if not group.is_root:
            if self.cfg.lora:  # each rank reads the frozen base itself; rank 0 sends the adapters below
                self.model = self._load_lora_model(None)[0]
            else:
                self.model = Model(ModelConfig.model_validate(sent["model"]), seed=None, ad=self.cfg.ad)
            self.tokenizer_dir = None
            self.chat_template = None if sent["chat_template"] is None else ChatTemplate(*sent["chat_template"])
            source = sent["tokenizer"]
            if source is None:
                self.tokenizer = Tokenizer.byte_level()
            else:  # written where this rank alone reads it, never into the run folder
                main, files = source
                with tempfile.TemporaryDirectory(prefix="zoo-tokenizer-") as tmp:
                    for name, content in files.items():
                        (Path(tmp) / name).write_bytes(content)
                    self.tokenizer = Tokenizer.from_pretrained(Path(tmp) / main if main else tmp)
        group.broadcast_block("the weights", self.model.parameter_block())
        return sent["resuming"]

    def _plan_ranks(self) -> None:
        """This rank's share of each global batch, and, in a distributed run, the gradient
        region it reduces and the shards: of the clipping norm's sum, and under ZeRO-1 of the
        AdamW moments (set before the moments exist, so only the shard is ever allocated)."""
        cfg, group = self.cfg, self.group
        rank, ranks = (0, 1) if group is None else (group.rank, group.size)
        try:
            self.share = batch_share(cfg.batch_size, cfg.grad_accum, rank, ranks)
        except DataError as e:
            raise self._everyone(e) from None
        self.zero = bool(cfg.zero) and group is not None
        if group is None:
            if cfg.zero:
                self.say("note: --zero 1 shards the AdamW moments across the ranks of a distributed run; "
                         "this run is one process, which keeps them all")
            return
        # Every gradient is reduced. A run that trains only some parameters (LoRA adapters) would
        # reduce only theirs: this region, which the shards below divide.
        self.reduced = (0, self.model.n_params)
        try:
            self.bounds = shard_bounds(*self.reduced, ranks)
        except DistributedError as e:
            raise self._everyone(e) from None
        self.my_shard = (self.bounds[rank], self.bounds[rank + 1])
        if self.zero:
            self.model.set_moment_range(*self.my_shard)
        group.fault_context = self._fault_context
        if self.writer:
            group.on_fault = lambda message: self._record(f"error: {message}")

    def _fault_context(self) -> str:
        if self.last_checkpoint is None:
            return "; no checkpoint had been written"
        return (f"; the last checkpoint is {self.last_checkpoint}: continue with the same command and --resume")

    def _everyone(self, e: Exception) -> Exception:
        """An error every rank raises at the same point, from the same values: rank 0 reports
        it, and the ranks end together (no abort)."""
        if self.group is not None:
            self.group.agreed_stop = True
        return e

    def _check_same_data(self) -> None:
        """Every rank tokenized its own copy of the data (each host reads its own files): all
        must hold the same token stream (compared by length and checksum; the cache key would
        differ with the files' times on another host)."""
        tokens = self.token_file.tokens
        mine = (len(tokens), zlib.crc32(tokens) if len(tokens) else 0)
        seen = self.group.gather("the data check", mine)
        differ = [r for r, got in enumerate(seen) if got != seen[0]]
        if differ:
            counts = ", ".join(f"rank {r}: {seen[r][0]:,} tokens" for r in [0, *differ])
            raise self._everyone(DistributedError(
                f"rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} read other data than rank 0 "
                f"from {', '.join(self.cfg.data)} ({counts}, or the same count with other ids); every host needs the "
                "same data at the same path"))

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
        keeps it whatever happens to the console). Rank 0's alone in a distributed run."""
        if not self.writer:
            return
        self._record(msg)
        _log(msg)

    def _record(self, line: str) -> None:
        """A line for train.log only; held back until the run owns its folder (see _start_log),
        so a refused run never writes into another run's log."""
        if not self.writer:
            return
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
        from ..text.tokenizers import Tokenizer

        cfg = self.cfg
        if cfg.lora:
            return self._load_lora_model(resume_from)
        if resume_from is not None or cfg.from_dir is not None:
            src = resume_from if resume_from is not None else finetune_source(cfg.from_dir).model
            model = load_model(load.resolve(src), Model, ad=cfg.ad)
            tok_dir = Path(cfg.tokenizer) if cfg.tokenizer and resume_from is None else src
            if not cfg.tokenizer and not has_tokenizer(tok_dir) and cfg.data and all_token_ids(cfg.data):
                return model, None, None  # token ids need no tokenizer, and this checkpoint has none
            return model, Tokenizer.from_pretrained(tok_dir), tok_dir
        if cfg.model is not None:
            model_cfg = cfg.model
        else:
            model_cfg = preset(cfg.preset or "tiny-llama")
        model = Model(model_cfg, seed=cfg.seed, ad=cfg.ad)
        if cfg.tokenizer:
            return model, Tokenizer.from_pretrained(cfg.tokenizer), Path(cfg.tokenizer)
        return model, Tokenizer.byte_level(), None

    def _check_memory_up_front(self) -> None:
        """The run's memory estimate against what the machine has, from the model's config alone,
        before any weight is read or arena mapped (memory.check_finetune_fits)."""
        from ..arch.memory import check_finetune_fits

        cfg = self.cfg
        if cfg.from_dir is not None:
            model_cfg, what = load.config_of(finetune_source(cfg.from_dir)), f"finetuning {cfg.from_dir}"
        else:
            model_cfg = cfg.model or preset(cfg.preset or "tiny-llama")
            what = f"training {cfg.preset or 'the model config'}"
        rows = cfg.batch_size if self.group is None else -(-cfg.batch_size // self.group.size)
        ranks = 1 if self.group is None else self.group.size
        need = check_finetune_fits(model_cfg, rows, cfg.seq_len, cfg.checkpointing, cfg.precision, cfg.lora_config(),
                                   cfg.base_dtype, what, zero_ranks=ranks if cfg.zero else 1)
        have = available_memory_bytes()
        self.say(f"memory{' per rank' if self.group is not None else ''}: {describe(need, cfg.base_dtype)} at batch "
                 f"{rows} x {cfg.seq_len}{' with activation checkpointing' if cfg.checkpointing else ''}"
                 + (f"; {human_bytes(have[0])} available" if have else ""))

    def _load_lora_model(self, resume_from: Optional[Path]):
        """A LoRA run: the frozen base from --from (or a new model from the preset or config, seeded),
        its adapters new or, on --resume, the checkpoint's (which also holds the tokenizer)."""
        from ..io.peft import load_adapter
        from ..text.tokenizers import Tokenizer

        cfg = self.cfg
        settings = dict(ad=cfg.ad, lora=cfg.lora_config(), base_dtype=cfg.base_dtype, precision=cfg.precision,
                        checkpointing=cfg.checkpointing)
        if cfg.from_dir is not None:
            src = finetune_source(cfg.from_dir).model
            model = load_model(load.resolve(src), Model, adapter_seed=cfg.seed, **settings)
        else:
            model = Model(cfg.model or preset(cfg.preset or "tiny-llama"), seed=cfg.seed, **settings)
            src = None
        if resume_from is not None:
            load_adapter(model, resume_from)
        tok_dir = resume_from if resume_from is not None and has_tokenizer(resume_from) else (
            Path(cfg.tokenizer) if cfg.tokenizer else src)
        if tok_dir is None:
            return model, Tokenizer.byte_level(), None
        if not cfg.tokenizer and not has_tokenizer(tok_dir) and cfg.data and all_token_ids(cfg.data):
            return model, None, None
        return model, Tokenizer.from_pretrained(tok_dir), tok_dir

    def _chat_template(self):
        """What chats in the data are rendered with: the tokenizer folder's template, else zoo's
        fallback (docs/chat_templates.md); none where there is no tokenizer (token ids)."""
        from ..text.chat_template import FALLBACK_TEMPLATE, ChatTemplate

        if self.tokenizer_dir is not None:  # a folder, or a tokenizer file (tokenizer.model) in one
            folder = Path(self.tokenizer_dir)
            return ChatTemplate.for_folder(folder if folder.is_dir() else folder.parent)
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

    def _restore(self, ckpt: Optional[Path]) -> None:
        """Go on from checkpoint ckpt. In a distributed run rank 0 alone reads it (the others get
        None) and sends the others where the run is, and the AdamW moments: all of them, or
        under ZeRO-1 each rank its shard, read piece by piece from the file."""
        group = self.group
        where = None
        if self.writer:
            state = load_state(ckpt)
            if state.data_key != self.data_key:
                raise TrainError(f"--resume: the data or tokenizer changed since {ckpt} was written; "
                                 "resume needs the same data (or start a new run)")
            self._check_budget(state)
            if state.threads != self.threads:
                self.say(f"note: the run used {state.threads} threads, this one {self.threads}: "
                         "losses may differ from an uninterrupted run in the last bits")
            ranks = 1 if group is None else group.size
            if (state.ranks or 1) != ranks:
                self.say(f"note: the run used {state.ranks or 1} rank(s), this one {ranks}: the batches are the same "
                         "(they depend on the global batch only), their gradients are summed in another order, so "
                         "losses may differ from an uninterrupted run in the last bits")
            where = (state.step, state.optimizer_step, state.val_loss, str(ckpt))
        if group is not None:
            where = group.broadcast("the checkpoint's state", where)
        step, optimizer_step, val_loss, ckpt_name = where
        self._restore_moments(Path(ckpt_name) / OPTIMIZER_FILE)
        self.model.set_optimizer_step(optimizer_step)
        self.step = step
        self.last_checkpoint = Path(ckpt_name)
        self.last_val_loss = val_loss
        if self.writer:
            self._truncate_metrics(self.step)

    def _restore_moments(self, path: Path) -> None:
        opt, group = self.model.optimizer_state(), self.group
        if self.zero:
            for name in ("m", "v"):
                what = f"the AdamW moments ({name}) from the checkpoint"
                if not self.writer:
                    group.shards_from_root(what, opt[name], self.bounds)
                    continue
                try:
                    with SafetensorsFile(path) as f:
                        if f.info(name).shape != (self.model.n_params,):
                            raise CheckpointError(path, f"shape {list(f.info(name).shape)}, expected "
                                                        f"[{self.model.n_params}]", key=name)
                        group.shards_from_root(what, opt[name], self.bounds,
                                               read=lambda b, e, name=name: f.read_flat(name, b, e))
                except ValueError as e:
                    raise TrainError(f"--resume: {e}") from None
            return
        if self.writer:
            try:
                with SafetensorsFile(path) as f:
                    f.copy_into("m", opt["m"])
                    f.copy_into("v", opt["v"])
            except ValueError as e:
                raise TrainError(f"--resume: {e}") from None
        if group is not None:
            group.broadcast_block("the AdamW moments (m) from the checkpoint", opt["m"])
            group.broadcast_block("the AdamW moments (v) from the checkpoint", opt["v"])

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
            old_handlers = self._catch_sigint(interrupted)
            try:
                loss = self._train(interrupted, on_step)
                if self.writer:
                    self._publish(self.last_checkpoint)
            except BaseException as e:
                if self.writer:
                    self._stopped(e)
                raise
            finally:
                for signum, handler in old_handlers.items():
                    signal.signal(signum, handler)
            plot = self._plot() if self.writer else None
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

        cfg = self.cfg
        metrics = open(self.out / METRICS_FILE, "a", encoding="utf-8") if self.writer else None
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=not (cfg.progress and self.writer), file=sys.stderr)
        start_time, start_step = time.perf_counter(), self.step
        loss = None
        try:
            if self.step == 0:
                self._evaluate(metrics)
            while self.step < self.total_steps:
                step = self.step
                lr = lr_at(cfg, step, self.total_steps)
                loss, grad_norm, stop = self._step(step, lr, interrupted)
                self.step = done = step + 1

                elapsed = time.perf_counter() - start_time
                tok_s = (done - start_step) * self.tokens_per_step / max(elapsed, 1e-9)
                last = done == self.total_steps
                pref = self.preference.step_metrics() if self.preference is not None else {}
                if done % cfg.log_every == 0 or last:
                    self._write(metrics, {"step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                          "tokens": done * self.tokens_per_step, "tokens_per_s": round(tok_s, 1),
                                          **pref})
                shown = (f"  rewards/margins {pref['rewards/margins']:.3f}  rewards/accuracies "
                         f"{pref['rewards/accuracies']:.2f}" if pref else "")
                bar.set_postfix_str(f"loss {loss:.4f}{shown}  {tok_s:,.0f} tok/s"
                                    + (f"  val {self.last_val_loss:.4f}" if self.last_val_loss is not None else ""),
                                    refresh=False)
                bar.update(1)
                if last or (self.eval_every and done % self.eval_every == 0):
                    self._evaluate(metrics)
                if done % self.print_every == 0 or last:
                    line = (f"step {done}/{self.total_steps}: loss {loss:.4f}, lr {lr:.3g}, {tok_s:,.0f} tok/s"
                            + (f", rewards/margins {pref['rewards/margins']:.4f}, rewards/accuracies "
                               f"{pref['rewards/accuracies']:.3f}" if pref else "")
                            + (f", val loss {self.last_val_loss:.4f}" if self.last_val_loss is not None else ""))
                    if cfg.progress:
                        self._record(line)  # the bar shows the same on the console
                    else:
                        self.say(line)
                if last or (cfg.save_every and done % cfg.save_every == 0):
                    self.save_checkpoint()
                if on_step is not None:
                    on_step(done, loss)
                # Ctrl-C: one process stops after this step; the ranks of a distributed run after
                # the step whose exchange carried it, all at the same one.
                if stop if self.group is not None else interrupted.is_set():
                    self.save_checkpoint()
                    raise self._everyone(TrainInterrupted(done, self.last_checkpoint))
        finally:
            bar.close()
            if metrics is not None:
                metrics.close()
        return loss

    def _step(self, step: int, lr: float, interrupted: threading.Event) -> tuple[float, float, bool]:
        """Optimizer step `step` (0-based): this rank's share of the global batch forward and
        back, in a distributed run the exchange, then AdamW. Returns the loss, the gradient norm
        before clipping, and whether to stop after this step (Ctrl-C, on any rank)."""
        cfg, model, share = self.cfg, self.model, self.share
        model.zero_grads()
        loss = 0.0
        lo, hi = share.rows
        for micro in share.micros:
            if self.preference is not None:  # its slice [lo, hi) of the micro-batch's pairs
                loss += self.preference.micro_step(model, step, micro, lo, hi, 1.0 / cfg.grad_accum)
                continue
            batch = self.windows.train_batch(step, micro)
            scale = share.scale
            if hi - lo != cfg.batch_size:
                part = batch.rows(lo, hi)
                if batch.positions is not None:
                    # Packed rows carry loss on different numbers of tokens: a slice's mean counts
                    # as its share of the micro-batch's tokens, as one process would count it.
                    scale *= (cfg.batch_size / (hi - lo)) * part.targets() / batch.targets()
                batch = part
            loss += model.forward_backward(batch.x, batch.y, scale, positions=batch.positions) * scale
        norm, stop = None, interrupted.is_set()
        if self.group is not None:
            loss, norm, stop = self._exchange(step + 1, loss, stop)
        if not math.isfinite(loss):
            raise self._diverged("loss", loss, step + 1)
        if norm is not None and not math.isfinite(norm):
            raise self._diverged("gradient norm", norm, step + 1)
        grad_norm = model.adamw_step(lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.max_grad_norm or None,
                                     grad_norm=norm)
        if self.zero:  # each rank updated its shard of the weights: every rank gets all of them
            self.group.all_gather(f"the weights of step {step + 1}", model.parameter_block(), self.bounds)
        if not math.isfinite(grad_norm):
            raise self._diverged("gradient norm", grad_norm, step + 1)
        return loss, grad_norm, stop

    def _exchange(self, n: int, loss: float, stop: bool) -> tuple[float, float, bool]:
        """Step n's gradients summed across the ranks, in place in the arena (all of them on
        every rank; under ZeRO-1 each rank's shard on its owner), and the global loss, gradient
        norm and stop flag from every rank's part."""
        group, model = self.group, self.model
        group.test_fault(n, model.parameter_block())
        what = f"the gradient exchange of step {n}"
        if self.zero:
            model.reduce_gradients(lambda block: group.reduce_to_owners(what, block, self.bounds))
        else:
            lo, hi = self.reduced
            model.reduce_gradients(lambda block: group.all_reduce(what, block[lo:hi]))
        # Each rank squares its shard of the summed gradients (all hold the whole sum without
        # ZeRO; a shard each is 1/N of the pass): the parts add up to the global norm's square.
        part = model.grad_sum_squares(*self.my_shard)
        pref = self.preference.take_sums() if self.preference is not None else []  # its metrics' sums
        total_loss, sum_squares, stops, *pref = group.sum(f"the loss of step {n}", [loss, part, float(stop), *pref])
        if self.preference is not None:
            self.preference.put_sums(pref)
        return float(total_loss), math.sqrt(sum_squares), stops > 0

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

    def _catch_sigint(self, flag: threading.Event) -> dict:
        """First Ctrl-C: finish the step, save, stop. A second one stops at once. The ranks of a
        distributed run take SIGUSR1 as their Ctrl-C: mpirun forwards it to every rank (zoo
        launch sends it on a Ctrl-C), where a SIGINT would end the job. Returns the handlers
        replaced, by signal."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum, frame):
            flag.set()
            self.say("Ctrl-C: saving a checkpoint after this step (press again to stop at once)")
            signal.signal(signal.SIGINT, signal.default_int_handler)

        replaced = {signal.SIGINT: signal.signal(signal.SIGINT, handler)}
        if self.group is not None:
            replaced[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, handler)
        return replaced

    def _diverged(self, what: str, value, step: int) -> TrainError:
        where = (f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint
                 else "no checkpoint had been written")
        # Every rank sees the same summed loss and norm, and the same weights: all stop here.
        return self._everyone(TrainError(f"{what} became {value} at step {step}; stopping ({where}). "
                                         "Try a lower --lr, more --warmup-steps or --max-grad-norm."))

    def _evaluate(self, metrics) -> None:
        if self.preference is not None:  # the held-out pairs: loss, rewards and accuracy
            found = self.preference.evaluate(self.model, self.group)
            if found is not None:
                self.last_val_loss, extra = found
                self._write(metrics, {"step": self.step, "val_loss": self.last_val_loss, **extra})
                self.say(f"step {self.step}: val loss {self.last_val_loss:.4f}, val_rewards/margins "
                         f"{extra['val_rewards/margins']:.4f}, val_rewards/accuracies "
                         f"{extra['val_rewards/accuracies']:.3f}")
            return
        batches = list(self.windows.val_batches())
        if not batches:
            return
        # In a distributed run the batches are dealt round robin; the sums of loss x tokens and
        # of tokens are summed with zeros, exactly: the mean is the one process's.
        rank, ranks = (0, 1) if self.group is None else (self.group.rank, self.group.size)
        sums = np.zeros(2)
        for i in range(rank, len(batches), ranks):
            loss, n_tokens = validation_loss(self.model, batches[i:i + 1])
            if n_tokens:
                sums += (loss * n_tokens, n_tokens)
        if self.group is not None:
            sums = self.group.sum(f"the evaluation at step {self.step}", sums)
        if not sums[1]:
            return
        self.last_val_loss = float(sums[0] / sums[1])
        self._write(metrics, {"step": self.step, "val_loss": self.last_val_loss})
        self.say(f"step {self.step}: val loss {self.last_val_loss:.4f}")

    @staticmethod
    def _write(metrics, record: dict) -> None:
        if metrics is None:  # a rank other than 0
            return
        try:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        except OSError as e:
            raise named(e, metrics.name) from None

    def _print_header(self) -> None:
        m, cfg = self.model, self.cfg
        share = self.share
        rows = share.rows[1] - share.rows[0]
        tf = self.token_file
        # The kernels the products will run on, as the GEMM library reports them; a bf16 run
        # whose products would get no bf16 kernel says so in a line of its own.
        products, slow_products = products_report(m.config, m.precision, rows * cfg.seq_len,
                                                  m.base_dtype if m.lora is not None else "fp32")
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        group = self.group
        trainable = f" ({m.n_params:,} trainable, in the adapters)" if m.lora is not None else ""
        self.say(f"model: {m.config.family}-style, {num_parameters(m.config):,} parameters{trainable}; {threads}"
                 f"{' per rank' if group is not None else ''}; {products}")
        if slow_products:
            self.say(slow_products)
        if group is not None:
            part = (f"{rows} of the {cfg.batch_size} sequences of every micro-batch" if rows != cfg.batch_size else
                    f"{len(share.micros)} of the {cfg.grad_accum} micro-batches of every step")
            self.say(f"distributed: {group.size} ranks on {group.hosts} host{'s' if group.hosts > 1 else ''}, each "
                     f"takes {part}; gradients summed across ranks"
                     + (f"; AdamW moments sharded (ZeRO-1), 1/{group.size} per rank" if self.zero else ""))
        if m.lora is not None:
            self.say(f"LoRA: rank {m.lora.r}, alpha {m.lora.alpha:g}, dropout {m.lora.dropout:g} on "
                     f"{', '.join(m.lora.targets or ['every linear layer'])}; the {m.base_dtype} base is frozen")
        if self.preference is not None:  # its data and objective
            for line in self.preference.describe():
                self.say(line)
        else:
            formats = ", ".join(f"{n} {kind}" for kind, n in sorted(Counter(tf.formats).items()))
            trained = (f", {int(tf.trained.sum()):,} carrying loss" + (" (--train-on-everything: all of them)"
                                                                       if self.cfg.train_on_everything else "")
                       if tf.masked else "")
            self.say(f"data: {len(tf.files)} file(s) ({formats}), {len(tf.tokens):,} tokens{trained}; "
                     f"{self.windows.describe()}{' (from cache)' if tf.reused else ''}")
        what = f"resuming at step {self.step}" if self.step else "starting"
        evals = (f"evaluation every {self.eval_every} step{'s' if self.eval_every > 1 else ''}" if self.eval_every
                 else "evaluation at start and end")
        size = (f"{cfg.batch_size * cfg.grad_accum:,} pairs" if self.preference is not None
                else f"{self.tokens_per_step:,} tokens")
        self.say(f"{what}: {self.total_steps} steps of {size}, {evals}; "
                 f"run folder {self.out}")

    # --- checkpoints ------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Write checkpoints/step-N atomically (temp folder, fsync, rename); keep the newest few.
        In a distributed run every rank calls it: they check that their weights agree, the
        ZeRO-1 shards of the moments go to rank 0, and rank 0 writes."""
        root = self.out / CHECKPOINTS
        final = root / checkpoint_name(self.step)
        if self.last_checkpoint == final:
            return final
        if self.group is not None:
            self._check_same_weights()
        if not all(np.isfinite(v).all() for v in self.model.parameters().values()):
            raise self._diverged("a parameter", "non-finite", self.step)  # never save broken weights
        opt = self.model.optimizer_state()
        if not self.writer:
            if self.zero:
                for name in ("m", "v"):
                    self.group.shards_to_root(f"the AdamW moments ({name}) of step {self.step}", opt[name], self.bounds)
            self.last_checkpoint = final
            return final
        moments = [("m", opt["m"]), ("v", opt["v"])]
        if self.zero:  # the full moments, written shard by shard as they arrive: the format of any run
            moments = [(name, Pieces((self.model.n_params,), lambda name=name: self.group.shards_to_root(
                f"the AdamW moments ({name}) of step {self.step}", opt[name], self.bounds))) for name in ("m", "v")]
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            self._save_model(tmp)
            write_file(tmp / OPTIMIZER_FILE, moments)
            write_json(tmp / STATE_FILE, {
                "step": self.step, "optimizer_step": int(opt["step"]), "total_steps": self.total_steps,
                "tokens": self.step * self.tokens_per_step, "val_loss": self.last_val_loss,
                "data_key": self.data_key, "threads": self.threads,
                "ranks": 1 if self.group is None else self.group.size,
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

    def _save_model(self, folder: Path) -> None:
        """The model into a checkpoint folder: a Hugging Face checkpoint, or a LoRA run's adapters in
        PEFT's format (naming the base they go on) with the tokenizer files."""
        from ..io.checkpoints import save_pretrained
        from ..io.peft import save_adapter
        from ..text.tokenizers import Tokenizer

        if not self.cfg.lora:
            save_pretrained(self.model, folder, tokenizer=self.tokenizer)
            return
        if isinstance(self.tokenizer, Tokenizer):
            self.tokenizer.save(folder)
        base = os.path.abspath(self.cfg.from_dir) if self.cfg.from_dir else None
        save_adapter(self.model, folder, base_model_name_or_path=base)

    def _check_same_weights(self) -> None:
        """Every rank's weights are rank 0's, bit for bit (compared by checksum): the summed
        gradients and AdamW are the same on every rank, so they stay so unless something is
        wrong; never save a checkpoint that only one rank's weights would make."""
        mine = zlib.crc32(self.model.parameter_block())
        sums = self.group.gather(f"the weight check of step {self.step}", mine)
        differ = [r for r, c in enumerate(sums) if c != sums[0]]
        if differ:
            raise self._everyone(DistributedError(
                f"after step {self.step} the weights of rank{'s' if len(differ) > 1 else ''} "
                f"{', '.join(map(str, differ))} differ from rank 0's; stopping before a checkpoint is written "
                f"({self._fault_context().lstrip('; ')})"))

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
        self._unpublish(keep=set(names))
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

    def _unpublish(self, keep: set[str]) -> None:
        """Remove the model published at the top of --out, config.json first (see _publish),
        except the files named in `keep` (about to be replaced)."""
        for last in _LAST_FILES:
            config = self.out / last
            if config.exists():
                config.unlink()
                fsync_dir(self.out)
        for p in self.out.iterdir():
            if (p.name in _MODEL_FILES or _WEIGHT_FILE.match(p.name)) and p.name not in keep and p.is_file():
                p.unlink()

    def _truncate_metrics(self, step: int) -> None:
        """Drop metric records past the checkpoint we resume from (an interrupted run wrote them),
        and lines that are no records (a line cut by a kill), each named in a note."""
        from ..core.atomic import write_bytes

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


def finetune_source(path) -> "load.Source":
    """What a run starts from (--from): a model whose weights it trains. A GGUF file and a LoRA
    adapter are refused, saying what to do instead."""
    source = load.resolve(path)
    if source.form == "gguf":
        raise load.refuse("finetune", source, f"convert it to a folder first: zoo convert {source.path} DIR, then "
                                              "--from DIR")
    if source.is_adapter:
        raise load.refuse("finetune", source, "finetune its base with --lora, or merge the adapter into it first "
                                              "(zoo merge BASE ADAPTER OUT_DIR) and finetune that")
    return source


def _tokenizer_source(path: Optional[Path]) -> Optional[tuple[Optional[str], dict[str, bytes]]]:
    """What another rank needs to load the tokenizer rank 0 loaded from `path` (None: the
    byte-level one): (the file's name, or None for a folder; the contents of the files
    Tokenizer.from_pretrained reads there)."""
    from ..text.tokenizers import ID_FILES, TOKENIZER_FILES

    if path is None:
        return None
    path = Path(path)
    folder, main = (path, None) if path.is_dir() else (path.parent, path.name)
    names = {*TOKENIZER_FILES, *ID_FILES, *([main] if main else [])}
    return main, {name: (folder / name).read_bytes() for name in sorted(names) if (folder / name).is_file()}


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, seed: int, file=None) -> None:
    """Stream a short sample (temperature 0.8, top-k 40) to `file` (stdout)."""
    from ..generate import TextStream, generate, prompt_tokens

    ids = prompt_tokens(tokenizer, prompt)
    stream = TextStream(tokenizer, ids, file=file)
    (file or sys.stdout).write(prompt)
    generate(model, ids, max_new_tokens, temperature=0.8, top_k=40, seed=seed,
             stop_ids=tokenizer.eos_ids, on_token=stream)
    stream.finish()


__all__ = ["Trainer", "TrainError", "TrainInterrupted", "DataError", "lr_at", "latest_checkpoint",
           "saved_config", "sample_text"]
