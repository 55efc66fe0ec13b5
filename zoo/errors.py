"""The one error type for files zoo reads or writes: it always names the file and, where
there is one, the tensor or key, so a user can find the problem without a debugger."""

from __future__ import annotations

import os


class CheckpointError(ValueError):
    """A checkpoint, config or tokenizer file that zoo cannot use as it is."""

    def __init__(self, path: str | os.PathLike, message: str, key: str | None = None):
        self.path = str(path)
        self.key = key
        where = f"{self.path}: {key!r}" if key is not None else self.path
        super().__init__(f"{where}: {message}")
