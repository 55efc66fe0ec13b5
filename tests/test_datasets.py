"""Data as the ecosystem publishes it (issue 34): Parquet shards, Arrow folders datasets saved,
ShareGPT conversations, column mapping, weighted mixtures, and runs watched in TensorBoard.

Every table and JSONL file is built here, in code, from the same records, and each form must
give the token stream and loss mask of its JSONL twin, and train to the same losses. The run
tests are tiny (tiny-llama, byte-level tokenizer, 3-8 steps, one thread)."""

import argparse
import json
import signal
import sys

import numpy as np
import pytest
from helpers import needs

import zoo
from zoo.text.chat_template import FALLBACK_TEMPLATE, ChatTemplate
from zoo.train.config import TrainConfig
from zoo.train.data import DataError, MixedWindows, tokenize_files, training_data
from zoo.train.preference import tokenize_pairs
from zoo.train.records import data_sources, parse_columns
from zoo.train.tensorboard import crc32c, event_files
from zoo.train.trainer import Trainer, TrainInterrupted

BYTES = zoo.Tokenizer.byte_level()
TEMPLATE = ChatTemplate(FALLBACK_TEMPLATE, "zoo's fallback", BYTES.bos_token, BYTES.eos_token)


def chats(n=24, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(v) for v in rng.integers(0, 50, 2))
        messages = [{"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer in words."})
        if i % 4 == 1:
            messages += [{"role": "user", "content": "And doubled?"},
                         {"role": "assistant", "content": f"{2 * (a + b)}."}]
        out.append({"messages": messages})
    return out


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet(path, records, row_group_size=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def same_tokens(a, b):
    """The token stream, the loss mask and the examples' boundaries of two token files are equal."""
    for field in ("tokens", "trained", "starts"):
        assert np.array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field))), field


def tokenize(paths, tmp_path, **kw):
    return tokenize_files(paths, BYTES, tmp_path / "cache", TEMPLATE, **kw)


def run_config(tmp_path, name, data, **kw):
    base = dict(preset="tiny-llama", data=[str(d) for d in data], out=str(tmp_path / name),
                cache_dir=str(tmp_path / "cache"), batch_size=4, seq_len=64, steps=3, lr=3e-3, eval_every=0,
                eval_batches=1, save_every=0, threads=1, progress=False, sample_tokens=0, val_fraction=0.2)
    base.update(kw)
    return TrainConfig(**base)


def losses(out):
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in recs]


def train(tmp_path, name, data, **kw):
    Trainer(run_config(tmp_path, name, data, **kw)).run()
    return losses(tmp_path / name)


# --- Parquet, Arrow, ShareGPT: the JSONL's tokens, mask and losses ---------------------------


@needs("pyarrow")
def test_parquet_shards_read_as_the_jsonl_they_hold(tmp_path):
    records = chats()
    jsonl = write_jsonl(tmp_path / "chats.jsonl", records)
    shards = tmp_path / "shards"
    # two shards of several row groups, as the hub lays a data set out; the card is left out
    write_parquet(shards / "data" / "train-00000-of-00002.parquet", records[:10], row_group_size=4)
    write_parquet(shards / "data" / "train-00001-of-00002.parquet", records[10:], row_group_size=5)
    (shards / "README.md").write_text("# a data set card\n")
    tf = tokenize([shards], tmp_path)
    assert [f.suffix for f in tf.files] == [".parquet", ".parquet"] and tf.formats == ["chat", "chat"]
    same_tokens(tf, tokenize([jsonl], tmp_path))
    assert train(tmp_path, "parquet", [shards]) == train(tmp_path, "jsonl", [jsonl])


@needs("pyarrow", "datasets")
def test_a_saved_dataset_folder_reads_as_its_jsonl(tmp_path):
    import datasets

    records = chats()
    jsonl = write_jsonl(tmp_path / "chats.jsonl", records)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    tf = tokenize([tmp_path / "saved"], tmp_path)
    assert [f.suffix for f in tf.files] == [".arrow", ".arrow"]  # state.json's files, not its JSON
    same_tokens(tf, tokenize([jsonl], tmp_path))
    # a DatasetDict: its train split
    split = datasets.DatasetDict({"train": datasets.Dataset.from_list(records),
                                  "test": datasets.Dataset.from_list(records[:2])})
    split.save_to_disk(str(tmp_path / "dict"))
    same_tokens(tokenize([tmp_path / "dict"], tmp_path), tokenize([jsonl], tmp_path))
    assert train(tmp_path, "arrow", [tmp_path / "saved"]) == train(tmp_path, "jsonl", [jsonl])


def sharegpt(record):
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in record["messages"]]}


