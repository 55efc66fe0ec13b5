"""zoo's own safetensors reader and writer: agreement with the safetensors package, dtype
conversion, validation of every header field, sharding, and atomic writes."""

import json
import os

import numpy as np
import pytest

from zoo.core.errors import CheckpointError
from zoo.io.safetensors import (
    CheckpointReader,
    SafetensorsFile,
    plan_shards,
    write_checkpoint,
    write_file,
)

st_numpy = pytest.importorskip("safetensors.numpy")


def _file(tmp_path, tensors, name="w.safetensors"):
    path = tmp_path / name
    st_numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _raw_file(path, header, data=b""):
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)
    return path


def test_reads_what_safetensors_writes(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    h = rng.standard_normal(7).astype(np.float16)
    d = rng.standard_normal((2, 2))
    path = _file(tmp_path, {"a": a, "h": h, "d": d, "empty": np.zeros((0, 4), np.float32)})
    with SafetensorsFile(path) as f:
        np.testing.assert_array_equal(f.read("a"), a)
        np.testing.assert_array_equal(f.read("h"), h.astype(np.float32))
        np.testing.assert_array_equal(f.read("d"), d.astype(np.float32))
        assert f.read("empty").shape == (0, 4)
        out = np.empty((5, 3), np.float32)
        f.copy_into("a", out, transpose=True)
        np.testing.assert_array_equal(out, a.T)
        assert f.metadata == {"format": "pt"}


def test_bf16_both_ways(tmp_path):
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    x = torch.randn(4, 6)
    x[0, 0] = float("nan")
    x[0, 1] = float("inf")
    st_torch.save_file({"x": x.bfloat16()}, str(tmp_path / "t.safetensors"))
    with SafetensorsFile(tmp_path / "t.safetensors") as f:
        got = f.read("x")
    np.testing.assert_array_equal(got, x.bfloat16().float().numpy())
    write_file(tmp_path / "z.safetensors", [("x", x.numpy()), ("xt", x.numpy().T)], dtype="BF16")
    back = st_torch.load_file(str(tmp_path / "z.safetensors"))
    assert back["x"].dtype == torch.bfloat16
    # torch's rounding (to nearest, ties to even); NaN stays NaN, inf stays inf
    torch.testing.assert_close(back["x"].float(), x.bfloat16().float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(back["xt"].float(), x.bfloat16().float().T, rtol=0, atol=0, equal_nan=True)


def test_written_file_loads_in_safetensors(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_file(tmp_path / "o.safetensors", [("a", a), ("at", a.T), ("h", a)], dtype="F32")
    back = st_numpy.load_file(str(tmp_path / "o.safetensors"))
    np.testing.assert_array_equal(back["a"], a)
    np.testing.assert_array_equal(back["at"], a.T)
    raw = (tmp_path / "o.safetensors").read_bytes()
    assert (8 + int.from_bytes(raw[:8], "little")) % 8 == 0  # data starts aligned
    write_file(tmp_path / "h.safetensors", [("a", a)], dtype="F16")
    assert st_numpy.load_file(str(tmp_path / "h.safetensors"))["a"].dtype == np.float16


@pytest.mark.parametrize("header, data, match", [
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "outside"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, b"\0" * 12, "needs 8"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "outside"),
    ({"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
    ({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "shape"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": "0-8"}}, b"\0" * 8, "data_offsets"),
    ({"x": [1, 2]}, b"", "not a JSON object"),
])
def test_bad_headers_name_file_and_tensor(tmp_path, header, data, match):
    path = _raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CheckpointError, match=match) as e:
        SafetensorsFile(path)
    assert str(e.value).startswith(f"{path}: 'x'")


def test_bad_files(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        SafetensorsFile(short)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="runs past the end"):
        SafetensorsFile(huge)
    notjson = tmp_path / "notjson.safetensors"
    notjson.write_bytes((4).to_bytes(8, "little") + b"\xff{x}")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        SafetensorsFile(notjson)
    ints = _file(tmp_path, {"i": np.arange(3)})
    with SafetensorsFile(ints) as f, pytest.raises(CheckpointError, match="'i': dtype I64"):
        f.read("i")
    with SafetensorsFile(ints) as f, pytest.raises(CheckpointError, match="'i': shape"):
        f.copy_into("i", np.empty(4, np.float32))
    with SafetensorsFile(ints) as f, pytest.raises(CheckpointError, match="'nope': tensor not in this file"):
        f.read("nope")
    with pytest.raises(CheckpointError, match="no such file"):
        CheckpointReader(tmp_path / "absent")


def test_index_errors(tmp_path):
    _file(tmp_path, {"a": np.zeros(2, np.float32)}, "model-00001-of-00001.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{weight_map")
    with pytest.raises(CheckpointError, match="index.json: not valid JSON"):
        CheckpointReader(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    with pytest.raises(CheckpointError, match="index.json: 'a'.*not a file name"):
        CheckpointReader(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="index.json: 'a'.*does not exist"):
        CheckpointReader(tmp_path)
    index.write_text(json.dumps({"weight_map": {"b": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(CheckpointError, match="00001.safetensors: 'b'.*not in this shard"):
        CheckpointReader(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    with CheckpointReader(tmp_path) as r:
        assert r.names == ["a"]
        with pytest.raises(CheckpointError, match="index.json: 'z': tensor missing"):
            r.read("z")


def test_sharding_plan_and_stale_files(tmp_path):
    assert plan_shards([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    tensors = [(f"t{i}", np.full((10,), i, np.float32)) for i in range(5)]
    written = write_checkpoint(tmp_path, tensors, max_shard_bytes=40)  # 40 bytes each: one per shard
    assert [p.name for p in written][-1] == "model.safetensors.index.json" and len(written) == 6
    with CheckpointReader(tmp_path) as r:
        assert r.names == [n for n, _ in tensors] and r.read("t3")[0] == 3
    written = write_checkpoint(tmp_path, tensors[:2], max_shard_bytes=40)  # fewer shards now
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)
    write_checkpoint(tmp_path, tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_interrupted_write_keeps_previous_file(tmp_path, monkeypatch):
    import zoo.io.safetensors as sio

    path = tmp_path / "model.safetensors"
    write_file(path, [("a", np.ones(3, np.float32))])
    before = path.read_bytes()
    real_encode, calls = sio._encode, []

    def interrupted(arr, dtype):  # the second tensor never gets written: Ctrl-C mid-save
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_encode(arr, dtype)

    monkeypatch.setattr(sio, "_encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_file(path, [("a", np.zeros(3, np.float32)), ("b", np.zeros(3, np.float32))])
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temporary file left behind
