"""The plan of a run's ranks: which part of every global batch this process computes, which
region of the gradients it reduces, which shard of the clipping norm's sum and (under ZeRO-1)
of the AdamW moments it owns; and what rank 0 sends the others: the model's settings and
tokenizer, the weights, the checkpoint it resumes from and its moments (docs/distributed.md).

A distributed run (several processes, its ranks, under mpirun, srun or `zoo launch`; a
distributed.Group) splits every global batch across the ranks (data.batch_share), sums their
gradients in place in the arena, and clips by the norm of the sum; every rank then holds the
same weights. Rank 0 alone owns the run folder: it takes the lock, reads the checkpoint it resumes
from and sends the others what they need, and writes every file; the other ranks never open
anything in it. One process is a plan of one rank, with no group.
"""

from __future__ import annotations

import math
import tempfile
import zlib
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..arch.config import ModelConfig
from ..core.errors import DistributedError
from ..model import Model
from ..text.chat_template import ChatTemplate
from ..text.tokenizers import ID_FILES, TOKENIZER_FILES, Tokenizer
from .config import TrainConfig
from .data import DataError, batch_share
from .distributed import Group, shard_bounds
from .model_setup import RunModel, load_lora_model


def everyone(group: Optional[Group], e: Exception) -> Exception:
    """An error every rank raises at the same point, from the same values: rank 0 reports
    it, and the ranks end together (no abort)."""
    if group is not None:
        group.agreed_stop = True
    return e


def share_model(group: Group, cfg: TrainConfig, run: Optional[RunModel], resuming: bool) -> tuple[RunModel, bool]:
    """Rank 0 has loaded the model and tokenizer (run: from a checkpoint, --from, or new); the
    other ranks (run None) build the same from its model config and tokenizer files, then every
    rank takes rank 0's weights. Returns this rank's RunModel and whether the run resumes (rank 0
    knows)."""
    sent = None
    if group.is_root:
        template = run.chat_template
        sent = {"model": run.model.config.model_dump(), "tokenizer": _tokenizer_source(run.tokenizer_dir),
                "resuming": resuming, "chat_template": None if template is None else
                (template.source, template.origin, template.bos_token, template.eos_token)}
    sent = group.broadcast("the model's settings", sent)
    if not group.is_root:
        if cfg.lora:  # each rank reads the frozen base itself; rank 0 sends the adapters below
            model = load_lora_model(cfg, None)[0]
        else:
            model = Model(ModelConfig.model_validate(sent["model"]), seed=None, ad=cfg.ad)
        chat_template = None if sent["chat_template"] is None else ChatTemplate(*sent["chat_template"])
        source = sent["tokenizer"]
        if source is None:
            tokenizer = Tokenizer.byte_level()
        else:  # written where this rank alone reads it, never into the run folder
            main, files = source
            with tempfile.TemporaryDirectory(prefix="zoo-tokenizer-") as tmp:
                for name, content in files.items():
                    (Path(tmp) / name).write_bytes(content)
                tokenizer = Tokenizer.from_pretrained(Path(tmp) / main if main else tmp)
        run = RunModel(model, tokenizer, None, chat_template)
    group.broadcast_block("the weights", run.model.parameter_block())
    return run, sent["resuming"]


def _tokenizer_source(path: Optional[Path]) -> Optional[tuple[Optional[str], dict[str, bytes]]]:
    """What another rank needs to load the tokenizer rank 0 loaded from `path` (None: the
    byte-level one): (the file's name, or None for a folder; the contents of the files
    Tokenizer.from_pretrained reads there)."""
    if path is None:
        return None
    path = Path(path)
    folder, main = (path, None) if path.is_dir() else (path.parent, path.name)
    names = {*TOKENIZER_FILES, *ID_FILES, *([main] if main else [])}
    return main, {name: (folder / name).read_bytes() for name in sorted(names) if (folder / name).is_file()}