def test_sharegpt_conversations_are_chats(tmp_path):
    records = chats()
    jsonl = write_jsonl(tmp_path / "chats.jsonl", records)
    share = write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt(r) for r in records])
    tf = tokenize([share], tmp_path)
    assert tf.formats == ["sharegpt"] and tf.masked
    same_tokens(tf, tokenize([jsonl], tmp_path))
    # a "system" field beside the conversation is its first turn
    with_system = [{"system": "Answer in words.", "conversations": sharegpt(r)["conversations"][1:]}
                   if r["messages"][0]["role"] == "system" else sharegpt(r) for r in records]
    same_tokens(tokenize([write_jsonl(tmp_path / "sys.jsonl", with_system)], tmp_path), tf)
    assert train(tmp_path, "sharegpt", [share]) == train(tmp_path, "jsonl", [jsonl])


@needs("pyarrow")
def test_sharegpt_parquet_with_other_columns(tmp_path):
    records = chats()
    rows = [{"id": f"r{i}", "source": "gen", **sharegpt(r)} for i, r in enumerate(records)]
    tf = tokenize([write_parquet(tmp_path / "s.parquet", rows)], tmp_path)  # id, source: not read
    same_tokens(tf, tokenize([write_jsonl(tmp_path / "chats.jsonl", records)], tmp_path))


# --- column mapping ----------------------------------------------------------------------------


@needs("pyarrow")
def test_column_mapping(tmp_path):
    pairs = [{"prompt": f"Q: {i} squared?\nA:", "completion": f" {i * i}"} for i in range(30)]
    reference = tokenize([write_jsonl(tmp_path / "pc.jsonl", pairs)], tmp_path)
    renamed = [{"question": p["prompt"], "answer": p["completion"], "id": i} for i, p in enumerate(pairs)]
    table = write_parquet(tmp_path / "qa.parquet", renamed)
    columns = parse_columns("prompt=question,completion=answer")
    assert columns == {"prompt": "question", "completion": "answer"}
    same_tokens(tokenize([table], tmp_path, columns=columns), reference)
    qa = write_jsonl(tmp_path / "qa.jsonl", [{k: v for k, v in r.items() if k != "id"} for r in renamed])
    same_tokens(tokenize([qa], tmp_path, columns=columns), reference)
    # without the mapping, the columns are no shape, and the error says how to map them
    with pytest.raises(DataError, match=r"qa.parquet: its columns \['question', 'answer', 'id'\] have the fields of "
                                        r"none of the shapes .*--data-columns"):
        tokenize([table], tmp_path)
    # a mapped column hides the one of the field's own name
    both = write_parquet(tmp_path / "both.parquet", [{**r, "prompt": "unused"} for r in renamed])
    same_tokens(tokenize([both], tmp_path, columns=columns), reference)
    # the same in the training config, as a string (a flag) or a mapping (a config file)
    assert run_config(tmp_path, "a", [table], data_columns="prompt=question, completion=answer").data_columns == columns
    assert run_config(tmp_path, "a", [table], data_columns=columns).data_columns == columns
    for bad, why in (("prompt", "no FIELD=COLUMN pair"), ("query=question", "'query' is no field"),
                     ("prompt=", "must be a non-empty name")):
        with pytest.raises(ValueError, match=why):
            run_config(tmp_path, "a", [table], data_columns=bad)
    # and on the command line; the cache tells mapped from unmapped reads
    from zoo.cli.train import _add_train_flags, _train_config

    parser = argparse.ArgumentParser()
    _add_train_flags(parser, {})
    args = parser.parse_args(["--preset", "tiny-llama", "--data", str(table), "--data-columns",
                              "prompt=question,completion=answer", "--report-to", "tensorboard"])
    cfg = _train_config(args, {})
    assert cfg.data_columns == columns and cfg.report_to == "tensorboard"
    trained = train(tmp_path, "mapped", [table], data_columns=columns, steps=2)
    assert trained == train(tmp_path, "pc", [tmp_path / "pc.jsonl"], steps=2)


