"""Fuzz cases of the files zoo reads: safetensors headers and byte ranges, the sharded index,
config.json, tokenizer files, non-finite weights, `zoo inspect`'s verdict against loading's, and
data files that are not regular files. Every corruption is made here, at test time, from a valid
checkpoint that zoo saved; each case runs in its own subprocess through tests/helpers.py (a timeout
catches a hang, a memory cap an unbounded allocation) and must end in one `zoo: error:` line that
names the file and the tensor, key or field, or be handled correctly."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import helpers
import numpy as np
import pytest

import zoo
from zoo.core.errors import EXIT_INPUT
from zoo.io.safetensors import INDEX_FILE, SINGLE_FILE, SafetensorsFile, write_file
from zoo.text.tokenizers import Tokenizer, bytes_to_unicode

# --- valid inputs, made once per module; each case corrupts a copy -----------------------


def _tiny_llama() -> "zoo.Model":
    model = zoo.Model(zoo.preset("tiny-llama"))
    model.init_weights(0)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint (untied: 21 tensors in model.safetensors) with zoo's tokenizer."""
    folder = tmp_path_factory.mktemp("fuzz_files") / "tiny"
    _tiny_llama().save_pretrained(folder, tokenizer=Tokenizer.byte_level())
    return folder


@pytest.fixture(scope="module")
def saved_sharded(tmp_path_factory) -> Path:
    """The same model in several shards with a model.safetensors.index.json."""
    folder = tmp_path_factory.mktemp("fuzz_files") / "sharded"
    _tiny_llama().save_pretrained(folder, tokenizer=Tokenizer.byte_level(), max_shard_bytes=150_000)
    return folder


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


@pytest.fixture
def sharded(saved_sharded, tmp_path) -> Path:
    return Path(shutil.copytree(saved_sharded, tmp_path / "sharded"))


def read_st(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (parsed) and data section, as stored."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_st(path: Path, header: dict | list | bytes, data: bytes, length: int | None = None) -> None:
    """A safetensors file with any header at all (no check: that is zoo's job)."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((len(h) if length is None else length).to_bytes(8, "little") + h + data)


def in_order(header: dict) -> list[str]:
    """Tensor names by where their bytes begin."""
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def generate(folder: Path, *extra: str) -> helpers.Result:
    return helpers.cli("generate", "--from", folder, "--max-new-tokens", "1", "--prompt", "a", *extra)


def api(code: str) -> helpers.Result:
    """Library calls in a subprocess; a ValueError (CheckpointError's kind) is printed as the one
    line the CLI's boundary prints, anything else escapes as a traceback (and fails assert_error)."""
    body = textwrap.indent(textwrap.dedent(code), "    ")
    return helpers.python(f"import sys\ntry:\n{body}\nexcept ValueError as e:\n"
                       "    print(f'zoo: error: {e}', file=sys.stderr)\n    sys.exit(1)\n")


def assert_same_verdict(folder: Path) -> str:
    """Loading fails; `zoo inspect` then fails with the same error or says "no: <that error>"."""
    loading = helpers.assert_error(generate(folder), status=EXIT_INPUT).removeprefix("zoo: error: ")
    r = helpers.cli("inspect", folder)
    if r.returncode == 0:
        assert f"zoo can load   no: {loading}" in r.stdout, r.stdout
    else:
        assert helpers.assert_error(r) == f"zoo: error: {loading}"
    return loading


def test_the_valid_checkpoints_load_and_inspect_says_so(saved, saved_sharded):
    for folder in (saved, saved_sharded):
        assert generate(folder).returncode == 0
        r = helpers.cli("inspect", folder)
        assert r.returncode == 0 and "zoo can load   yes, if its weights are finite (not scanned" in r.stdout, r


# --- safetensors: header, byte ranges, dtypes, shapes -------------------------------------


def test_overlapping_ranges_two_tensors_sharing_bytes(ckpt):
    path = ckpt / SINGLE_FILE
    header, data = read_st(path)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]  # b would alias a
    write_st(path, header, data)
    helpers.assert_error(generate(ckpt), str(path), repr(b), repr(a), "overlap", status=EXIT_INPUT)


def test_gap_between_tensors(ckpt):
    path = ckpt / SINGLE_FILE
    header, data = read_st(path)
    last = in_order(header)[-1]
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 4, end + 4]
    write_st(path, header, data[:begin] + b"\0" * 4 + data[begin:])
    helpers.assert_error(generate(ckpt), str(path), repr(last), "gap of 4 bytes", status=EXIT_INPUT)


