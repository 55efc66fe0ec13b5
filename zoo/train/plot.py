"""The loss plot of a run: train loss per logged step and validation loss per evaluation,
read from the run's metrics.jsonl and written to loss.png (matplotlib, no display needed). A
preference run (zoo/train/preference_step.py) gets a second panel beside the loss: the reward
margin and the preference accuracy, train and validation."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict, StrictInt

from ..core.atomic import atomic_open
from ..core.errors import CheckpointError
from ..core.files import parse_model, read_text

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsRecord(BaseModel):
    """One line of metrics.jsonl: a logged step (loss, lr, ...) or an evaluation (val_loss)."""

    model_config = ConfigDict(extra="allow")  # lr, grad_norm, tokens, ...: shown by other tools

    step: StrictInt
    loss: Optional[float] = None
    val_loss: Optional[float] = None


def read_records(path: str | os.PathLike,
                 on_bad_line: Optional[Callable[[str], None]] = None) -> list[tuple[str, MetricsRecord]]:
    """(line, record) for each record of a metrics.jsonl. An unfinished last line (no newline:
    its writer was killed mid-line, or is writing it now) is left out. Any other line that is
    not a record raises CheckpointError naming the file and the line number, or, given
    on_bad_line, is left out and what is wrong (naming the line) passed to it."""
    path = Path(path)
    text = read_text(path, METRICS_FILE)
    lines = text.split("\n")
    lines.pop()  # after the last newline: empty, or an unfinished line
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append((line, parse_model(path, MetricsRecord, json.loads(line), f"line {number}")))
            continue
        except json.JSONDecodeError as e:
            why = f"line {number} is not JSON ({e.msg}, column {e.colno})"
        except RecursionError:  # json's parser recurses per bracket
            why = f"line {number} is not JSON (nested too deeply)"
        except CheckpointError as e:
            why = str(e).removeprefix(f"{path}: ")
        if on_bad_line is None:
            raise CheckpointError(path, why)
        on_bad_line(why)
    return records


def read_metrics(run_dir: str | os.PathLike) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train, val) lists of (step, loss) from a run folder's metrics.jsonl."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no such file (is {run_dir} a zoo run folder?)")
    train, val = [], []
    for _, rec in read_records(path):
        if rec.loss is not None:
            train.append((rec.step, rec.loss))
        if rec.val_loss is not None:
            val.append((rec.step, rec.val_loss))
    return train, val


PREFERENCE_CURVES = ("rewards/margins", "rewards/accuracies")


def read_preference_metrics(run_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """A preference run's reward margin and accuracy, train and val, as (step, value) lists keyed
    by their names in metrics.jsonl (val_ prefixed); empty for any other run."""
    out: dict[str, list[tuple[int, float]]] = {}
    for _, rec in read_records(Path(run_dir) / METRICS_FILE):
        extra = rec.model_extra or {}
        for name in PREFERENCE_CURVES:
            for key in (name, "val_" + name):
                if isinstance(extra.get(key), (int, float)):
                    out.setdefault(key, []).append((rec.step, float(extra[key])))
    return out


def plot_run(run_dir: str | os.PathLike) -> Path:
    """Write run_dir/loss.png (atomically) and return its path."""
    import matplotlib  # heavy: imported when a plot is drawn, not with zoo

    matplotlib.use("Agg")  # files only; works without a display
    import matplotlib.pyplot as plt

    train, val = read_metrics(run_dir)
    if not train and not val:
        raise ValueError(f"{Path(run_dir) / METRICS_FILE}: no losses recorded yet")
    preference = read_preference_metrics(run_dir)
    if preference:
        fig, (ax, pref_ax) = plt.subplots(1, 2, figsize=(13, 4), dpi=100)
    else:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        if preference:
            _plot_preference(pref_ax, preference)
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
    finally:
        plt.close(fig)  # a failed write (a full disk) leaves no figure behind in a long session
    return out


def _plot_preference(ax, curves: dict[str, list[tuple[int, float]]]) -> None:
    """The reward margin (left axis) and the preference accuracy (right axis, 0 to 1)."""
    acc_ax = ax.twinx()
    styles = {"rewards/margins": (ax, "margin (train)", dict(linewidth=1, color="C0")),
              "val_rewards/margins": (ax, "margin (validation)", dict(marker="o", linewidth=1.5, color="C1")),
              "rewards/accuracies": (acc_ax, "accuracy (train)", dict(linewidth=1, color="C2", alpha=0.6)),
              "val_rewards/accuracies": (acc_ax, "accuracy (validation)", dict(marker="s", linewidth=1.5,
                                                                               color="C3"))}
    lines = []
    for key, (axis, label, style) in styles.items():
        if curves.get(key):
            lines += axis.plot(*zip(*curves[key]), label=label, **style)
    ax.set_xlabel("step")
    ax.set_ylabel("reward margin (chosen - rejected)")
    acc_ax.set_ylabel("preference accuracy")
    acc_ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(lines, [line.get_label() for line in lines], loc="best")
