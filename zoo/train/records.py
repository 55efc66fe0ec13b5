"""Records of training data, from the files they come in: JSONL (one JSON object a line), Parquet
files (the Hugging Face hub's format) and Arrow files (what `datasets.save_to_disk` writes), each
record a dict of its fields, named by where it is ("data file F, line N"; "data file F, row group
G, row R"), with the column mapping (--data-columns) applied.

JSONL records are taken as they are: a record's keys decide its shape (data.py, preference.py),
and a key no shape has is an error. A table's shape is decided once, by its columns: the shape
whose columns the table has (a column no shape uses, such as an id or a source, is not read), so
only the columns a shape needs are read, a batch of rows at a time (a file larger than memory is
read with memory bounded by the batch: BATCH_ROWS rows of the columns read).

pyarrow, which reads Parquet and Arrow, is an optional dependency (the `data` extra): imported only
when a table is read, and its absence an error saying which extra to install.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable, Hashable, Iterator, Mapping, Optional

from ..core.errors import CheckpointError
from ..core.files import read_json

# Rows a table is read in (a record batch of Parquet or Arrow): the memory a table's reading takes
# is this many rows of the columns read, whatever the size of the file.
BATCH_ROWS = 1024

TABLE_SUFFIXES = (".parquet", ".arrow")

# The fields a record may have, under the names zoo gives them: what --data-columns maps to.
FIELDS = ("text", "prompt", "completion", "messages", "conversations", "system", "instruction", "input", "output",
          "chosen", "rejected")

# A shape: its name, and (the fields it needs, the fields it may have).
Shapes = Mapping[str, tuple[set, set]]


class DataError(ValueError):
    """Training data that cannot be used: the message names the file at fault."""


# --- --data-columns -------------------------------------------------------------------------


def parse_columns(value) -> dict[str, str]:
    """The column mapping of --data-columns: "prompt=question,completion=answer" (or a mapping, as a
    config file gives it) to {"prompt": "question", "completion": "answer"}: zoo's field name to
    the data's column. ValueError naming what is wrong."""
    if value is None:
        return {}
    if isinstance(value, str):
        pairs = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            field, sep, column = part.partition("=")
            if not sep:
                raise ValueError(f"{part!r} is no FIELD=COLUMN pair (e.g. prompt=question,completion=answer)")
            if field.strip() in pairs:
                raise ValueError(f"{field.strip()!r} is mapped twice")
            pairs[field.strip()] = column.strip()
        value = pairs
    if not isinstance(value, Mapping):
        raise ValueError(f"expected FIELD=COLUMN pairs (e.g. prompt=question,completion=answer), got "
                         f"{type(value).__name__}")
    out = {}
    for field, column in value.items():
        if field not in FIELDS:
            raise ValueError(f"{field!r} is no field of a record; the fields: {', '.join(FIELDS)}")
        if not isinstance(column, str) or not column:
            raise ValueError(f"{field}: the column must be a non-empty name, got {column!r}")
        out[field] = column
    return out


def show_columns(columns: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in columns.items())


def _renamed(names, columns: Mapping[str, str]) -> dict[str, str]:
    """{field: column} of a record's keys or a table's columns under the mapping: a mapped column
    goes by its field's name; a column named as a field that the mapping takes elsewhere is hidden."""
    names = list(names)
    view = {}
    for field, column in columns.items():
        if column in names:
            view[field] = column
    for name in names:
        if name in columns.values():
            continue
        if name in columns and columns[name] in names:
            continue  # this field is taken from another column
        view.setdefault(name, name)
    return view


# --- reading -----------------------------------------------------------------------------------


def is_table(path: Path) -> bool:
    return path.suffix in TABLE_SUFFIXES


def pyarrow(path: Path):
    """The pyarrow module, or a DataError naming the file and the extra that brings it."""
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        kind = "Parquet" if path.suffix == ".parquet" else "Arrow"
        raise DataError(f"data file {path}: reading {kind} files needs pyarrow, which is not installed; install "
                        "zoo's data extra: pip install 'zoo[data]' (or pip install pyarrow)") from None
    return pa


