"""Preference training on a zoo.Model: the passes of a micro-step, the evaluation on held-out
pairs, and the reference log-probabilities; the trainer calls these where it runs SFT's
(`self.preference` in trainer.py).

A micro-step packs its pairs (preference.pack_pairs: each prompt computed once for both
answers), takes the reference model's log-probabilities where the loss needs them, runs the
policy's forward with the LM head on the answer rows alone (Model.target_logprobs), sums each
answer's log-probabilities, and runs the pullback with the loss's derivative by each sum as the
weight of that answer's tokens (Model.backward_logprobs; preference_loss.py). The reference:

- under LoRA, the frozen base with the adapters off, in the same pass machinery (no second copy
  of the weights), each micro-step before the policy's pass;
- when every weight trains, the log-probabilities of the model before training, computed once
  for every pair before the first step and stored in the token cache (keyed by the pairs, the
  starting weights, the precision and seq_len), so training holds one model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np

from ..core.atomic import atomic_open
from .config import DEFAULT_CHECKPOINT_GROWTH
from .data import IGNORE, DataError, default_cache_dir
from .preference import PairBatch, PairSplits, answer_cap, pack_pairs, tokenize_pairs
from .preference_loss import PreferenceLoss, loss_from_config


def answer_sums(batch: PairBatch, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each pair's summed log-probabilities of its chosen and of its rejected answer (float64)."""
    on = batch.answer >= 0
    sums = np.bincount(batch.answer[on], weights=logprobs[on].astype(np.float64), minlength=2 * batch.n_pairs)
    return sums[0::2], sums[1::2]