class RankPlan:
    """This rank's share of each global batch, and, in a distributed run, the gradient region it
    reduces and the shards: of the clipping norm's sum, and under ZeRO-1 of the AdamW moments
    (set before the moments exist, so only the shard is ever allocated). Its methods are the
    exchanges of a step, a checkpoint and a resume; with no group they do what one process does."""

    def __init__(self, cfg: TrainConfig, group: Optional[Group], model: Model, say: Callable[[str], None]):
        self.cfg, self.group, self.model = cfg, group, model
        self.rank, self.size = (0, 1) if group is None else (group.rank, group.size)
        try:
            self.share = batch_share(cfg.batch_size, cfg.grad_accum, self.rank, self.size)
        except DataError as e:
            raise everyone(group, e) from None
        self.zero = bool(cfg.zero) and group is not None
        if group is None:
            if cfg.zero:
                say("note: --zero 1 shards the AdamW moments across the ranks of a distributed run; "
                    "this run is one process, which keeps them all")
            return
        # Every gradient is reduced. A run that trains only some parameters (LoRA adapters) would
        # reduce only theirs: this region, which the shards below divide.
        self.reduced = (0, model.n_params)
        try:
            self.bounds = shard_bounds(*self.reduced, self.size)
        except DistributedError as e:
            raise everyone(group, e) from None
        self.my_shard = (self.bounds[self.rank], self.bounds[self.rank + 1])
        if self.zero:
            model.set_moment_range(*self.my_shard)

    def report_faults(self, fault_context: Callable[[], str], record: Callable[[str], None]) -> None:
        """What a report of a lost rank adds (where the last checkpoint is), and where rank 0
        records it besides the console (train.log)."""
        if self.group is None:
            return
        self.group.fault_context = fault_context
        if self.group.is_root:
            self.group.on_fault = lambda message: record(f"error: {message}")

    def everyone(self, e: Exception) -> Exception:
        return everyone(self.group, e)

    # --- checks that every rank holds the same -------------------------------------------

    def check_same_data(self, tokens) -> None:
        """Every rank tokenized its own copy of the data (each host reads its own files): all
        must hold the same token stream (compared by length and checksum; the cache key would
        differ with the files' times on another host)."""
        if self.group is None:
            return
        streams = tokens if isinstance(tokens, list) else [tokens]  # a mixture: one array a source
        crc = 0
        for stream in streams:
            if len(stream):
                crc = zlib.crc32(stream, crc)
        mine = (sum(len(s) for s in streams), crc)
        seen = self.group.gather("the data check", mine)
        differ = [r for r, got in enumerate(seen) if got != seen[0]]
        if differ:
            counts = ", ".join(f"rank {r}: {seen[r][0]:,} tokens" for r in [0, *differ])
            raise self.everyone(DistributedError(
                f"rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} read other data than rank 0 "
                f"from {', '.join(self.cfg.data)} ({counts}, or the same count with other ids); every host needs the "
                "same data at the same path"))

    def check_same_weights(self, step: int) -> None:
        """Every rank's weights are rank 0's, bit for bit (compared by checksum): the summed
        gradients and AdamW are the same on every rank, so they stay so unless something is
        wrong; never save a checkpoint that only one rank's weights would make."""
        if self.group is None:
            return
        mine = zlib.crc32(self.model.parameter_block())
        sums = self.group.gather(f"the weight check of step {step}", mine)
        differ = [r for r, c in enumerate(sums) if c != sums[0]]
        if differ:
            raise self.everyone(DistributedError(
                f"after step {step} the weights of rank{'s' if len(differ) > 1 else ''} "
                f"{', '.join(map(str, differ))} differ from rank 0's; stopping before a checkpoint is written "
                f"({self.group.fault_context().lstrip('; ')})"))

    # --- a step ---------------------------------------------------------------------------

    def exchange(self, n: int, loss: float, stop: bool, extra=()) -> tuple[float, float, bool, list[float]]:
        """Step n's gradients summed across the ranks, in place in the arena (all of them on
        every rank; under ZeRO-1 each rank's shard on its owner), and the global loss, gradient
        norm and stop flag from every rank's part, with the sums of `extra` (a preference run's
        metrics)."""
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
        total_loss, sum_squares, stops, *extra = group.sum(f"the loss of step {n}", [loss, part, float(stop), *extra])
        return float(total_loss), math.sqrt(sum_squares), stops > 0, extra

    def share_updated_weights(self, n: int) -> None:
        """Under ZeRO-1 each rank updated its shard of the weights at step n: every rank gets all of them."""
        if self.zero:
            self.group.all_gather(f"the weights of step {n}", self.model.parameter_block(), self.bounds)

    # --- the moments of a checkpoint ------------------------------------------------------

    def moments_to_root(self, name: str, moment: np.ndarray, step: int):
        """Under ZeRO-1, the shards of moment `name` to rank 0 (Group.shards_to_root): the pieces of
        the whole moment on rank 0, in order; on the others, sent before this returns."""
        return self.group.shards_to_root(f"the AdamW moments ({name}) of step {step}", moment, self.bounds)

    def moments_from_root(self, name: str, moment: np.ndarray, read=None) -> None:
        """Under ZeRO-1, each rank's shard of moment `name` from rank 0, which reads the values of
        [begin, end) of the whole with read(begin, end)."""
        self.group.shards_from_root(f"the AdamW moments ({name}) from the checkpoint", moment, self.bounds, read=read)

    def share_moments(self, opt: dict) -> None:
        """Rank 0's moments (all of them) to every rank."""
        if self.group is not None:
            self.group.broadcast_block("the AdamW moments (m) from the checkpoint", opt["m"])
            self.group.broadcast_block("the AdamW moments (v) from the checkpoint", opt["v"])

    def broadcast(self, what: str, value):
        """Rank 0's value, on every rank (one process: the value)."""
        return value if self.group is None else self.group.broadcast(what, value)
