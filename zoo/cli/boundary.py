"""The one error boundary of the `zoo` command: the verb runs inside it, and every failure ends
as one `zoo: error: ...` line and an exit status of its class (zoo/core/errors.py;
docs/troubleshooting.md lists them); a bug of zoo as one line and a crash file with the
traceback. Also the standard streams as a verb sees them (Stream): stdout names itself in errors,
and a training run's console outlives its reader."""

from __future__ import annotations

import argparse
import datetime
import errno
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable

from pydantic import ValidationError

from ..core.errors import (
    EXIT_FILESYSTEM,
    EXIT_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_RESOURCES,
    EXIT_USAGE,
    DistributedError,
    ResourceError,
    TrainError,
    TrainInterrupted,
)
from ..core.files import field_errors

# OSError numbers that mean the machine ran out of room, not that the path is wrong.
_OUT_OF_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.ENOMEM}
# How much of an internal error's message the one-line summary shows.
_SUMMARY_CHARS = 200


def main(argv: list[str] | None, build_parser: Callable[[], argparse.ArgumentParser]) -> int:
    """`zoo ARGV...` (sys.argv without argv) with the parser build_parser() makes: its exit status."""
    try:
        status = _run_verb(argv, build_parser)
    except BrokenPipeError:
        # The reader has all it wanted (`zoo inspect DIR | head -n 1`): end quietly with 0, like
        # other Unix tools. Stdout goes to /dev/null so that the flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    _end_ranks(status)
    return status


def _end_ranks(status: int) -> None:
    """A rank of a distributed run that fails on its own ends the whole job (the others would
    wait for it until --rank-timeout); ranks that stop together, or succeed, end normally."""
    distributed = sys.modules.get("zoo.train.distributed")  # loaded by every distributed run
    group = distributed.current() if distributed is not None else None
    if group is not None and status != 0 and not group.agreed_stop:
        group.abort(status)


def _error_prefix() -> str | None:
    """How this process's error line starts: "" for one process and rank 0, "rank N: " for
    the others; None when rank 0 reports the error for every rank (they all stopped on it)."""
    distributed = sys.modules.get("zoo.train.distributed")
    group = distributed.current() if distributed is not None else None
    if group is None or group.is_root:
        return ""
    return None if group.agreed_stop else f"rank {group.rank}: "


