"""The loss plot of a run: train loss per logged step and validation loss per evaluation,
read from the run's metrics.jsonl and written to loss.png (matplotlib, no display needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


def read_metrics(run_dir: str | os.PathLike) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train, val) lists of (step, loss) from a run folder's metrics.jsonl."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no such file (is {run_dir} a zoo run folder?)")
    train, val = [], []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}: line {i} is not JSON") from None
        if "loss" in rec:
            train.append((rec["step"], rec["loss"]))
        if "val_loss" in rec:
            val.append((rec["step"], rec["val_loss"]))
    return train, val


def plot_run(run_dir: str | os.PathLike) -> Path:
    """Write run_dir/loss.png (atomically) and return its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only; works without a display
    import matplotlib.pyplot as plt

    from .atomic import atomic_open

    train, val = read_metrics(run_dir)
    if not train and not val:
        raise ValueError(f"{Path(run_dir) / METRICS_FILE}: no losses recorded yet")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), label="validation", marker="o", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(Path(run_dir).resolve().name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(run_dir) / PLOT_FILE
    with atomic_open(out) as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return out
