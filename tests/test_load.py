"""Loading is one layer (zoo/io/load.py): every form a model comes in, through every verb that
takes a model. Each verb either runs on a form or refuses it with the one shared sentence
("zoo VERB does not take FORM (PATH): what to do"); a path that is no model is refused with the
one sentence that lists the forms."""

import shutil

import numpy as np
import pytest

import zoo
from zoo import LoraConfig, Model, Tokenizer
from zoo.cli import main
from zoo.io import load
from zoo.io.gguf import save_gguf
from zoo.io.peft import save_adapter
from zoo.train.config import DEMO_DATA

FAST = ["--threads", "1", "--no-progress", "--sample-tokens", "0"]
TINY = zoo.preset("tiny-llama")
TEXT = DEMO_DATA / "001.txt"


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    """One model in every form: name -> path."""
    root = tmp_path_factory.mktemp("forms")
    model = Model(TINY, seed=3)
    model.save_pretrained(root / "checkpoint", tokenizer=Tokenizer.byte_level())
    model.save_pretrained(root / "sharded", tokenizer=Tokenizer.byte_level(), max_shard_bytes=200_000)
    save_gguf(model, root / "model.gguf", tokenizer=Tokenizer.byte_level())
    lora = Model.from_pretrained(root / "checkpoint", lora=LoraConfig(r=2, alpha=4))
    for v in lora.parameters().values():
        v[...] = np.random.default_rng(0).standard_normal(v.shape).astype(np.float32) * 0.1
    save_adapter(lora, root / "adapter")
    common = ["--data", TEXT, "--batch-size", 2, "--seq-len", 16, "--steps", 2, "--cache-dir", root / "cache", *FAST]
    assert main([str(a) for a in ["finetune", "--from", root / "checkpoint", "--out", root / "run", *common]]) == 0
    assert main([str(a) for a in ["finetune", "--from", root / "checkpoint", "--out", root / "lora-run", "--lora",
                                  "--lora-r", 2, *common]]) == 0
    (root / "running").mkdir()  # a run that has written a checkpoint and no final model yet
    shutil.copytree(root / "run" / "checkpoints", root / "running" / "checkpoints")
    return {"checkpoint": root / "checkpoint", "sharded checkpoint": root / "sharded", "run": root / "run",
            "running run": root / "running", "training checkpoint": root / "run" / "checkpoints" / "step-00000002",
            "adapter": root / "adapter", "lora run": root / "lora-run", "gguf": root / "model.gguf"}


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_resolve_names_each_form(forms):
    expected = {"checkpoint": "checkpoint", "sharded checkpoint": "sharded checkpoint", "run": "run",
                "running run": "run", "training checkpoint": "training checkpoint", "adapter": "adapter",
                "lora run": "run", "gguf": "gguf"}
    for name, path in forms.items():
        source = load.resolve(path)
        assert source.form == expected[name], name
    assert load.resolve(forms["running run"]).model.name == "step-00000002"
    assert load.resolve(forms["lora run"]).is_adapter and load.resolve(forms["adapter"]).is_adapter
    assert not load.resolve(forms["run"]).is_adapter


def test_every_form_loads_the_same_model(forms):
    tokens = np.arange(1, 13).reshape(2, 6)
    reference = Model.from_pretrained(forms["checkpoint"]).logits(tokens)
    for name in ("sharded checkpoint", "gguf"):
        np.testing.assert_allclose(Model.from_pretrained(forms[name]).logits(tokens), reference, rtol=1e-5, atol=1e-5)
    # a run and its newest checkpoint hold the same finetuned model
    np.testing.assert_array_equal(Model.from_pretrained(forms["run"]).logits(tokens),
                                  Model.from_pretrained(forms["running run"]).logits(tokens))
    adapted = Model.from_pretrained(forms["adapter"])
    assert adapted.lora is not None and not np.allclose(adapted.logits(tokens), reference)


def test_a_path_that_is_no_model_is_refused_with_the_forms(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    for path, what in ((tmp_path / "nowhere", "no such file or folder"), (tmp_path / "empty", "not a model folder"),
                       (tmp_path / "notes.txt", "not a model file")):
        inspect = [["inspect", path]] if path.suffix != ".txt" else []  # inspect reads a file as a config.json
        for verb in (["generate", "--from", path], ["chat", "--from", path, "--prompt", "hi"], *inspect,
                     ["eval", "--from", path, "--data", TEXT], ["convert", path, tmp_path / "out"]):
            rc, _, err = run(capsys, *verb)
            assert rc == 1 and f"{path}: {what}" in err and "takes" in err and "a PEFT adapter folder" in err, \
                (verb, err)


# verb -> the forms it refuses (every other form must work)
REFUSED = {
    "generate": {}, "chat": {}, "eval": {}, "inspect": {},
    "finetune": {"adapter": "finetune its base with --lora", "lora run": "finetune its base with --lora",
                 "gguf": "convert it to a folder first"},
    "convert": {"adapter": "merge it into its base first", "lora run": "merge it into its base first"},
}


def verb_args(verb, path, tmp_path):
    return {
        "generate": ["generate", "--from", path, "--prompt", "Once", "--max-new-tokens", 3, "--temperature", 0],
        "chat": ["chat", "--from", path, "--prompt", "hi", "--max-new-tokens", 2, "--temperature", 0],
        "eval": ["eval", "--from", path, "--data", TEXT, "--batch-size", 2, "--seq-len", 16, "--cache-dir",
                 tmp_path / "cache"],
        "inspect": ["inspect", path],
        "finetune": ["finetune", "--from", path, "--data", TEXT, "--out", tmp_path / "out", "--steps", 1,
                     "--batch-size", 2, "--seq-len", 16, "--cache-dir", tmp_path / "cache", *FAST],
        "convert": ["convert", path, tmp_path / "converted"],
    }[verb]


@pytest.mark.parametrize("verb", sorted(REFUSED))
def test_each_verb_takes_each_form_or_refuses_it_in_one_sentence(forms, verb, tmp_path, capsys):
    for name, path in forms.items():
        rc, out, err = run(capsys, *verb_args(verb, path, tmp_path / name.replace(" ", "-")))
        if name in REFUSED[verb]:
            described = load.resolve(path).described
            assert rc == 1 and f"zoo {verb} does not take {described} ({path}): {REFUSED[verb][name]}" in err, \
                (name, err)
        else:
            assert rc == 0, (verb, name, err)


def test_merge_takes_every_base_form_and_adapter_form(forms, tmp_path, capsys):
    tokens = np.arange(1, 13).reshape(2, 6)
    expected = Model.from_pretrained(forms["adapter"], base_dtype="fp32").logits(tokens)
    for name in ("checkpoint", "sharded checkpoint", "gguf"):
        out = tmp_path / name.replace(" ", "-")
        rc, _, err = run(capsys, "merge", forms[name], forms["adapter"], out)
        assert rc == 0, (name, err)
        np.testing.assert_allclose(Model.from_pretrained(out).logits(tokens), expected, rtol=1e-4, atol=1e-4)
    rc, _, err = run(capsys, "merge", forms["checkpoint"], forms["lora run"], tmp_path / "from-run")
    assert rc == 0, err
    rc, _, err = run(capsys, "merge", forms["adapter"], forms["adapter"], tmp_path / "x")
    assert rc == 1 and f"zoo merge does not take a PEFT adapter folder ({forms['adapter']}): as BASE" in err
    rc, _, err = run(capsys, "merge", forms["checkpoint"], forms["gguf"], tmp_path / "y")
    assert rc == 1 and f"zoo merge does not take a GGUF file ({forms['gguf']}): as ADAPTER" in err