def test_range_past_the_end_of_the_data(ckpt):
    path = ckpt / SINGLE_FILE
    header, data = read_st(path)
    last = in_order(header)[-1]
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 8, end + 8]
    write_st(path, header, data)
    helpers.assert_error(generate(ckpt), str(path), repr(last), "outside the file", status=EXIT_INPUT)


def test_data_section_longer_than_the_tensors(ckpt):
    path = ckpt / SINGLE_FILE
    header, data = read_st(path)
    write_st(path, header, data + b"\0" * 16)
    helpers.assert_error(generate(ckpt), str(path), repr(in_order(header)[-1]), "16 bytes after the last tensor",
                      status=EXIT_INPUT)


def test_header_length_beyond_the_file(ckpt):
    path = ckpt / SINGLE_FILE
    header, data = read_st(path)
    write_st(path, header, data, length=10**12)
    helpers.assert_error(generate(ckpt), str(path), "header length 1000000000000 runs past the end", status=EXIT_INPUT)


def test_header_length_zero(ckpt):
    path = ckpt / SINGLE_FILE
    header, data = read_st(path)
    write_st(path, header, data, length=0)
    helpers.assert_error(generate(ckpt), str(path), "header length 0", status=EXIT_INPUT)


def test_header_not_json(ckpt):
    path = ckpt / SINGLE_FILE
    _, data = read_st(path)
    write_st(path, b"{not json at all", data)
    helpers.assert_error(generate(ckpt), str(path), "header is not valid JSON", status=EXIT_INPUT)


def test_header_a_list(ckpt):
    path = ckpt / SINGLE_FILE
    _, data = read_st(path)
    write_st(path, b"[1, 2, 3]", data)
    helpers.assert_error(generate(ckpt), str(path), "header is not a JSON object", status=EXIT_INPUT)


@pytest.mark.parametrize("dtype", ["F7", ["F32"], None])
def test_dtype_unknown_or_not_a_string(ckpt, dtype):
    path = ckpt / SINGLE_FILE
    header, data = read_st(path)
    name = in_order(header)[3]
    header[name]["dtype"] = dtype
    write_st(path, header, data)
    helpers.assert_error(generate(ckpt), str(path), repr(name), f"unknown dtype {dtype!r}", status=EXIT_INPUT)


def test_shape_disagrees_with_byte_count(ckpt):
    path = ckpt / SINGLE_FILE
    header, data = read_st(path)
    name = "model.norm.weight"
    header[name]["shape"] = [header[name]["shape"][0] + 1]
    write_st(path, header, data)
    helpers.assert_error(generate(ckpt), str(path), repr(name), "bytes but F32", status=EXIT_INPUT)


def test_truncated_file(ckpt):
    path = ckpt / SINGLE_FILE
    header, _ = read_st(path)
    path.write_bytes(path.read_bytes()[:-100])
    helpers.assert_error(generate(ckpt), str(path), repr(in_order(header)[-1]), "truncated", status=EXIT_INPUT)


def test_zero_length_file(ckpt):
    (ckpt / SINGLE_FILE).write_bytes(b"")
    helpers.assert_error(generate(ckpt), str(ckpt / SINGLE_FILE), "0 bytes, too short", status=EXIT_INPUT)


def test_weights_file_a_fifo(ckpt):
    (ckpt / SINGLE_FILE).unlink()
    os.mkfifo(ckpt / SINGLE_FILE)
    helpers.assert_error(generate(ckpt), str(ckpt / SINGLE_FILE), "FIFO", status=EXIT_INPUT)


