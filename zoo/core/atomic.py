"""Atomic file writes: a write that is interrupted leaves the previous file intact.

The new content goes to a temporary file in the same folder (so os.replace is a rename on
one filesystem), is flushed and fsynced, then replaces the target; the folder is fsynced
so the rename itself survives a power loss. The temporary file is created as open() creates
any file, mode 0666 less the umask, and the rename keeps that mode: files zoo writes are
readable by others exactly when the user's other files are (tempfile.mkstemp would make
every one of them 0600).

A temporary file is named `.<name>.<pid>.<random>.tmp`: the pid says which process wrote it,
so a later run can tell a dead writer's leftover (TEMP_FILE_NAME) from a live one's.

A failed write raises OSError with `filename` set to the file being written: the kernel's
"[Errno 28] No space left on device" names no file, and a full disk is only fixable when the
user knows where zoo was writing.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

# The temporary files of atomic_open (`.<name>.<pid>.<8 hex digits>.tmp`) and the
# `.<name>.<pid>.tmp` ones of the trainer's publishing: group 1 is the pid of the process that
# made it. The random part has a fixed width and is tried first, so an all-digit one is never
# taken for the pid.
TEMP_FILE_NAME = re.compile(r"^\..+?\.(\d+)\.[0-9a-f]{8}\.tmp$|^\..+\.(\d+)\.tmp$")


def temp_file_pid(name: str) -> int | None:
    """The pid in a temporary file's name (TEMP_FILE_NAME), or None if it is not one."""
    m = TEMP_FILE_NAME.match(name)
    return None if m is None else int(m.group(1) or m.group(2))


def named(e: OSError, path: str | os.PathLike) -> OSError:
    """`e` with the file it concerns: e itself if it names one, else the same error for `path`
    (OSError(errno, ...) picks the subclass, e.g. PermissionError, from the number)."""
    if e.filename is not None or e.errno is None:
        return e
    return OSError(e.errno, e.strerror, os.fspath(path))


@contextmanager
def atomic_open(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Open `path` for binary writing; the file appears only when the block ends without error."""
    path = Path(path)
    fd, tmp = _create_temp(path)
    f = os.fdopen(fd, "wb")
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
    except BaseException as e:
        _discard(f, tmp)
        if isinstance(e, OSError):
            raise named(e, path) from None
        raise
    fsync_dir(path.parent)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary file beside `path` for a writer that opens files by name (gguf's GGUFWriter);
    it replaces `path` when the block ends without error, and is removed when it fails."""
    path = Path(path)
    fd, tmp = _create_temp(path)
    os.close(fd)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise named(e, path) from None
        raise
    fsync_dir(path.parent)


def _discard(f: BinaryIO, tmp: Path) -> None:
    """Close and remove a temporary file whose write failed. Closing flushes what is buffered,
    which fails again on a full disk: that second error says nothing new."""
    try:
        f.close()
    except OSError:
        pass
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new empty file beside `path`, open for writing. The kernel applies the umask (and a
    folder's default ACL) to the 0666 asked for here, as for any other new file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:  # a name another writer holds: draw again
            continue
        except OSError as e:  # a full disk, no inodes, a read-only folder: name the file meant
            raise OSError(e.errno, e.strerror, os.fspath(path)) from None
    raise FileExistsError(f"{path.parent}: no free temporary file name for {path.name}")


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make renames and deletions in `folder` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Make a file's content durable; an error names the file."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise named(e, path) from None


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path) as f:
        f.write(data)


def write_json(path: str | os.PathLike, obj) -> None:
    write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    with open(src, "rb") as fin, atomic_open(dst) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
