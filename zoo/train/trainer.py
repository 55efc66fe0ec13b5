"""One trainer for every model zoo builds: finetuning a checkpoint or training from scratch.

A step is `grad_accum` native forward+pullback calls (each adds its scaled gradients into the
arena) and one native AdamW call (global-norm clipping, decay per tensor). Nothing else in
Python touches parameters inside a step.

The Trainer holds the loop: the steps, evaluation, metrics, Ctrl-C. What it starts from is
model_setup.py's; the run folder (lock, publishing, pruning, train.log) run_folder.py's;
checkpoints and resume checkpoint.py's; the plan of a distributed run's ranks (who computes
which rows, who owns which shard, what rank 0 sends) ranks.py's. docs/training.md,
docs/distributed.md.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from tqdm import tqdm

from ..arch.layout import num_parameters
from ..arch.memory import human_bytes
from ..core.atomic import named
from ..core.errors import ResourceError, TrainError, TrainInterrupted
from ..core.gemm import products_report
from ..core.native import get_threads, set_threads
from .checkpoint import Checkpoints, resume_point
from .config import TrainConfig, lr_at
from .data import DataError, training_data
from .distributed import Group
from .evaluate import validation_loss
from .model_setup import check_fit, check_memory_up_front, load_run_model
from .plot import METRICS_FILE, PLOT_FILE
from .preference_step import PreferenceRun
from .ranks import RankPlan, share_model
from .run_folder import LOG_FILE, RunFolder, RunLog
from .tensorboard import EventLog, replay_records


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
        self.log = RunLog(self.writer)
        self.folder = RunFolder(self.out, self.log) if self.writer else None
        self.checkpoints: Optional[Checkpoints] = None
        try:
            self._set_up()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Give the run folder up (run() does when it ends): another run may take it then."""
        if self.folder is not None:
            self.folder.close()

    @property
    def last_checkpoint(self) -> Optional[Path]:
        """The newest checkpoint this run wrote or resumed from."""
        return self.checkpoints.last if self.checkpoints is not None else None

    def say(self, msg: str) -> None:
        """A console line, also in train.log (RunLog.say); rank 0's alone."""
        self.log.say(msg)

    def _set_up(self) -> None:
        cfg, group = self.cfg, self.group
        if cfg.threads is not None:
            set_threads(cfg.threads)
        elif group is not None and "OMP_NUM_THREADS" not in os.environ:
            set_threads(group.default_threads())
        self.threads = get_threads()

        resume_from, run = None, None
        if self.writer:
            self.folder.take()
            resume_from = resume_point(cfg, self.out)
            check_memory_up_front(cfg, 1 if group is None else group.size, self.say)
            run = load_run_model(cfg, resume_from)
        resuming = resume_from is not None
        if group is not None:
            run, resuming = share_model(group, cfg, run, resuming)
        self.model, self.tokenizer = run.model, run.tokenizer
        self.tokenizer_dir, self.chat_template = run.tokenizer_dir, run.chat_template
        self.model.check_trainable()  # a forward-only block stops the run here, before any data work
        self.model.set_precision(cfg.precision)
        check_fit(cfg, run)
        # the method's default checkpoints the first layers only (TrainConfig.checkpoint_layers)
        ranks = 1 if group is None else group.size
        self.model.set_checkpointing(cfg.checkpoint_layers(self.model.config, -(-cfg.batch_size // ranks), ranks))
        if cfg.packed_base:
            packed = self.model.set_packed_base(True)
            self.say(f"packed base: {human_bytes(packed)} of the bf16 base's matrices packed for the bf16 kernels"
                     if packed else "packed base: this CPU's kernels read the base as stored; nothing packed")
        self.plan = RankPlan(cfg, group, self.model, self.say)
        self.checkpoints = Checkpoints(cfg, self.out, self.model, self.tokenizer, self.plan, self.folder, self.log,
                                       self.threads)
        self.plan.report_faults(self.checkpoints.fault_context, self.log.record)

        # Preference methods (--method dpo, ipo, orpo, simpo): pairs, their objective and reference
        # (preference_step.py); its hooks below are the lines that test self.preference.
        self.preference = PreferenceRun(self, resuming) if cfg.method != "sft" else None
        if self.preference is not None:
            self.token_file, self.windows = self.preference.pair_file, self.preference.splits
        else:
            self.token_file, self.windows = training_data(
                cfg.data, self.tokenizer, cfg.cache_dir, self.chat_template, self.model.config.vocab_size,
                cfg.batch_size, cfg.seq_len, cfg.val_fraction, cfg.eval_batches, cfg.seed, cfg.train_on_everything,
                cfg.data_columns)
        # what a resumed run must find again: the same tokens, masked the same way
        self.data_key = self.token_file.key + (":all-tokens" if cfg.train_on_everything else "")
        self.plan.check_same_data(self.token_file.streams)
        self.total_steps = cfg.total_steps(self.windows.n_train)
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
        self.eval_every = cfg.eval_interval(self.total_steps)
        self.print_every = cfg.print_interval(self.total_steps)

        self.step = 0
        self.last_val_loss: Optional[float] = None
        if resuming:
            self.step, self.last_val_loss = self.checkpoints.restore(resume_from, self.data_key, self.total_steps)
        elif self.writer:
            self.folder.clear(cfg.from_dir)  # only now that everything above has been checked
        if self.writer:
            self.folder.start_log()

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
                    self.folder.publish(self.last_checkpoint)
            except BaseException as e:
                if self.writer:
                    self._stopped(e)
                raise
            finally:
                for signum, handler in old_handlers.items():
                    signal.signal(signum, handler)
            plot = self.folder.plot() if self.writer else None
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
        cfg = self.cfg
        metrics = open(self.out / METRICS_FILE, "a", encoding="utf-8") if self.writer else None
        self.events = None
        try:  # --report-to tensorboard: an event file derived from metrics.jsonl, what it holds replayed
            if self.writer and cfg.report_to == "tensorboard":
                self.events = EventLog(self.out, replay_records(self.out / METRICS_FILE))
        except OSError as e:
            metrics.close()
            raise named(e, self.out) from None
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
                        self.log.record(line)  # the bar shows the same on the console
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
                    raise self.plan.everyone(TrainInterrupted(done, self.last_checkpoint))
        finally:
            bar.close()
            if metrics is not None:
                metrics.close()
            if self.events is not None:
                self.events.close()
        return loss

    def _step(self, step: int, lr: float, interrupted: threading.Event) -> tuple[float, float, bool]:
        """Optimizer step `step` (0-based): this rank's share of the global batch forward and
        back, in a distributed run the exchange, then AdamW. Returns the loss, the gradient norm
        before clipping, and whether to stop after this step (Ctrl-C, on any rank)."""
        cfg, model, share = self.cfg, self.model, self.plan.share
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
            pref = self.preference.take_sums() if self.preference is not None else []  # its metrics' sums
            loss, norm, stop, pref = self.plan.exchange(step + 1, loss, stop, pref)
            if self.preference is not None:
                self.preference.put_sums(pref)
        if not math.isfinite(loss):
            raise self.checkpoints.diverged("loss", loss, step + 1)
        if norm is not None and not math.isfinite(norm):
            raise self.checkpoints.diverged("gradient norm", norm, step + 1)
        grad_norm = model.adamw_step(lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.max_grad_norm or None,
                                     grad_norm=norm)
        self.plan.share_updated_weights(step + 1)
        if not math.isfinite(grad_norm):
            raise self.checkpoints.diverged("gradient norm", grad_norm, step + 1)
        return loss, grad_norm, stop

    def _stopped(self, e: BaseException) -> None:
        """A run that stops early still gets its plot, its log and a last line naming the run folder."""
        try:
            plot = self.folder.plot()
            kept = [f"checkpoint {self.last_checkpoint.name}" if self.last_checkpoint else "no checkpoint",
                    *([PLOT_FILE] if plot else []), LOG_FILE]
            why = "Ctrl-C" if isinstance(e, (TrainInterrupted, KeyboardInterrupt)) else "error"
            self.say(f"stopped at step {self.step} ({why}): {', '.join(kept)} in {self.out}")
            # The caller shows the error itself (zoo's one-line message, or a traceback): the log keeps it too.
            if isinstance(e, TrainInterrupted):
                self.log.record(str(e))
            elif isinstance(e, KeyboardInterrupt):
                self.log.record("interrupted (a second Ctrl-C stops at once)")
            elif isinstance(e, (TrainError, ValueError, OSError, ResourceError)):
                self.log.record(f"error: {e}")
            else:
                self.log.record(f"error: {type(e).__name__}: {e}")
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

    def _write(self, metrics, record: dict) -> None:
        if metrics is None:  # a rank other than 0
            return
        try:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        except OSError as e:
            raise named(e, metrics.name) from None
        if self.events is not None:
            try:
                self.events.write(record)
            except OSError as e:
                raise named(e, str(self.events.path)) from None

    def _print_header(self) -> None:
        m, cfg = self.model, self.cfg
        share = self.plan.share
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
                     + (f"; AdamW moments sharded (ZeRO-1), 1/{group.size} per rank" if self.plan.zero else ""))
        if m.lora is not None:
            self.say(f"LoRA: rank {m.lora.r}, alpha {m.lora.alpha:g}, dropout {m.lora.dropout:g} on "
                     f"{', '.join(m.lora.targets or ['every linear layer'])}; the {m.base_dtype} base is frozen")
        if self.preference is not None:  # its data and objective
            for line in self.preference.describe():
                self.say(line)
        else:
            formats = ", ".join(f"{n} {kind}" for kind, n in sorted(Counter(tf.formats).items()))
            trained = (f", {tf.n_trained:,} carrying loss" + (" (--train-on-everything: all of them)"
                                                              if self.cfg.train_on_everything else "")
                       if tf.masked else "")
            self.say(f"data: {len(tf.files)} file(s) ({formats}), {tf.n_tokens:,} tokens{trained}; "
                     f"{self.windows.describe()}{' (from cache)' if tf.reused else ''}")
        what = f"resuming at step {self.step}" if self.step else "starting"
        evals = (f"evaluation every {self.eval_every} step{'s' if self.eval_every > 1 else ''}" if self.eval_every
                 else "evaluation at start and end")
        size = (f"{cfg.batch_size * cfg.grad_accum:,} pairs" if self.preference is not None
                else f"{self.tokens_per_step:,} tokens")
        self.say(f"{what}: {self.total_steps} steps of {size}, {evals}; "
                 f"run folder {self.out}")

    def save_checkpoint(self) -> Path:
        """Checkpoint the run where it is (Checkpoints.save); every rank of a distributed run calls it."""
        return self.checkpoints.save(self.step, self.total_steps, self.tokens_per_step, self.last_val_loss,
                                     self.data_key)


__all__ = ["Trainer", "TrainError", "TrainInterrupted", "DataError", "lr_at"]