# --- the sharded index ---------------------------------------------------------------------


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX_FILE).read_text())


def _write_index(folder: Path, index) -> None:
    (folder / INDEX_FILE).write_text(json.dumps(index))


def test_index_not_json(sharded):
    (sharded / INDEX_FILE).write_text('{"weight_map": {')
    helpers.assert_error(generate(sharded), str(sharded / INDEX_FILE), "not valid JSON (line 1", status=EXIT_INPUT)


def test_index_weight_map_a_list(sharded):
    index = _index(sharded)
    index["weight_map"] = list(index["weight_map"].items())
    _write_index(sharded, index)
    helpers.assert_error(generate(sharded), str(sharded / INDEX_FILE), "weight_map", "dictionary", status=EXIT_INPUT)


def test_index_metadata_not_an_object(sharded):
    index = _index(sharded)
    index["metadata"] = "total_size"
    _write_index(sharded, index)
    helpers.assert_error(generate(sharded), str(sharded / INDEX_FILE), "metadata", status=EXIT_INPUT)


@pytest.mark.parametrize("shard", ["../x.safetensors", "/etc/passwd", "sub/model.safetensors"])
def test_index_shard_outside_the_folder(sharded, shard):
    index = _index(sharded)
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = shard
    _write_index(sharded, index)
    helpers.assert_error(generate(sharded), str(sharded / INDEX_FILE), repr(name), repr(shard), "not a file name",
                      status=EXIT_INPUT)


def test_index_missing_shard(sharded):
    shard = sorted(set(_index(sharded)["weight_map"].values()))[1]
    (sharded / shard).unlink()
    helpers.assert_error(generate(sharded), str(sharded / INDEX_FILE), repr(shard), "does not exist", status=EXIT_INPUT)


def test_index_shard_a_fifo(sharded):
    shard = sorted(set(_index(sharded)["weight_map"].values()))[1]
    (sharded / shard).unlink()
    os.mkfifo(sharded / shard)
    helpers.assert_error(generate(sharded), str(sharded / shard), "FIFO", status=EXIT_INPUT)


def test_index_tensor_in_two_shards(sharded):
    weight_map = _index(sharded)["weight_map"]
    first, second = sorted(set(weight_map.values()))[:2]
    name = next(n for n, s in weight_map.items() if s == first)
    with SafetensorsFile(sharded / first) as f:
        extra = f.read(name)
    with SafetensorsFile(sharded / second) as f:
        tensors = [(n, f.read(n)) for n in f.tensors]
    write_file(sharded / second, tensors + [(name, extra)])  # a second copy the index does not mention
    helpers.assert_error(generate(sharded), str(sharded / second), repr(name), f"also in shard {first!r}",
                      status=EXIT_INPUT)


# --- config.json ---------------------------------------------------------------------------


def test_config_a_list(ckpt):
    (ckpt / "config.json").write_text(json.dumps([json.loads((ckpt / "config.json").read_text())]))
    helpers.assert_error(generate(ckpt), str(ckpt / "config.json"), "not a JSON object", status=EXIT_INPUT)


