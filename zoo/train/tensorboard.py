"""TensorBoard event files (--report-to tensorboard), written by zoo itself: no TensorFlow, no
protobuf library, no tensorboard package (that is only needed to look at them).

An event file is a sequence of TFRecords, each

    uint64 length | uint32 masked CRC-32C of the length | data | uint32 masked CRC-32C of the data

(little-endian; the mask: ((crc >> 15) | (crc << 17)) + 0xa282ead8, mod 2^32), the data an
`Event` protocol buffer (tensorflow/core/util/event.proto):

    Event    1: wall_time (double)  2: step (int64)  3: file_version (string)  5: summary (Summary)
    Summary  1: value (repeated Value)
    Value    1: tag (string)  2: simple_value (float)

The first event of a file carries file_version "brain.Event:2"; each later one a step's scalars.
These few fields are encoded by hand here (varints, fixed 32/64-bit little-endian numbers,
length-delimited strings and messages).

metrics.jsonl stays the source of truth: the event file is derived from it. When a run starts or
resumes, the run folder's event files are replaced by one holding every record metrics.jsonl
keeps (a resumed run's truncated to its checkpoint), and each record written to metrics.jsonl
after that is added to it too. Tags: train/loss, train/learning_rate, train/grad_norm,
train/tokens_per_s, train/tokens, eval/loss, and the preference metrics as train/rewards/margins
..., eval/rewards/margins ... (the val_ ones).
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from pathlib import Path

EVENTS_PREFIX = "events.out.tfevents."
FILE_VERSION = b"brain.Event:2"

# metrics.jsonl's keys, by the tag TensorBoard shows (the others: train/KEY, and eval/KEY for val_KEY).
_FLOAT_MAX = 3.4028234663852886e38
_TAGS = {"loss": "train/loss", "lr": "train/learning_rate", "val_loss": "eval/loss"}


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord frames use it."""
    crc = 0xFFFFFFFF
    table = _CRC32C
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord frame around data."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data))


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # int64 as protobuf writes it (two's complement for a negative one)
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, file_version: bytes | None = None,
          scalars: dict[str, float] | None = None) -> bytes:
    """An Event message: its wall time and step, and a file version or a summary of scalars."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time)
    if step:
        out += _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version)
    if scalars:
        summary = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode("utf-8")) + _varint(2 << 3 | 5) + struct.pack("<f", value))
            for tag, value in scalars.items())
        out += _bytes_field(5, summary)
    return out


def scalars_of(metrics: dict) -> dict[str, float]:
    """A metrics.jsonl record's numbers by their TensorBoard tags (the step is the event's)."""
    out = {}
    for key, value in metrics.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        tag = _TAGS.get(key) or (f"eval/{key[4:]}" if key.startswith("val_") else f"train/{key}")
        value = float(value)
        if math.isfinite(value) and abs(value) > _FLOAT_MAX:  # beyond float32: its infinity
            value = math.copysign(math.inf, value)
        out[tag] = value
    return out


def event_files(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).glob(EVENTS_PREFIX + "*") if p.is_file())


class EventLog:
    """The run's event file: the earlier ones in `folder` replaced by one holding `replay` (the
    records metrics.jsonl keeps), then a record added per write()."""

    def __init__(self, folder: Path, replay: list[dict] = ()):
        for old in event_files(folder):
            old.unlink()
        now = time.time()
        self.path = Path(folder) / f"{EVENTS_PREFIX}{int(now)}.{socket.gethostname()}.{os.getpid()}.zoo"
        self._file = open(self.path, "wb")
        try:
            self._file.write(record(event(now, file_version=FILE_VERSION)))
            for metrics in replay:
                self._add(metrics)
            self._file.flush()
        except BaseException:
            self._file.close()
            raise

    def _add(self, metrics: dict) -> None:
        scalars = scalars_of(metrics)
        if scalars:
            self._file.write(record(event(time.time(), int(metrics.get("step", 0)), scalars=scalars)))

    def write(self, metrics: dict) -> None:
        """Add a metrics.jsonl record (flushed, as metrics.jsonl is)."""
        self._add(metrics)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def replay_records(metrics_path: Path) -> list[dict]:
    """The records of a metrics.jsonl (none where it is missing); lines that are no JSON object
    are left out (the run folder's truncate_metrics has named them)."""
    if not metrics_path.is_file():
        return []
    out = []
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out