@needs("pyarrow")
def test_preference_pairs_from_parquet_with_a_mapping(tmp_path):
    pairs = [{"prompt": f"{i}+{i}=", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"} for i in range(12)]
    reference = tokenize_pairs([write_jsonl(tmp_path / "p.jsonl", pairs)], BYTES, tmp_path / "cache", TEMPLATE)
    table = write_parquet(tmp_path / "p.parquet", [{"q": p["prompt"], "good": p["chosen"], "bad": p["rejected"],
                                                   "score": 1.0} for p in pairs])
    got = tokenize_pairs([table], BYTES, tmp_path / "cache", TEMPLATE,
                         columns=parse_columns("prompt=q,chosen=good,rejected=bad"))
    assert np.array_equal(got.tokens, reference.tokens) and np.array_equal(got.starts, reference.starts)
    # conversational pairs in ShareGPT's turns are the same as in messages
    user, good, bad = ([{"from": f, "value": v}] for f, v in (("human", "2+2?"), ("gpt", "4"), ("gpt", "5")))
    msgs = tokenize_pairs([write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "2+2?"}],
                                                               "chosen": [{"role": "assistant", "content": "4"}],
                                                               "rejected": [{"role": "assistant", "content": "5"}]}])],
                          BYTES, tmp_path / "cache", TEMPLATE)
    share = tokenize_pairs([write_parquet(tmp_path / "s.parquet", [{"prompt": user, "chosen": good, "rejected": bad}])],
                           BYTES, tmp_path / "cache", TEMPLATE)
    assert np.array_equal(share.tokens, msgs.tokens) and share.formats == ["conversational"]


# --- mixtures ------------------------------------------------------------------------------------


@needs("pyarrow")
def test_a_mixture_samples_by_weight_and_resumes_exactly(tmp_path):
    chat_table = write_parquet(tmp_path / "chats.parquet", chats(40))
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"story {i}: " + "once upon a time " * (5 + i % 7)}
                                                 for i in range(40)])
    data = [f"{chat_table}:0.7", f"{docs}:0.3"]
    assert data_sources(data) == ([str(chat_table), str(docs)], [0.7, 0.3])
    tf, windows = training_data(data, BYTES, tmp_path / "cache", TEMPLATE, BYTES.vocab_size, 8, 64, 0.1, 1, 0)
    assert isinstance(windows, MixedWindows) and tf.formats == ["chat", "text"]
    # rows by weight: the chats' rows are packed (positions restart), the documents' windows are not
    from_docs = 0
    for step in range(50):
        b = windows.train_batch(step, 0)
        assert b.positions is not None and b.x.shape == (8, 64)
        from_docs += int(np.count_nonzero((b.y != -100).all(axis=1) & (b.positions == np.arange(64)).all(axis=1)))
        again = windows.train_batch(step, 0)  # the batch of a step is a function of (seed, step, micro)
        assert all(np.array_equal(u, v) for u, v in zip(b, again))
    assert 0.2 < from_docs / 400 < 0.4
    # a run cut by Ctrl-C and resumed has the losses of the run that went through
    full = train(tmp_path, "full", data, steps=8, eval_every=4, save_every=2)
    with pytest.raises(TrainInterrupted):
        Trainer(run_config(tmp_path, "cut", data, steps=8, eval_every=4, save_every=2)).run(
            on_step=lambda done, loss: signal.raise_signal(signal.SIGINT) if done == 5 else None)
    Trainer(run_config(tmp_path, "cut", data, steps=8, eval_every=4, save_every=2, resume=True)).run()
    assert losses(tmp_path / "cut") == full
    # other weights are other data: a resume with them is refused
    with pytest.raises(Exception, match="data"):
        Trainer(run_config(tmp_path, "cut", [f"{chat_table}:0.5", f"{docs}:0.5"], steps=8, eval_every=4,
                           save_every=2, resume=True))


def test_mixture_weights_are_checked(tmp_path):
    a, b = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}]), write_jsonl(tmp_path / "b.jsonl", [{"text": "b"}])
    with pytest.raises(DataError, match="without a weight in a mixture"):
        data_sources([f"{a}:0.5", str(b)])
    with pytest.raises(DataError, match="must be above 0"):
        data_sources([f"{a}:0", f"{b}:1"])
    assert data_sources([f"{a}:3", f"{b}:1"])[1] == [0.75, 0.25]
    with pytest.raises(ValueError, match="a mixture .* is for --method sft"):
        run_config(tmp_path, "r", [f"{a}:3", f"{b}:1"], method="dpo")


# --- bad input ---------------------------------------------------------------------------------


@needs("pyarrow")
def test_bad_rows_name_the_file_row_group_and_row(tmp_path):
    rows = [{"prompt": f"q{i}", "completion": f" a{i}"} for i in range(12)]
    rows[9]["completion"] = None  # row group 2 (of 4 rows each), its row 1
    with pytest.raises(DataError, match=r"bad.parquet, row group 2, row 1: \"completion\" must be a string, got "
                                        r"NoneType"):
        tokenize([write_parquet(tmp_path / "bad.parquet", rows, row_group_size=4)], tmp_path)
    chat = chats(6)
    chat[4]["messages"][-1] = {"role": "user", "content": "no answer"}
    with pytest.raises(DataError, match=r"badchat.parquet, row group 0, row 4: the last message is 'user'"):
        tokenize([write_parquet(tmp_path / "badchat.parquet", chat)], tmp_path)
    share = [sharegpt(r) for r in chats(4)]
    share[2]["conversations"][0]["from"] = "wizard"
    with pytest.raises(DataError, match=r"row group 0, row 2: conversations\[0\] is from 'wizard'"):
        tokenize([write_parquet(tmp_path / "s.parquet", share)], tmp_path)
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match=r"junk.parquet: cannot be read as Parquet"):
        tokenize([tmp_path / "junk.parquet"], tmp_path)
    (tmp_path / "junk.arrow").write_bytes(b"\x00" * 64)
    with pytest.raises(DataError, match=r"junk.arrow: "):
        tokenize([tmp_path / "junk.arrow"], tmp_path)
    with pytest.raises(DataError, match=r"fits several shapes|fit several shapes"):
        tokenize([write_parquet(tmp_path / "two.parquet", [{"text": "a", "messages": []}])], tmp_path)