def records(path: Path, shapes: Shapes, columns: Mapping[str, str] | None = None) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of a JSONL, Parquet or Arrow file."""
    if is_table(path):
        return _table_records(path, shapes, columns or {})
    return _jsonl_records(path, columns or {})


def uniform_records(path: Path, items: Iterator[tuple[str, dict]], shape_of: Callable[[dict, str], Hashable],
                    noun: Callable[[Hashable, bool], str]) -> Iterator[tuple[str, dict, Hashable]]:
    """(where, record, shape) for each of a file's records (items: records(path, ...), or records
    made from them), shape_of(record, where) its shape: every record of a file has the first one's
    (a DataError names the line that has another), and a file has at least one (a DataError names
    it). noun(shape, plural): the shape in those messages ("a text record", "text records")."""
    first = None
    for where, record in items:
        shape = shape_of(record, where)
        if first is None:
            first = shape
        elif shape != first:
            raise DataError(f"{where}: {noun(shape, False)} in a file of {noun(first, True)} (line 1 decides)")
        yield where, record, shape
    if first is None:
        raise DataError(f"data file {path}: no records (an empty {'table' if is_table(path) else 'JSONL file'})")


def _jsonl_records(path: Path, columns: Mapping[str, str]) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"data file {path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text (invalid byte 0x{raw[e.start]:02x})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise DataError(f"{where}: not JSON (nested too deeply)") from None
            if columns and isinstance(record, dict):
                record = {field: record[column] for field, column in _renamed(record, columns).items()}
            yield where, record


def table_shape(path: Path, names: list[str], shapes: Shapes, columns: Mapping[str, str]) -> tuple[str, dict]:
    """(shape, {field: column}) of a table with these columns: the shape whose fields it has (the
    one that needs the most of them, where one's fields hold another's)."""
    view = _renamed(names, columns)
    fits = [name for name, (required, _) in shapes.items() if required <= set(view)]
    best = [a for a in fits if all(shapes[b][0] <= shapes[a][0] for b in fits)]
    if len(best) != 1:
        mapped = f" (with --data-columns {show_columns(columns)})" if columns else ""
        known = "; ".join(f"{name} {{{', '.join(sorted(r | o))}}}" for name, (r, o) in shapes.items())
        if not fits:
            raise DataError(f"data file {path}: its columns {names}{mapped} have the fields of none of the shapes "
                            f"({known}); map yours with --data-columns FIELD=COLUMN,... "
                            "(e.g. prompt=question,completion=answer)")
        raise DataError(f"data file {path}: its columns {names}{mapped} fit several shapes ({', '.join(fits)}); "
                        "give the file with the columns of one")
    shape = best[0]
    required, optional = shapes[shape]
    return shape, {f: view[f] for f in sorted(required | (optional & set(view)))}


def _table_records(path: Path, shapes: Shapes, columns: Mapping[str, str]) -> Iterator[tuple[str, dict]]:
    pa = pyarrow(path)
    try:
        reader = _TableReader(pa, path)
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(pa, path, e) from None
    _, fields = table_shape(path, reader.names, shapes, columns)
    keys = list(fields)
    for part, first_row, batch in reader.batches(list(fields.values())):
        values = [batch.column(column).to_pylist() for column in fields.values()]
        for i, row in enumerate(zip(*values)):
            yield f"data file {path}, {part}, row {first_row + i}", dict(zip(keys, row))


def _unreadable(pa, path: Path, e: Exception) -> DataError:
    if isinstance(e, FileNotFoundError):
        return DataError(f"data file {path}: no such file")
    kind = "Parquet" if path.suffix == ".parquet" else "Arrow"
    return DataError(f"data file {path}: cannot be read as {kind} ({e})")


class _TableReader:
    """A Parquet or Arrow file: its column names, and its rows a record batch of at most BATCH_ROWS
    rows at a time, with where each is in the file (a Parquet row group, an Arrow record batch)."""

    def __init__(self, pa, path: Path):
        self.pa, self.path = pa, path
        if path.suffix == ".parquet":
            self.parquet = pa.parquet.ParquetFile(path)
            self.names = self.parquet.schema_arrow.names
            if self.parquet.metadata.num_rows == 0:
                raise DataError(f"data file {path}: no rows (an empty Parquet file)")
        else:
            self.parquet = None
            self.source = pa.memory_map(str(path), "r")  # the batches are views of the mapped file
            try:
                self.reader = pa.ipc.open_stream(self.source)  # what datasets writes
                self.stream = True
            except pa.ArrowInvalid:
                self.source.seek(0)
                self.reader = pa.ipc.open_file(self.source)  # the Arrow IPC file format (Feather v2)
                self.stream = False
            self.names = self.reader.schema.names

    def batches(self, columns: list[str]):
        try:
            yield from (self._parquet(columns) if self.parquet is not None else self._arrow(columns))
        except (self.pa.ArrowException, OSError) as e:
            raise _unreadable(self.pa, self.path, e) from None

    def _parquet(self, columns):
        for group in range(self.parquet.num_row_groups):
            row = 0
            for batch in self.parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=columns,
                                                   use_threads=False):
                yield f"row group {group}", row, batch
                row += batch.num_rows

    def _arrow(self, columns):
        reader = self.reader
        batches = iter(reader) if self.stream else (reader.get_batch(i) for i in range(reader.num_record_batches))
        rows = 0
        for number, batch in enumerate(batches):
            batch = batch.select(columns)
            rows += batch.num_rows
            for start in range(0, batch.num_rows, BATCH_ROWS):
                yield f"record batch {number}", start, batch.slice(start, BATCH_ROWS)
        if not rows:
            raise DataError(f"data file {self.path}: no rows (an empty Arrow file)")


# --- folders --------------------------------------------------------------------------------


def saved_dataset_files(folder: Path) -> Optional[list[Path]]:
    """The Arrow files of a folder `datasets.save_to_disk` wrote, in order: a Dataset's (state.json
    lists them) or a DatasetDict's "train" split; None where the folder is no such folder."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = read_json(folder / "dataset_dict.json", "datasets' dataset_dict.json").get("splits", [])
        except (CheckpointError, AttributeError) as e:
            raise DataError(f"data folder {folder}: dataset_dict.json is unreadable ({e})") from None
        if "train" not in splits:
            raise DataError(f"data folder {folder}: a saved DatasetDict without a \"train\" split (its splits: "
                            f"{splits}); give the folder of the split to train on")
        found = saved_dataset_files(folder / "train")
        if found is None:
            raise DataError(f"data folder {folder / 'train'}: no state.json (not a split datasets saved)")
        return found
    state = folder / "state.json"
    if not (state.is_file() and (folder / "dataset_info.json").is_file()):
        return None
    try:
        files = [folder / entry["filename"] for entry in read_json(state, "datasets' state.json")["_data_files"]]
    except (CheckpointError, KeyError, TypeError) as e:
        raise DataError(f"data folder {folder}: state.json does not list the data files ({e})") from None
    for f in files:
        if not f.is_file() or f.parent != folder:
            raise DataError(f"data folder {folder}: state.json lists {f.name}, which is not a file of the folder")
    if not files:
        raise DataError(f"data folder {folder}: a saved dataset of no data files")
    return files