def test_config_string_where_an_int_belongs(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["num_hidden_layers"] = "2"
    (ckpt / "config.json").write_text(json.dumps(config))
    helpers.assert_error(generate(ckpt), str(ckpt / "config.json"), "'num_hidden_layers'", "expected int",
                      status=EXIT_INPUT)


def test_config_model_type_a_list(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = ["llama"]
    (ckpt / "config.json").write_text(json.dumps(config))
    helpers.assert_error(helpers.cli("inspect", ckpt), str(ckpt / "config.json"), "'model_type'", "expected a string",
                      status=EXIT_INPUT)


def test_config_100_mb_of_garbage(ckpt):
    (ckpt / "config.json").write_bytes(b"\x7f" * (100 << 20))
    helpers.assert_error(helpers.cli("inspect", ckpt), str(ckpt / "config.json"), "not valid JSON", status=EXIT_INPUT)


@pytest.mark.parametrize("how", ["inspect", "generate", "from_pretrained"])
def test_config_a_fifo_does_not_hang(ckpt, how):
    (ckpt / "config.json").unlink()
    os.mkfifo(ckpt / "config.json")
    r = {"inspect": lambda: helpers.cli("inspect", ckpt), "generate": lambda: generate(ckpt),
         "from_pretrained": lambda: api(f"import zoo\nzoo.Model.from_pretrained({str(ckpt)!r})")}[how]()
    helpers.assert_error(r, str(ckpt / "config.json"), "FIFO, not a regular file")


def test_config_a_folder(ckpt):
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").mkdir()
    helpers.assert_error(generate(ckpt), str(ckpt / "config.json"), "a folder, not a regular file", status=EXIT_INPUT)


# --- tokenizer files -------------------------------------------------------------------------


def _tokenizer_json() -> dict:
    """A byte-level BPE tokenizer.json as Hugging Face tokenizers writes it: the 256 byte tokens,
    one merge ("h i"), one added token."""
    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    vocab[chars[ord("h")] + chars[ord("i")]] = 256
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 257, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None, "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": ["h i"]},
    }


@pytest.fixture
def tok(tmp_path) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(_tokenizer_json()))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def test_the_valid_tokenizer_json_loads(tok):
    t = Tokenizer.from_pretrained(tok)
    assert t.encode("hi<|endoftext|>") == [256, 257] and t.eos_id == 257


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("field, edit", [
    ("model", lambda d: d.update(model=[])),
    ("model.vocab", lambda d: d["model"].update(vocab="x")),
    ("model.vocab", lambda d: d["model"]["vocab"].update({"h": "7"})),
    ("model.merges", lambda d: d["model"].update(merges={"h": "i"})),
    ("model.merges", lambda d: d["model"].update(merges=[["h", "i", "x"]])),
    ("added_tokens", lambda d: d.update(added_tokens=5)),
    ("added_tokens.0.id", lambda d: d["added_tokens"][0].update(id="257")),
    ("pre_tokenizer", lambda d: d.update(pre_tokenizer="ByteLevel")),
    ("normalizer", lambda d: d.update(normalizer=["NFC"])),
])
def test_tokenizer_json_fields_of_the_wrong_type(ckpt, tok, field, edit):
    _edit_json(tok / "tokenizer.json", edit)
    helpers.assert_error(generate(ckpt, "--tokenizer", str(tok)), str(tok / "tokenizer.json"), field, status=EXIT_INPUT)


@pytest.mark.parametrize("file, field, value", [
    ("tokenizer_config.json", "bos_token", 5),
    ("tokenizer_config.json", "additional_special_tokens", "<|endoftext|>"),
    ("tokenizer_config.json", "added_tokens_decoder", ["<|endoftext|>"]),
    ("special_tokens_map.json", "eos_token", {"text": "<|endoftext|>"}),
    ("generation_config.json", "eos_token_id", "257"),
])
def test_tokenizer_side_files_of_the_wrong_type(ckpt, tok, file, field, value):
    (tok / file).write_text(json.dumps({field: value}))
    helpers.assert_error(generate(ckpt, "--tokenizer", str(tok)), str(tok / file), field, status=EXIT_INPUT)


def test_tokenizer_json_a_fifo(ckpt, tok):
    (tok / "tokenizer.json").unlink()
    os.mkfifo(tok / "tokenizer.json")
    helpers.assert_error(generate(ckpt, "--tokenizer", str(tok)), str(tok / "tokenizer.json"), "FIFO",
                         status=EXIT_INPUT)


def test_tokenizer_config_a_fifo(ckpt, tok):
    (tok / "tokenizer_config.json").unlink()
    os.mkfifo(tok / "tokenizer_config.json")
    helpers.assert_error(generate(ckpt, "--tokenizer", str(tok)), str(tok / "tokenizer_config.json"), "FIFO",
                      status=EXIT_INPUT)