def _run_verb(argv: list[str] | None, build_parser: Callable[[], argparse.ArgumentParser]) -> int:
    """The verb, inside zoo's one error boundary: every failure ends as one `zoo: error: ...`
    line and an exit status of its class (zoo/core/errors.py; docs/troubleshooting.md lists them)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = None
    real_stdout = sys.stdout
    sys.stdout = Stream(real_stdout, STDOUT_NAME)
    try:
        try:
            parser = build_parser()
            args = parser.parse_args(argv)  # a usage error exits 2 here, as argparse does
            if args.verb is None:
                parser.print_help()
                return EXIT_USAGE
            return args.run(args) or 0
        finally:  # after --help's SystemExit too
            try:
                # So that a closed pipe or a full disk shows here, not at interpreter exit; unless
                # the verb failed already: then its error is the one to report.
                if sys.exc_info()[0] is None or isinstance(sys.exc_info()[1], SystemExit):
                    sys.stdout.flush()
                else:
                    try:
                        sys.stdout.flush()
                    except OSError:
                        pass
            finally:
                sys.stdout = real_stdout
    except BrokenPipeError:
        raise  # an OSError, but no error: main() ends quietly
    except TrainInterrupted as e:
        _say_error(f"{e}; continue with the same command and --resume")
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        _say_error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the boundary: each class gets its line and status
        status, message = _error_line(e, args, argv)
        _say_error(f"error: {message}")
        return status


def _say_error(line: str) -> None:
    prefix = _error_prefix()
    if prefix is not None:
        print(f"zoo: {prefix}{line}", file=sys.stderr)


class Stream:
    """A standard stream while a verb runs. A write or flush that fails points the stream's
    descriptor at /dev/null (what the stream still holds cannot be written: so the flush at
    interpreter exit does not fail again, after the one error line) and raises an OSError that
    names the stream, as the errors of other files name the file: a full disk behind
    `zoo inspect DIR > file`. With outlive_reader, a reader that went away (BrokenPipeError) is
    no error: the stream takes what is written from then on and drops it. That is stderr during a
    training run (`zoo train 2>&1 | head`): the run goes on without a console, train.log keeping
    every line, instead of dying at the next progress update."""

    def __init__(self, stream, name: str, outlive_reader: bool = False):
        self._stream, self.name, self.outlive_reader = stream, name, outlive_reader
        self.gone = False  # the reader went away

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except OSError as e:
                if not self._lost(e):
                    raise
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except OSError as e:
                if not self._lost(e):
                    raise

    def _lost(self, e: OSError) -> bool:
        """Whether the stream goes on without its reader (else the caller raises e, named)."""
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except Exception:  # noqa: BLE001 - a stream without a descriptor (pytest's capture)
            pass
        if self.outlive_reader and isinstance(e, BrokenPipeError):
            self.gone = True
            return True
        if e.filename is None:
            e.filename = self.name
        return False

    def __getattr__(self, name):  # isatty, fileno, encoding ... of the real stream
        return getattr(self._stream, name)


STDOUT_NAME = "<standard output>"
STDERR_NAME = "<standard error>"


def _error_line(e: Exception, args: argparse.Namespace | None, argv: list[str]) -> tuple[int, str]:
    """The exit status and the one-line message of an exception that reached the boundary."""
    if isinstance(e, (ResourceError, MemoryError)) or (isinstance(e, OSError) and e.errno in _OUT_OF_ROOM):
        return EXIT_RESOURCES, _resource_message(e, args)
    if isinstance(e, OSError):
        return EXIT_FILESYSTEM, _os_message(e, args)
    if isinstance(e, ValidationError):  # pydantic's text spans lines: one line, the fields named
        return EXIT_INPUT, f"{e.title}: {field_errors(e)}"
    if isinstance(e, KeyError):
        return EXIT_INPUT, _key_message(e)
    if isinstance(e, (ValueError, TrainError, DistributedError)) or (isinstance(e, RuntimeError)
                                                                      and str(e).startswith("zoo: ")):
        # "zoo: " starts the native core's expected errors: the line has it once already
        return EXIT_INPUT, _one_line(str(e).removeprefix("zoo: ")) or type(e).__name__
    return EXIT_INTERNAL, _internal_message(e, argv)


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _verb(args: argparse.Namespace | None) -> str:
    return f"zoo {args.verb}" if args is not None and getattr(args, "verb", None) else "zoo"


def _written_place(args: argparse.Namespace | None) -> str | None:
    """The folder the verb writes to, as its flag names it (--out DIR, convert's DST, merge's OUT_DIR)."""
    for name, shown in (("out", "--out"), ("dst", "OUT_DIR" if getattr(args, "verb", None) == "merge" else "DST")):
        value = getattr(args, name, None)
        if value:
            return f"{shown} {value}"
    return None


def _resource_message(e: Exception, args: argparse.Namespace | None) -> str:
    """Not enough memory or disk: what ran short and, as far as known, for what."""
    detail = _one_line(str(e.strerror if isinstance(e, OSError) and e.strerror else e)).removeprefix("zoo: ")
    if isinstance(e, ResourceError):
        return detail  # zoo's own: both numbers and what would make it fit
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        where = e.filename or _written_place(args)
        target = f"writing {where}" if where else f"writing a file of {_verb(args)}"
        return f"not enough disk space {target} ({detail}); free space there or write elsewhere"
    # MemoryError: pybind11 turns std::bad_alloc into one (saying no more), the native arenas
    # theirs (naming the arena and its size), numpy's names the array it wanted.
    what = "" if detail in ("", "std::bad_alloc", "bad allocation") else f" ({detail})"
    if isinstance(e, OSError) and e.filename:
        what = f" ({e.filename}: {detail})"
    return (f"not enough memory for {_verb(args)}{what}; try a smaller model, batch or sequence length, "
            f"or close other programs")


def _os_message(e: OSError, args: argparse.Namespace | None) -> str:
    """A file or folder zoo cannot read or write: the path, and why."""
    reason = e.strerror or _one_line(str(e)) or type(e).__name__
    if e.filename is not None and e.filename2 is not None:
        return f"{e.filename} -> {e.filename2}: {reason}"
    if e.filename is not None:
        return f"{e.filename}: {reason}"
    where = _written_place(args)
    return f"{_verb(args)}{' (' + where + ')' if where else ''}: a file operation failed: {reason}"


def _key_message(e: KeyError) -> str:
    """str(KeyError) quotes the key alone (`zoo: error: 'config'`): say that a key is missing,
    unless the KeyError carries a sentence of its own (unknown preset ...)."""
    key = e.args[0] if e.args else None
    if isinstance(key, str) and " " in key.strip():
        return _one_line(key)
    return f"missing key {key!r}"


def _internal_message(e: Exception, argv: list[str]) -> str:
    """A bug of zoo: one line with the exception, the full traceback in a crash file."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    if len(first) > _SUMMARY_CHARS:
        first = first[:_SUMMARY_CHARS - 3] + "..."
    summary = f"{type(e).__name__}: {first}" if first else type(e).__name__
    path, why_not = _write_crash_file(e, argv)
    saved = (f"the full traceback is in {path}" if path is not None
             else f"the traceback could not be saved ({why_not})")
    return f"internal error ({summary}); {saved}; please report it"


def _crash_folders() -> list[Path]:
    """Where crash files go, in order of preference: the user's cache, then the temp folder."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(cache) / "zoo" / "crashes", Path(tempfile.gettempdir())]


def _write_crash_file(e: BaseException, argv: list[str]) -> tuple[Path | None, str]:
    """The traceback in a new file named by time and pid: (its path, "") or (None, why not).
    Never raises: it runs while another error is being reported."""
    try:
        text = (f"zoo {' '.join(argv)}\npython {sys.version.split()[0]}, pid {os.getpid()}\n\n"
                + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
        name = f"zoo-crash-{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.txt"
        folders = _crash_folders()
    except Exception as inner:  # noqa: BLE001
        return None, f"{type(inner).__name__}: {inner}"
    why_not = "no folder to write to"
    for folder in folders:
        path = folder / name
        created = False
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never over another file
            created = True
            with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
            return path, ""
        except Exception as inner:  # noqa: BLE001 - try the next folder
            why_not = f"{folder}: {getattr(inner, 'strerror', None) or inner}"
            if created:  # a full disk: no half-written crash file left behind
                try:
                    os.unlink(path)
                except OSError:
                    pass
    return None, why_not