# --- mixtures: --data a.parquet:0.7 b.jsonl:0.3 ---------------------------------------------------

_WEIGHTED = re.compile(r"(.+):([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)")


def split_weight(entry: str | os.PathLike) -> tuple[str, Optional[float]]:
    """(path, weight) of a --data entry: "a.parquet:0.7" -> ("a.parquet", 0.7); a path with no weight
    (or one that exists as written, colon and all) -> (path, None)."""
    text = os.fspath(entry)
    match = _WEIGHTED.fullmatch(text)
    if match is None or os.path.exists(text):
        return text, None
    return match[1], float(match[2])


def data_sources(entries) -> tuple[list[str], Optional[list[float]]]:
    """The paths of --data and their mixture weights (normalized to sum to 1; None where no entry
    has one). Every entry has a weight, or none does."""
    split = [split_weight(e) for e in entries]
    paths = [p for p, _ in split]
    weights = [w for _, w in split]
    if all(w is None for w in weights):
        return paths, None
    if any(w is None for w in weights):
        bare = [p for p, w in split if w is None]
        raise DataError(f"--data: {', '.join(bare)} without a weight in a mixture; give every source a weight "
                        "(PATH:WEIGHT, e.g. a.parquet:0.7 b.jsonl:0.3), or none")
    for p, w in split:
        if not w > 0:
            raise DataError(f"--data {p}:{w:g}: a mixture weight must be above 0")
    total = sum(weights)
    return paths, [w / total for w in weights]
