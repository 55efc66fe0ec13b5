"""A training run's folder as a format (docs/training.md, "The run folder"): where its
checkpoints are and what each holds besides the model. The trainer writes it (zoo/train/);
loading (load.py) reads it, so that every verb takes a run folder or one of its checkpoints.

    RUN/checkpoints/step-00000200/   a model (Hugging Face folder, or a LoRA run's PEFT adapter)
                                     + optimizer.safetensors + trainer_state.json
    RUN/config.json, model.safetensors, ...   the final model, once the run completes
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from ..core.errors import CheckpointError
from ..core.files import read_json

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_dirs(out: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders are not listed)."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def latest_checkpoint(out: str | os.PathLike) -> Optional[Path]:
    dirs = checkpoint_dirs(out)
    return dirs[-1] if dirs else None


def is_checkpoint(folder: Path) -> bool:
    """A run's checkpoint folder: it carries its trainer state."""
    return (folder / STATE_FILE).is_file()


def run_settings(folder: Path) -> dict:
    """The training settings (TrainConfig's fields, as JSON) of the run whose folder or
    checkpoint `folder` is: its own trainer state, else its newest checkpoint's; {} for a folder
    that is neither. Only read here: the trainer checks a state field by field when it resumes
    (train/checkpoint.load_state), and each setting taken from here is checked where it is used."""
    state_dir = folder if is_checkpoint(folder) else latest_checkpoint(folder)
    if state_dir is None:
        return {}
    path = state_dir / STATE_FILE
    state = read_json(path, "trainer state")
    config = state.get("config") if isinstance(state, dict) else None
    if not isinstance(config, dict):
        raise CheckpointError(path, f"no training settings (a JSON object) in {json.dumps('config')}", key="config")
    return config
