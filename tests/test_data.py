"""Data: tokenize once into a cached memory-mapped file, windows, and every bad-input error."""

import os

import numpy as np
import pytest

from zoo.train.data import (
    DataError,
    Windows,
    list_text_files,
    token_dtype,
    tokenize_files,
    tokenizer_identity,
)


class Bytes:
    """A tiny stand-in tokenizer: UTF-8 bytes, EOS 256, BOS 257. `calls` counts encodes."""

    vocab_size, eos_id, bos_id = 258, 256, 257
    fingerprint = "test-bytes"

    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_tokenize_frames_documents_and_caches(tmp_path):
    a = write(tmp_path / "a.txt", "hello")
    b = write(tmp_path / "b.txt", "wörld")
    tok = Bytes()
    tf = tokenize_files([a, b], tok, tmp_path / "cache")
    assert not tf.reused and tf.tokens.dtype == np.uint16
    expected = [257, *b"hello", 256, 257, *"wörld".encode(), 256]
    assert tf.tokens.tolist() == expected
    assert isinstance(tf.tokens, np.memmap)

    again = tokenize_files([a, b], tok, tmp_path / "cache")
    assert again.reused and again.key == tf.key and tok.calls == 2  # no re-encode

    write(b, "world!")  # changed content (and size, mtime): re-tokenized
    changed = tokenize_files([a, b], tok, tmp_path / "cache")
    assert not changed.reused and changed.key != tf.key and tok.calls == 4


def test_same_size_edit_and_other_tokenizer_invalidate(tmp_path):
    a = write(tmp_path / "a.txt", "abcdef")
    tok = Bytes()
    first = tokenize_files([a], tok, tmp_path / "c")
    st = a.stat()
    write(a, "abcxef")
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: only the content hash differs
    assert not tokenize_files([a], tok, tmp_path / "c").reused

    class Other(Bytes):
        fingerprint = "test-other"

    assert tokenize_files([a], Other(), tmp_path / "c").key != first.key


def test_identity_without_fingerprint_probes_encoding():
    class Plain(Bytes):
        fingerprint = None

    class Shifted(Plain):
        def encode(self, text):
            return [min(b + 1, 255) for b in text.encode()]

    assert tokenizer_identity(Plain()) == tokenizer_identity(Plain())
    assert tokenizer_identity(Plain()) != tokenizer_identity(Shifted())


def test_folder_is_walked_sorted_skipping_hidden(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    write(d / "b.txt", "b")
    write(d / "sub" / "a.txt", "a")
    write(d / ".hidden", "\xff")
    assert [p.name for p in list_text_files([d])] == ["b.txt", "a.txt"]


def test_uint32_for_large_vocabularies():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_windows_are_reproducible_and_split(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    w = Windows(tokens, batch_size=4, seq_len=16, val_fraction=0.1, eval_batches=2, seed=3)
    assert (w.n_train, w.n_val) == (900, 100)
    x, y, positions = w.train_batch(5, 0)
    assert positions is None  # one stream: no packed examples
    assert x.dtype == np.int32 and x.shape == (4, 16) and np.array_equal(x[:, 1:], y[:, :-1])
    assert (y.max() < 900)  # training windows never reach into the validation split
    x2 = Windows(tokens, 4, 16, 0.1, 2, seed=3).train_batch(5, 0).x
    assert np.array_equal(x, x2)
    assert not np.array_equal(x, w.train_batch(5, 1)[0])
    val = list(w.val_batches())
    assert len(val) == 2 and all(v[0].min() >= 900 for v in val)
    assert np.array_equal(val[0][0], list(w.val_batches())[0][0])


# --- bad input ------------------------------------------------------------------------


def test_missing_data(tmp_path):
    with pytest.raises(DataError, match="no training data"):
        tokenize_files([], Bytes(), tmp_path)
    with pytest.raises(DataError, match=r"nope\.txt: no such file"):
        tokenize_files([tmp_path / "nope.txt"], Bytes(), tmp_path)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataError, match="emptydir: contains no files"):
        tokenize_files([tmp_path / "emptydir"], Bytes(), tmp_path)


def test_empty_file(tmp_path):
    e = write(tmp_path / "empty.txt", "  \n")
    with pytest.raises(DataError, match=r"empty\.txt: empty"):
        tokenize_files([e], Bytes(), tmp_path / "c")


def test_not_utf8_names_file_and_offset(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not UTF-8 .*byte 0xe9 at byte offset 3"):
        tokenize_files([bad], Bytes(), tmp_path / "c")
    assert not list((tmp_path / "c").glob("tokens-*.bin"))  # nothing half-written left behind


def test_shorter_than_one_sequence():
    with pytest.raises(DataError, match="shorter than one sequence"):
        Windows(np.arange(10, dtype=np.uint16), 2, seq_len=16, val_fraction=0.0, eval_batches=1, seed=0)
    with pytest.raises(DataError, match="after the validation split"):
        Windows(np.arange(30, dtype=np.uint16), 2, seq_len=16, val_fraction=0.1, eval_batches=1, seed=0)