@needs("pyarrow", "datasets")
def test_bad_rows_of_an_arrow_file_name_the_record_batch_and_row(tmp_path):
    import datasets

    rows = [{"text": f"doc {i}"} for i in range(5)] + [{"text": None}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"data-00000-of-00001.arrow, record batch 0, row 5: \"text\" must be a string"):
        tokenize([tmp_path / "saved"], tmp_path)


def test_without_pyarrow_a_table_says_which_extra_to_install(tmp_path, monkeypatch):
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    with pytest.raises(DataError, match=r"a.parquet: reading Parquet files needs pyarrow, which is not installed; "
                                        r"install zoo's data extra: pip install 'zoo\[data\]'"):
        tokenize([tmp_path / "a.parquet"], tmp_path)
    # everything else reads without it
    tf = tokenize([write_jsonl(tmp_path / "c.jsonl", chats(3))], tmp_path)
    assert tf.formats == ["chat"]


# --- TensorBoard -------------------------------------------------------------------------------


def test_crc32c():
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    assert crc32c(b"") == 0


@needs("tensorboard")
def test_tensorboard_reads_the_event_file_as_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": "the cat sat on the mat. " * 6}] * 20)

    def check(out):
        files = event_files(out)
        assert len(files) == 1
        acc = EventAccumulator(str(files[0]), size_guidance={"scalars": 0})
        acc.Reload()
        tags = {"loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
                "tokens_per_s": "train/tokens_per_s", "tokens": "train/tokens", "val_loss": "eval/loss"}
        want = {tag: [] for tag in tags.values()}
        for line in open(out / "metrics.jsonl"):
            rec = json.loads(line)
            for key, tag in tags.items():
                if key in rec:
                    want[tag].append((rec["step"], float(np.float32(rec[key]))))
        assert set(acc.Tags()["scalars"]) == set(want)
        for tag, values in want.items():
            assert [(e.step, e.value) for e in acc.Scalars(tag)] == values, tag
        return want

    Trainer(run_config(tmp_path, "run", [docs], steps=6, eval_every=3, report_to="tensorboard")).run()
    want = check(tmp_path / "run")
    assert [s for s, _ in want["train/loss"]] == [1, 2, 3, 4, 5, 6] and [s for s, _ in want["eval/loss"]] == [0, 3, 6]
    # a crash past a checkpoint, then --resume: the event file holds what metrics.jsonl keeps
    def crash(done, loss):
        if done == 5:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError):
        Trainer(run_config(tmp_path, "cut", [docs], steps=6, eval_every=3, save_every=4,
                           report_to="tensorboard")).run(on_step=crash)
    Trainer(run_config(tmp_path, "cut", [docs], steps=6, eval_every=3, save_every=4, report_to="tensorboard",
                       resume=True)).run()
    resumed = check(tmp_path / "cut")
    assert [v for _, v in resumed["train/loss"]] == [v for _, v in want["train/loss"]]
    # --overwrite without the flag: no stale event file is left behind
    Trainer(run_config(tmp_path, "run", [docs], steps=2, overwrite=True)).run()
    assert event_files(tmp_path / "run") == []


# --- the benchmark -------------------------------------------------------------------------------


@needs("pyarrow")
def test_the_reading_benchmark_prints_a_table_and_writes_json(tmp_path, capsys):
    from zoo.tools import bench_data

    assert bench_data.main(["--mb", "0.2", "--row-group", "50", "--dir", str(tmp_path / "b"),
                            "--json", str(tmp_path / "b.json")]) == 0
    table = capsys.readouterr().out
    assert "| jsonl |" in table and "| parquet |" in table and "the same tokens and loss mask: yes" in table
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["same_tokens"] and report["parquet_speed_vs_jsonl"] > 0
    assert report["results"]["jsonl"]["tokens"] == report["results"]["parquet"]["tokens"] > 0
