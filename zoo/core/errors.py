"""zoo's error types and the exit statuses of the `zoo` command. Every error names what is at
fault (the file and, where there is one, the tensor, key or field; the flag; the numbers), so
a user can find the problem without a debugger."""

from __future__ import annotations

import os


class CheckpointError(ValueError):
    """A checkpoint, config or tokenizer file that zoo cannot use as it is."""

    def __init__(self, path: str | os.PathLike, message: str, key: str | None = None):
        self.path = str(path)
        self.key = key
        where = f"{self.path}: {key!r}" if key is not None else self.path
        super().__init__(f"{where}: {message}")


class ChatTemplateError(ValueError):
    """A chat template that cannot render a conversation (a syntax error, raise_exception, a
    template that is not prefix-stable) or a conversation it cannot take (an unknown role).
    The message starts with where the template came from, e.g. "DIR/tokenizer_config.json
    chat_template", then what failed."""

    def __init__(self, origin: str, message: str):
        self.origin = origin
        super().__init__(f"{origin}: {message}")


class DistributedError(RuntimeError):
    """A distributed run that cannot start or go on as launched (MPI missing or not the
    launcher's, ranks that disagree on their data or weights); the message says which rank."""


class TrainError(RuntimeError):
    """A run that cannot start or go on; the message says why and what was kept."""


class TrainInterrupted(Exception):
    """Ctrl-C: a checkpoint was saved (see .checkpoint) and the run stopped."""

    def __init__(self, step: int, checkpoint: os.PathLike):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(f"interrupted at step {step}; checkpoint saved to {checkpoint}")


class ResourceError(RuntimeError):
    """The machine lacks the memory or disk space something needs; the message gives both numbers
    (what is needed, what there is) and what would make it fit."""


# Exit statuses of the `zoo` command (cli.main): one per class of failure, so that scripts can
# tell them apart. docs/troubleshooting.md lists them.
EXIT_INPUT = 1  # a file, config, flag value or data set zoo cannot use as it is
EXIT_USAGE = 2  # the command line itself (unknown flag, missing argument: argparse)
EXIT_RESOURCES = 3  # not enough memory or disk space
EXIT_FILESYSTEM = 4  # a file or folder that cannot be read or written (permissions, read-only)
EXIT_RANK_LOST = 5  # a distributed run lost a rank (died, hung); every rank stopped, the run can --resume
EXIT_INTERNAL = 70  # a bug in zoo: a one-line summary and the path of a file with the traceback
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM; the run can --resume