class PreferenceObjective:
    """A preference loss over the pairs of `splits`, on a model. reference: None (the loss needs
    none, or the adapters are switched off for it), or the reference model's sums per pair of the
    pair file (n_pairs x 2, NaN for pairs left out)."""

    def __init__(self, loss: PreferenceLoss, splits: PairSplits, share_prompt: bool = True):
        self.loss, self.splits = loss, splits
        self.share_prompt = share_prompt
        self.reference: Optional[np.ndarray] = None

    # --- batches ------------------------------------------------------------------

    def pack(self, indices) -> PairBatch:
        return pack_pairs(self.splits.pairs(indices), self.splits.seq_len, self.share_prompt,
                          prompt_targets=self.loss.nll_weight > 0 and self.loss.nll_on_prompt)

    def nll_tokens(self, indices) -> int:
        """The tokens the NLL term of a batch of these pairs averages over (0 without one)."""
        if not self.loss.nll_weight:
            return 0
        lengths = self.splits.pair_file.lengths()[np.asarray(indices, np.int64)]
        total = 0
        for p, c, r in lengths.tolist():
            cap = answer_cap(p, c, r, self.splits.seq_len)
            kept = len(range(max(p - 1, 0), p + min(c, cap) - 1))  # the chosen answer's targets
            total += kept + (max(p - 1, 0) if self.loss.nll_on_prompt else 0)
        return total

    def _nll_rows(self, batch: PairBatch) -> np.ndarray:
        """The rows the NLL term counts: the chosen answers', and the prompts' where it counts them."""
        rows = (batch.answer >= 0) & (batch.answer % 2 == 0)
        if self.loss.nll_on_prompt:
            rows |= batch.prompt & (batch.y != IGNORE)
        return rows

    # --- the reference ---------------------------------------------------------------

    def reference_sums(self, model, batch: PairBatch, indices) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        """The reference model's (chosen, rejected) sums for the batch's pairs, or (None, None)."""
        if not self.loss.needs_reference:
            return None, None
        if self.reference is not None:
            ref = self.reference[np.asarray(indices, np.int64)]
            return ref[:, 0], ref[:, 1]
        if model.lora is None:
            raise RuntimeError("a reference-based loss on a model without adapters needs its reference computed "
                               "first (compute_reference)")
        model.set_adapters_enabled(False)
        try:
            lp = model.target_logprobs(batch.x, np.where(batch.answer >= 0, batch.y, IGNORE), batch.positions,
                                       batch.hidden)
        finally:
            model.set_adapters_enabled(True)
        return answer_sums(batch, lp)

    def reference_batches(self) -> list[np.ndarray]:
        """The batches of pairs the reference is computed in: the training pairs in order, and
        the held-out pairs in the batches evaluate() packs them in (the same rows, so the rewards
        of the model before training are exactly 0 there, as with a reference computed on the fly)."""
        train, size = self.splits.train_pairs, self.splits.batch_size
        return [train[i:i + size] for i in range(0, len(train), size)] + list(self.splits.val_indices())

    def compute_reference(self, model, group=None) -> np.ndarray:
        """The model's sums for every pair reference_batches() holds (a distributed run's ranks each
        a share, summed): an (n_pairs of the pair file, 2) array, NaN for the others."""
        out = np.zeros((self.splits.pair_file.n_pairs, 2))
        rank, ranks = (0, 1) if group is None else (group.rank, group.size)
        batches = self.reference_batches()
        for chunk in batches[rank::ranks]:
            batch = self.pack(chunk)
            lp = model.target_logprobs(batch.x, np.where(batch.answer >= 0, batch.y, IGNORE), batch.positions,
                                       batch.hidden)
            c, r = answer_sums(batch, lp)
            out[chunk, 0], out[chunk, 1] = c, r
        if group is not None:
            out = group.sum("the reference log-probabilities", out.reshape(-1)).reshape(out.shape)
        missing = np.ones(len(out), bool)
        missing[np.concatenate(batches)] = False
        out[missing] = np.nan
        return out

    # --- steps and evaluation ------------------------------------------------------------

    def micro_step(self, model, indices, lo: int, hi: int, grad_scale: float) -> tuple[float, np.ndarray]:
        """One micro-batch of pairs `indices`, of which this process takes [lo, hi): its part of the
        batch's loss (the mean over all of the batch's pairs, and of its NLL tokens), forward and
        pullback, the gradients added scaled by grad_scale. Returns (its part of the loss, the sums
        of its metrics: sums())."""
        indices = np.asarray(indices, np.int64)
        part = indices[lo:hi]
        n_all = len(indices)
        nll_all = self.nll_tokens(indices)
        batch = self.pack(part)
        rc, rr = self.reference_sums(model, batch, part)
        lp = model.target_logprobs(batch.x, batch.y, batch.positions, batch.hidden, train=True)
        pc, pr = answer_sums(batch, lp)
        terms = self.loss.pairs(pc, pr, batch.lengths[:, 0], batch.lengths[:, 1], rc, rr)
        loss = float(terms.loss.sum()) / n_all
        weights = np.zeros(batch.x.shape)
        on = batch.answer >= 0
        per_answer = np.stack([terms.d_chosen, terms.d_rejected], axis=1).reshape(-1) / n_all
        weights[on] = per_answer[batch.answer[on]]
        nll_sum, nll_count = 0.0, 0
        if self.loss.nll_weight:
            rows = self._nll_rows(batch)
            nll_sum, nll_count = -float(lp[rows].astype(np.float64).sum()), int(rows.sum())
            loss += self.loss.nll_weight * nll_sum / nll_all
            weights[rows] -= self.loss.nll_weight / nll_all
        if not (np.isfinite(loss) and np.isfinite(weights).all()):
            # no pullback: the trainer stops on the non-finite loss, naming the step
            return float("nan"), self.sums(terms, nll_sum, nll_count)
        model.backward_logprobs(weights, grad_scale=grad_scale)
        return loss, self.sums(terms, nll_sum, nll_count)

    def sums(self, terms, nll_sum: float, nll_count: int) -> np.ndarray:
        """The metric sums of some pairs: one per metric name, then the pairs, the NLL's sum and
        tokens (what a distributed run adds across its ranks before dividing)."""
        names = self.loss.metric_names()
        return np.array([float(terms.metrics[k].sum()) for k in names] + [len(terms.loss), nll_sum, nll_count])

    def metrics(self, sums: np.ndarray, prefix: str = "") -> dict[str, float]:
        """Means from summed sums(): TRL's names, prefixed (val_ for evaluations)."""
        names = self.loss.metric_names()
        pairs, nll_sum, nll_count = sums[len(names):]
        out = {prefix + k: float(v) / max(pairs, 1.0) for k, v in zip(names, sums)}
        if self.loss.nll_weight:
            out[prefix + "nll_loss"] = float(nll_sum) / max(nll_count, 1.0)
        return out

    def evaluate(self, model, group=None) -> Optional[tuple[float, dict[str, float]]]:
        """(loss, metrics) over the held-out pairs: the mean loss per pair (with the NLL term as a
        mean over all their tokens), and the metrics prefixed val_; None without held-out pairs."""
        batches = list(self.splits.val_indices())
        if not batches:
            return None
        rank, ranks = (0, 1) if group is None else (group.rank, group.size)
        names = self.loss.metric_names()
        total = np.zeros(len(names) + 4)  # the metric sums, pairs, NLL sum and tokens, then the loss sum
        for indices in batches[rank::ranks]:
            batch = self.pack(indices)
            rc, rr = self.reference_sums(model, batch, indices)
            lp = model.target_logprobs(batch.x, batch.y, batch.positions, batch.hidden)
            pc, pr = answer_sums(batch, lp)
            terms = self.loss.pairs(pc, pr, batch.lengths[:, 0], batch.lengths[:, 1], rc, rr)
            nll_sum, nll_count = 0.0, 0
            if self.loss.nll_weight:
                rows = self._nll_rows(batch)
                nll_sum, nll_count = -float(lp[rows].astype(np.float64).sum()), int(rows.sum())
            total += np.append(self.sums(terms, nll_sum, nll_count), terms.loss.sum())
        if group is not None:
            total = group.sum("the evaluation of the held-out pairs", total)
        sums, loss_sum = total[:-1], total[-1]
        pairs, nll_sum, nll_count = sums[len(names):]
        loss = loss_sum / max(pairs, 1.0) + (self.loss.nll_weight * nll_sum / max(nll_count, 1.0)
                                             if self.loss.nll_weight else 0.0)
        return float(loss), self.metrics(sums, "val_")


