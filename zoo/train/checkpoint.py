"""A run's checkpoints: writing one, and reading one back to resume (the trainer state, the
weights, the AdamW moments).

Checkpoints are written to a temporary folder and renamed into place, so a step-* folder is
always complete. Resuming is exact: the data order is a function of (seed, step), the schedule a
function of step, and the optimizer moments are saved bit for bit. A resume with a larger budget
extends the run: from the checkpoint on, the schedule is the one of the new total, as if the run
had been planned so. In a distributed run rank 0 alone reads and writes checkpoints; the
others send and receive through the RankPlan (ranks.py).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
from pydantic import BaseModel, Field

from ..arch.memory import human_bytes
from ..core.atomic import fsync_dir, fsync_file, write_json
from ..core.errors import CheckpointError, ResourceError, TrainError
from ..core.files import read_json_model
from ..io.checkpoints import save_pretrained
from ..io.peft import save_adapter
from ..io.run_folder import (
    CHECKPOINTS,
    OPTIMIZER_FILE,
    STATE_FILE,
    checkpoint_name,
    latest_checkpoint,
)
from ..io.safetensors import Pieces, SafetensorsFile, write_file
from ..model import Model
from ..text.tokenizers import Tokenizer
from .config import BUDGET_FIELDS, TrainConfig, lr_at
from .ranks import RankPlan
from .run_folder import RunFolder, RunLog

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


def resume_point(cfg: TrainConfig, out: Path) -> Optional[Path]:
    """The checkpoint a run in `out` resumes from (None for a fresh run); refuses to mix runs."""
    ckpt = latest_checkpoint(out)
    if not cfg.resume:
        if ckpt is not None and not cfg.overwrite:
            raise TrainError(f"--out {out} already holds a run (checkpoint {ckpt.name}); "
                             "pass --resume to continue it, --overwrite to replace it, or another --out")
        return None
    if ckpt is None:
        raise TrainError(f"--resume: no checkpoint in {out / CHECKPOINTS} to resume from")
    saved = load_state(ckpt).config
    # A larger budget extends the run; Checkpoints._check_budget decides once the step count is known.
    changed = [k for k in cfg.trajectory_diff(saved) if k not in BUDGET_FIELDS]
    if changed:
        a, b = cfg.model_dump(), saved.model_dump()
        detail = "; ".join(f"{k}: {b[k]!r} -> {a[k]!r}" for k in changed)
        raise TrainError(f"--resume: these settings differ from the run in {out} and would change "
                         f"its losses: {detail}")
    return ckpt


class Checkpoints:
    """The checkpoints of one run: `save` writes checkpoints/step-N, `restore` goes on from one,
    `last` is the newest this run wrote or resumed from. folder: the RunFolder (rank 0's; None
    on the other ranks)."""

    def __init__(self, cfg: TrainConfig, out: Path, model: Model, tokenizer: Optional[Tokenizer], plan: RankPlan,
                 folder: Optional[RunFolder], log: RunLog, threads: int):
        self.cfg, self.out, self.model, self.tokenizer = cfg, out, model, tokenizer
        self.plan, self.folder, self.log, self.threads = plan, folder, log, threads
        self.last: Optional[Path] = None

    def fault_context(self) -> str:
        """What a report of a fault adds: where the run can go on from."""
        if self.last is None:
            return "; no checkpoint had been written"
        return (f"; the last checkpoint is {self.last}: continue with the same command and --resume")

    def diverged(self, what: str, value, step: int) -> TrainError:
        """The error of a run whose loss, gradient norm or weights stopped being finite."""
        where = (f"the last good checkpoint is {self.last}" if self.last
                 else "no checkpoint had been written")
        # Every rank sees the same summed loss and norm, and the same weights: all stop here.
        return self.plan.everyone(TrainError(f"{what} became {value} at step {step}; stopping ({where}). "
                                             "Try a lower --lr, more --warmup-steps or --max-grad-norm."))

    # --- writing ------------------------------------------------------------------------

    def save(self, step: int, total_steps: int, tokens_per_step: int, val_loss: Optional[float],
             data_key: str) -> Path:
        """Write checkpoints/step-N atomically (temp folder, fsync, rename); keep the newest few.
        In a distributed run every rank calls it: they check that their weights agree, the
        ZeRO-1 shards of the moments go to rank 0, and rank 0 writes."""
        root = self.out / CHECKPOINTS
        final = root / checkpoint_name(step)
        if self.last == final:
            return final
        self.plan.check_same_weights(step)
        if not all(np.isfinite(v).all() for v in self.model.parameters().values()):
            raise self.diverged("a parameter", "non-finite", step)  # never save broken weights
        opt = self.model.optimizer_state()
        zero = self.plan.zero
        if self.folder is None:
            if zero:
                for name in ("m", "v"):
                    self.plan.moments_to_root(name, opt[name], step)
            self.last = final
            return final
        moments = [("m", opt["m"]), ("v", opt["v"])]
        if zero:  # the full moments, written shard by shard as they arrive: the format of any run
            moments = [(name, Pieces((self.model.n_params,), lambda name=name: self.plan.moments_to_root(
                name, opt[name], step))) for name in ("m", "v")]
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            self._save_model(tmp)
            write_file(tmp / OPTIMIZER_FILE, moments)
            write_json(tmp / STATE_FILE, {
                "step": step, "optimizer_step": int(opt["step"]), "total_steps": total_steps,
                "tokens": step * tokens_per_step, "val_loss": val_loss,
                "data_key": data_key, "threads": self.threads,
                "ranks": self.plan.size,
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
        self.last = final
        self.folder.prune(self.cfg.keep_checkpoints)
        return final

    def _save_model(self, folder: Path) -> None:
        """The model into a checkpoint folder: a Hugging Face checkpoint, or a LoRA run's adapters in
        PEFT's format (naming the base they go on) with the tokenizer files."""
        if not self.cfg.lora:
            save_pretrained(self.model, folder, tokenizer=self.tokenizer)
            return
        if isinstance(self.tokenizer, Tokenizer):
            self.tokenizer.save(folder)
        base = os.path.abspath(self.cfg.from_dir) if self.cfg.from_dir else None
        save_adapter(self.model, folder, base_model_name_or_path=base)

    def _unwritten(self, final: Path, e: OSError) -> Exception:
        """The error of a checkpoint that could not be written: the file, why, and what was kept."""
        kept = (f"the previous checkpoint {self.last} is intact" if self.last
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

    # --- resuming -----------------------------------------------------------------------

    def restore(self, ckpt: Optional[Path], data_key: str, total_steps: int) -> tuple[int, Optional[float]]:
        """Go on from checkpoint ckpt: the moments and the optimizer's step into the model, and
        (step, validation loss) of the checkpoint. In a distributed run rank 0 alone reads it (the
        others get None) and sends the others where the run is, and the AdamW moments: all of
        them, or under ZeRO-1 each rank its shard, read piece by piece from the file."""
        where = None
        if self.folder is not None:
            state = load_state(ckpt)
            if state.data_key != data_key:
                raise TrainError(f"--resume: the data or tokenizer changed since {ckpt} was written; "
                                 "resume needs the same data (or start a new run)")
            self._check_budget(state, total_steps)
            if state.threads != self.threads:
                self.log.say(f"note: the run used {state.threads} threads, this one {self.threads}: "
                             "losses may differ from an uninterrupted run in the last bits")
            ranks = self.plan.size
            if (state.ranks or 1) != ranks:
                self.log.say(f"note: the run used {state.ranks or 1} rank(s), this one {ranks}: the batches are the "
                             "same (they depend on the global batch only), their gradients are summed in another "
                             "order, so losses may differ from an uninterrupted run in the last bits")
            where = (state.step, state.optimizer_step, state.val_loss, str(ckpt))
        where = self.plan.broadcast("the checkpoint's state", where)
        step, optimizer_step, val_loss, ckpt_name = where
        self._restore_moments(Path(ckpt_name) / OPTIMIZER_FILE)
        self.model.set_optimizer_step(optimizer_step)
        self.last = Path(ckpt_name)
        if self.folder is not None:
            self.folder.truncate_metrics(step)
            self.folder.prune(self.cfg.keep_checkpoints)
        return step, val_loss

    def _restore_moments(self, path: Path) -> None:
        opt = self.model.optimizer_state()
        writer = self.folder is not None
        if self.plan.zero:
            for name in ("m", "v"):
                if not writer:
                    self.plan.moments_from_root(name, opt[name])
                    continue
                try:
                    with SafetensorsFile(path) as f:
                        if f.info(name).shape != (self.model.n_params,):
                            raise CheckpointError(path, f"shape {list(f.info(name).shape)}, expected "
                                                        f"[{self.model.n_params}]", key=name)
                        self.plan.moments_from_root(name, opt[name], read=lambda b, e, name=name: f.read_flat(name, b, e))
                except ValueError as e:
                    raise TrainError(f"--resume: {e}") from None
            return
        if writer:
            try:
                with SafetensorsFile(path) as f:
                    f.copy_into("m", opt["m"])
                    f.copy_into("v", opt["v"])
            except ValueError as e:
                raise TrainError(f"--resume: {e}") from None
        self.plan.share_moments(opt)

    def _check_budget(self, state: TrainerState, total: int) -> None:
        """A resumed run's budget: the one it was planned with (an exact resume), or a larger one
        (the run is extended: from the checkpoint on, the learning rate follows the schedule of
        the new total, as if the run had been planned with it). It cannot shrink."""
        step, planned = state.step, state.total_steps
        given = next((name for name in BUDGET_FIELDS if getattr(self.cfg, name) is not None), None)
        budget = f"--{given} {getattr(self.cfg, given):g}" if given else f"the default {total} steps"
        if given in ("epochs", "tokens"):
            budget += f" ({total} steps)"
        if total == planned:
            if step == planned:  # finished (or stopped after its last step): publish and plot again
                self.log.say(f"note: the run in {self.out} is complete at step {step}: nothing to train; "
                             "give a larger --steps, --epochs or --tokens to extend it")
            return
        if total <= step:
            raise TrainError(f"--resume: {budget} ends at or before step {step}, where the run in {self.out} "
                             "already is; a run cannot be shrunk (give a larger budget to extend it)")
        if total < planned:
            raise TrainError(f"--resume: {budget} is fewer than the {planned} steps the run in {self.out} was "
                             "planned for; a run's budget can only grow")
        # Steps counted from 1 as on the console and in metrics.jsonl: step n uses lr_at(n - 1).
        self.log.say(f"extending the run in {self.out} from {planned} to {total} steps: the learning rate follows "
                     f"the schedule for {total} steps from here on (step {step + 1}: lr "
                     f"{lr_at(self.cfg, step, total):.3g}; step {step} had {lr_at(self.cfg, step - 1, planned):.3g})")
