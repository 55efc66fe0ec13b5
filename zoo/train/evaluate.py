"""Evaluation: the mean loss of a model over batches of a data set, weighted by the tokens that
carry loss, as the trainer's validation loss and `zoo eval` both report it."""

from __future__ import annotations

import math
import time
from typing import Iterable

import numpy as np

from .data import IGNORE, Batch


def validation_loss(model, batches: Iterable[Batch]) -> tuple[float, int]:
    """(mean loss per token that carries loss, number of such tokens) over the batches."""
    total, n_tokens = 0.0, 0
    for batch in batches:
        n = int(np.count_nonzero(batch.y != IGNORE))
        if n:
            total += model.loss(batch.x, batch.y, positions=batch.positions) * n
            n_tokens += n
    return (total / n_tokens if n_tokens else float("nan")), n_tokens


def evaluate(model, windows, split: str) -> dict:
    """Loss and perplexity of the model over the windows' validation batches (split "val", the
    trainer's) or over all of the data (split "all"), with the time it took."""
    batches = windows.val_batches() if split == "val" else windows.all_batches()
    start = time.perf_counter()
    loss, n_tokens = validation_loss(model, batches)
    seconds = time.perf_counter() - start
    return {"loss": loss, "perplexity": math.exp(loss) if n_tokens and loss < 700 else float("inf" if n_tokens else "nan"),
            "tokens": n_tokens, "seconds": seconds, "tokens_per_s": n_tokens / seconds if seconds > 0 else None}