# --- the trainer's hooks ------------------------------------------------------------------


class PreferenceRun:
    """What a trainer running a preference method holds (Trainer.preference): the pairs, the
    objective, the reference, and the current step's metric sums."""

    def __init__(self, trainer, resuming: bool):
        cfg = trainer.cfg
        self.trainer = trainer
        self.loss = loss_from_config(cfg)
        self.pair_file = tokenize_pairs(cfg.data, trainer.tokenizer, cfg.cache_dir, trainer.chat_template,
                                        vocab_size=trainer.model.config.vocab_size, columns=cfg.data_columns)
        self.splits = PairSplits(self.pair_file, cfg.batch_size, cfg.seq_len, cfg.val_fraction, cfg.eval_batches,
                                 cfg.seed, f"data {', '.join(cfg.data)}")
        self.objective = PreferenceObjective(self.loss, self.splits)
        self.step_sums: Optional[np.ndarray] = None
        self.reference_note = ""
        if self.loss.needs_reference and trainer.model.lora is None:
            self._precomputed_reference(resuming)

    # the starting weights' identity, for the reference's cache key
    def _weights_key(self) -> str:
        cfg = self.trainer.cfg
        if cfg.from_dir is not None:
            folder = Path(cfg.from_dir)
            parts = [str(folder.resolve())]
            for f in sorted(folder.iterdir()):
                if f.is_file() and (f.suffix in (".safetensors", ".json", ".bin", ".gguf")):
                    st = f.stat()
                    parts.append(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}")
            return "\n".join(parts)
        model = cfg.model.model_dump_json() if cfg.model is not None else cfg.preset or "tiny-llama"
        return f"{model}\nseed {cfg.seed}"

    def reference_path(self) -> Path:
        cfg = self.trainer.cfg
        # what the sums depend on: the pairs, the starting weights, the precision, the rows they are
        # cut to and packed in (reference_batches)
        h = hashlib.sha256(json.dumps([self.pair_file.key, self._weights_key(), self.trainer.model.precision,
                                       cfg.seq_len, cfg.batch_size, cfg.val_fraction, cfg.eval_batches,
                                       "zoo-reference-v1"]).encode()).hexdigest()
        cache = Path(cfg.cache_dir) if cfg.cache_dir is not None else default_cache_dir()
        return cache / f"reference-{h[:24]}.npy"

    def _precomputed_reference(self, resuming: bool) -> None:
        """Full finetuning: the reference log-probabilities of the starting model, from the cache or
        computed now (every rank a share); a resumed run's model is no longer the start, so it
        finds them in the cache or stops."""
        trainer, group = self.trainer, self.trainer.group
        path = self.reference_path() if trainer.writer else None
        found = None
        if trainer.writer and path.is_file():
            try:
                found = np.load(path, allow_pickle=False)
            except (OSError, ValueError):
                found = None
            if found is not None and found.shape != (self.pair_file.n_pairs, 2):
                found = None
        if group is not None:
            found = group.broadcast("the reference log-probabilities", found)
        if found is not None:
            self.objective.reference = found
            self.reference_note = f"reference log-probabilities from the cache ({path.name})" if path else ""
            return
        if resuming:
            raise DataError(f"--resume: the reference log-probabilities this run computed from {trainer.cfg.from_dir} "
                            f"before its first step are gone from the cache ({path}); they cannot be computed "
                            "from a checkpoint: start the run again (--overwrite), or restore the cache file")
        ref = self.objective.compute_reference(trainer.model, group)
        self.objective.reference = ref
        if trainer.writer:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with atomic_open(path) as f:
                    np.save(f, ref, allow_pickle=False)
            except OSError as e:
                raise DataError(f"token cache file {path}: cannot write it ({e.strerror or e})") from None
        self.reference_note = (f"reference log-probabilities computed for "
                               f"{int(np.isfinite(ref[:, 0]).sum()):,} pairs, cached in {path}" if path else "")

    def describe(self) -> list[str]:
        tf = self.pair_file
        forms = ", ".join(sorted(set(tf.formats)))
        lines = [f"data: {len(tf.files)} file(s) of preference pairs ({forms}), {len(tf.tokens):,} tokens; "
                 f"{self.splits.describe()}{' (from cache)' if tf.reused else ''}",
                 f"objective: {self.loss.describe()}"
                 + (" (the base with the adapters off)" if self.loss.needs_reference and self.objective.reference is None
                    else "") + (f"; {self.reference_note}" if self.reference_note else "")]
        cfg = self.trainer.cfg
        if cfg.checkpointing is None and cfg.uses_checkpointing:  # the method's default: said, with the ways out
            model = self.trainer.model
            lines.append(f"activation checkpointing: on for the first {model.checkpoint_layers} of "
                         f"{model.config.n_layer} layers ({cfg.method}'s default with --lora: its step runs the "
                         f"reference's forward too; the later layers keep their activations while that adds at most "
                         f"{DEFAULT_CHECKPOINT_GROWTH:.0%} to the memory estimate; --checkpointing recomputes every "
                         "layer, --no-checkpointing none, faster and larger)")
        return lines

    def micro_step(self, model, step: int, micro: int, lo: int, hi: int, grad_scale: float) -> float:
        loss, sums = self.objective.micro_step(model, self.splits.train_indices(step, micro), lo, hi, grad_scale)
        self.step_sums = sums if self.step_sums is None else self.step_sums + sums
        return loss * grad_scale

    def take_sums(self) -> list[float]:
        """This process's metric sums of the step, for a distributed run to add up."""
        return [] if self.step_sums is None else self.step_sums.tolist()

    def put_sums(self, sums) -> None:
        self.step_sums = np.asarray(sums, np.float64)

    def step_metrics(self) -> dict[str, float]:
        """The step's metrics (TRL's names), from its sums; the sums start over."""
        sums, self.step_sums = self.step_sums, None
        return {} if sums is None else self.objective.metrics(sums)

    def evaluate(self, model, group=None):
        return self.objective.evaluate(model, group)