@pytest.mark.parametrize("field, value", [("bos_token", ["<|bos|>"]), ("special_tokens", []),
                                          ("special_tokens", {"<|eos|>": 7})])
def test_zoo_tokenizer_fields_of_the_wrong_type(ckpt, field, value):
    _edit_json(ckpt / "zoo_tokenizer.json", lambda d: d.update({field: value}))
    helpers.assert_error(generate(ckpt), str(ckpt / "zoo_tokenizer.json"), field, status=EXIT_INPUT)


def test_zoo_tokenizer_a_list(ckpt):
    (ckpt / "zoo_tokenizer.json").write_text("[]")
    helpers.assert_error(generate(ckpt), str(ckpt / "zoo_tokenizer.json"), status=EXIT_INPUT)


# --- non-finite weights ----------------------------------------------------------------------


def _poison(folder: Path, values: dict[str, list[float]], dtype=np.float32) -> None:
    """Write `values` over the first elements of the named tensors of model.safetensors."""
    path = folder / SINGLE_FILE
    header, data = read_st(path)
    data = bytearray(data)
    for name, vals in values.items():
        begin = header[name]["data_offsets"][0]
        raw = np.asarray(vals, dtype=np.float32)
        encoded = (raw.view(np.uint32) >> 16).astype("<u2").tobytes() if dtype == "bf16" else raw.tobytes()
        data[begin:begin + len(encoded)] = encoded
    write_st(path, header, bytes(data))


NAN, INF = float("nan"), float("inf")
POISON = {"model.layers.1.mlp.up_proj.weight": [NAN, NAN, 1.0, NAN], "model.norm.weight": [-INF]}


def test_nonfinite_weights_refused_naming_file_counts_and_tensors(ckpt):
    _poison(ckpt, POISON)
    helpers.assert_error(generate(ckpt), str(ckpt / SINGLE_FILE), "4 non-finite values (NaN or Inf) in 2 of 21 tensors",
                      "'model.layers.1.mlp.up_proj.weight' (3)", "'model.norm.weight' (1)", "allow_nonfinite=True",
                      status=EXIT_INPUT)


def test_nonfinite_weights_allowed_with_the_flag_say_how_many_and_where(ckpt):
    _poison(ckpt, POISON)
    r = helpers.python(textwrap.dedent(f"""
        import warnings, numpy as np, zoo
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = zoo.Model.from_pretrained({str(ckpt)!r}, allow_nonfinite=True)
        print(int(np.isnan(model.parameters()["model.layers.1.mlp.up_proj.weight"]).sum()))
        print(*[str(w.message) for w in caught], sep="\\n")
    """))
    assert r.returncode == 0, r.stderr
    count, message = r.stdout.splitlines()[:2]
    assert count == "3"
    assert str(ckpt / SINGLE_FILE) in message and "4 non-finite values" in message
    assert "'model.norm.weight' (1)" in message


def test_nonfinite_bf16_weights_and_inspect_scan_agrees_with_loading(tmp_path):
    folder = tmp_path / "bf16"
    _tiny_llama().save_pretrained(folder, tokenizer=Tokenizer.byte_level(), dtype="bfloat16")
    _poison(folder, POISON, dtype="bf16")
    loading = helpers.assert_error(generate(folder), "4 non-finite values", status=EXIT_INPUT)
    r = api(f"""
        from zoo.io.inspect import format_inspection, inspect_checkpoint
        print(format_inspection(inspect_checkpoint({str(folder)!r}, scan=True)))
        print(format_inspection(inspect_checkpoint({str(folder)!r})))
    """)
    assert r.returncode == 0, r.stderr
    scanned, unscanned = r.stdout.split("\n" + str(folder) + "\n")
    assert f"zoo can load   no: {loading.removeprefix('zoo: error: ')}" in scanned
    assert "zoo can load   yes, if its weights are finite (not scanned for NaN/Inf" in unscanned


