"""Reading the files zoo reads: regular files only (a FIFO or a device in place of config.json
would block or never end), within a size bound, and JSON parsed into a typed model whose errors
name the file and the field. Every reader of a config, tokenizer, index or state file goes
through here, so these rules live in one place; the weight files (safetensors, GGUF) are read
through a memory map, MappedFile, opened and closed here for both formats."""

from __future__ import annotations

import json
import mmap
import os
import stat
from pathlib import Path
from typing import Any, Optional, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import CheckpointError

# A JSON or text file zoo reads whole: far above any real config, tokenizer or state file
# (a Llama 3 tokenizer.json is 9 MB), far below what would exhaust memory.
MAX_TEXT_FILE_BYTES = 1 << 30

M = TypeVar("M", bound=BaseModel)


def regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """path, if it names a regular file (symbolic links followed); else CheckpointError naming it.
    Checked with stat, which never blocks, before anything opens the file."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise CheckpointError(p, f"no such {what}") from None
    except OSError as e:
        raise CheckpointError(p, f"cannot read this {what} ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device")
        raise CheckpointError(p, f"this {what} is {kind}, not a regular file")
    return p


def read_text(path: str | os.PathLike, what: str = "file", max_bytes: int = MAX_TEXT_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most max_bytes."""
    p = regular_file(path, what)
    size = p.stat().st_size
    if size > max_bytes:
        raise CheckpointError(p, f"this {what} is {size:,} bytes, more than the {max_bytes:,} zoo reads")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(p, f"not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise CheckpointError(p, f"cannot read this {what} ({e.strerror or e})") from None


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """The parsed JSON of a regular file; a syntax error names the line and column."""
    p = Path(path)
    text = read_text(p, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(p, f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:  # "[[[[..." deeper than Python's parser goes
        raise CheckpointError(p, "JSON nested too deeply to read") from None


def field_errors(e: ValidationError) -> str:
    """pydantic's errors as 'field.path: message; ...', the field named as a dotted path."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts[:5]) + (f" (and {len(parts) - 5} more)" if len(parts) > 5 else "")


def first_field_error(e: ValidationError) -> tuple[str, str]:
    """(field, message) of a config's first validation error. A field error has a location; a
    cross-field check has none and starts its message with the field's name."""
    first = e.errors()[0]
    msg = first["msg"].removeprefix("Value error, ")
    return (str(first["loc"][0]) if first["loc"] else msg.split(":", 1)[0]), msg


def parse_model(path: str | os.PathLike, model: type[M], data: Any, what: Optional[str] = None) -> M:
    """data (already parsed from path) validated as model; errors name the file and the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise CheckpointError(path, f"{what or 'this file'} does not hold what zoo expects: {field_errors(e)}") from None


def read_json_model(path: str | os.PathLike, model: type[M], what: str = "JSON file") -> M:
    """A JSON file parsed into a typed model: regular file, size bound, syntax and every field
    checked, each error naming the file (and the line or the field)."""
    return parse_model(path, model, read_json(path, what), what)


class MappedFile:
    """A regular file of a binary format, read through a read-only memory map (`_map`, `size`
    bytes) that `with` or close() releases. The subclass parses its header in `_parse` when the
    object is made; should that fail, the map is released before the error goes on."""

    def __init__(self, path: str | os.PathLike, format_name: str, min_size: int):
        """format_name: the format's name in messages ("safetensors"); min_size: the bytes its
        smallest header takes (a shorter file is refused, naming its size)."""
        self.path = regular_file(path, f"{format_name} file")  # a FIFO would block open()
        try:
            with open(self.path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                if self.size < min_size:
                    raise CheckpointError(self.path, f"file is {self.size} bytes, too short for a {format_name} "
                                                     "header (truncated?)")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise CheckpointError(self.path, f"cannot read: {e.strerror or e}") from None
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view; the map closes when that view is freed


def show_value(value) -> str:
    """A value from a file, for a message: its repr, cut short (a field may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