def test_inspect_scan_of_finite_weights_says_so(saved):
    r = api(f"""
        from zoo.io.inspect import format_inspection, inspect_checkpoint
        print(format_inspection(inspect_checkpoint({str(saved)!r}, scan=True)))
    """)
    assert r.returncode == 0 and "zoo can load   yes (weights scanned: all finite)" in r.stdout, r


# --- zoo inspect's verdict is loading's ------------------------------------------------------


def test_verdict_overlap(ckpt):
    path = ckpt / SINGLE_FILE
    header, data = read_st(path)
    names = in_order(header)
    header[names[2]]["data_offsets"] = [header[names[1]]["data_offsets"][0] + 4,
                                        header[names[1]]["data_offsets"][0] + 4 + header[names[2]]["data_offsets"][1]
                                        - header[names[2]]["data_offsets"][0]]
    write_st(path, header, data)
    assert "overlap" in assert_same_verdict(ckpt)


def test_verdict_integer_dtype(ckpt):
    path = ckpt / SINGLE_FILE
    header, data = read_st(path)
    header["model.norm.weight"]["dtype"] = "I32"  # same size: every header rule holds
    write_st(path, header, data)
    assert "dtype I32 is not a floating-point weight" in assert_same_verdict(ckpt)


def test_verdict_shape_against_config(ckpt):
    _edit_json(ckpt / "config.json", lambda d: d.update(intermediate_size=d["intermediate_size"] + 16))
    assert "expected" in assert_same_verdict(ckpt)


def test_verdict_missing_tensor(ckpt):
    path = ckpt / SINGLE_FILE
    header, data = read_st(path)
    last = in_order(header)[-1]
    begin = header.pop(last)["data_offsets"][0]
    write_st(path, header, data[:begin])
    assert repr(last) in assert_same_verdict(ckpt)


def test_verdict_truncated(ckpt):
    path = ckpt / SINGLE_FILE
    path.write_bytes(path.read_bytes()[:-4])
    assert "truncated" in assert_same_verdict(ckpt)


# --- data files ------------------------------------------------------------------------------


def _train(tmp_path: Path, data: str | Path) -> helpers.Result:
    return helpers.cli("train", "--data", data, "--steps", "1", "--out", tmp_path / "run", "--cache-dir",
                    tmp_path / "cache", "--batch-size", "1", "--seq-len", "8", "--no-progress")


def test_data_file_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "data.txt")
    helpers.assert_error(_train(tmp_path, tmp_path / "data.txt"), str(tmp_path / "data.txt"), "FIFO", status=EXIT_INPUT)


def test_data_file_a_device(tmp_path):
    helpers.assert_error(_train(tmp_path, "/dev/zero"), "/dev/zero", "a device", status=EXIT_INPUT)


def test_token_cache_meta_a_fifo_is_rebuilt(tmp_path):
    (tmp_path / "data.txt").write_text("some text to train on\n" * 20)
    r = api(f"""
        import os
        from pathlib import Path
        from zoo.train.data import tokenize_files
        from zoo.text.tokenizers import Tokenizer
        files, tok, cache = [{str(tmp_path / "data.txt")!r}], Tokenizer.byte_level(), Path({str(tmp_path / "cache")!r})
        first = tokenize_files(files, tok, cache)
        meta = first.path.with_suffix(".json")
        meta.unlink()
        os.mkfifo(meta)
        second = tokenize_files(files, tok, cache)
        print(second.reused, meta.is_file(), len(second.tokens) == len(first.tokens))
    """)
    assert r.returncode == 0 and r.stdout.split() == ["False", "True", "True"], r


def test_json_nested_too_deeply_is_one_clear_error(tmp_path):
    folder = tmp_path / "deep"
    folder.mkdir()
    helpers.write(folder / "config.json", "[" * 100000)
    helpers.assert_error(helpers.cli("inspect", folder), "config.json", "nested too deeply", status=1)
