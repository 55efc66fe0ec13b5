"""The command line end to end: finetune GPT-2 and Llama checkpoints that transformers wrote,
the embedded demo, generate, plot, Ctrl-C and --resume, and every bad input the issue lists.
One thread everywhere: deterministic, and fast on a shared 2-core machine."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import LLAMA2_TOKENIZER, SHAKESPEARE, STORIES, needs, needs_shared

from zoo.cli import main
from zoo.train.config import DEMO_DATA

FAST = ["--threads", "1", "--no-progress", "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token-cache"))


def val_losses(out):
    return [r["val_loss"] for r in map(json.loads, open(Path(out) / "metrics.jsonl")) if "val_loss" in r]


def train_losses(out):
    return [(r["step"], r["loss"]) for r in map(json.loads, open(Path(out) / "metrics.jsonl")) if "loss" in r]


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# --- finetune both families; the result loads in transformers ---------------------------


@needs("torch", "transformers")
@needs_shared(SHAKESPEARE, LLAMA2_TOKENIZER)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_finetune_end_to_end(tmp_path, capsys, cache, family):
    from hf_helpers import folder_logits, gpt2_checkpoint, llama_checkpoint

    src = tmp_path / "src"
    if family == "gpt2":
        gpt2_checkpoint(src, SHAKESPEARE.read_text())
        budget = ["--steps", 240, "--eval-every", 80, "--lr", 3e-3]
    else:  # 32000 ids make each step dearer: fewer, larger steps
        llama_checkpoint(src)
        budget = ["--steps", 40, "--eval-every", 20, "--lr", 1e-2]
    out = tmp_path / "out"
    rc, _, err = run(capsys, "finetune", "--from", src, "--data", SHAKESPEARE, "--out", out, "--cache-dir", cache,
                     "--batch-size", 8, "--seq-len", 64, "--warmup-steps", 10, "--eval-batches", 4,
                     "--save-every", 1000, *budget, *FAST)
    assert rc == 0, err
    val = val_losses(out)
    print(family, "validation losses", val)
    assert val[-1] <= 0.7 * val[0], val
    tokens = np.random.default_rng(0).integers(0, 300, (2, 24))
    from zoo import Model

    ours = Model.from_pretrained(out).logits(tokens)
    np.testing.assert_allclose(folder_logits(out, tokens), ours, atol=1e-4, rtol=0)
    assert (out / "loss.png").is_file()

    # The tokenizer hands over (AutoTokenizer gives zoo's ids, BOS where zoo puts one) and
    # transformers' generation_config.json of --from comes along unchanged.
    import transformers

    from zoo.text.tokenizers import Tokenizer

    tok, ref = Tokenizer.from_pretrained(out), transformers.AutoTokenizer.from_pretrained(str(out))
    text = "Crème brûlée — Съешь ещё 日本語 🙂\n\n  def f(): return 1  "
    assert ref.encode(text) == tok.encode(text, add_bos=tok.adds_bos) and tok.adds_bos == (family == "llama")
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()


# --- the embedded demo, generate, plot ------------------------------------------------


def test_demo_generate_and_plot(tmp_path, capsys, cache):
    out = tmp_path / "demo"
    rc, stdout, err = run(capsys, "train", "--steps", 40, "--eval-every", 20, "--out", out, "--cache-dir", cache,
                          "--threads", 1, "--no-progress", "--sample-tokens", 30)
    assert rc == 0, err
    assert "embedded demo" in err and "--- sample ---" in err and len(stdout) > 10
    val = val_losses(out)
    assert len(val) == 3 and val[-1] < 0.8 * val[0]
    assert (out / "config.json").is_file() and (out / "checkpoints" / "step-00000040").is_dir()

    # generate: greedy through the CLI equals greedy through the API.
    rc, stdout, err = run(capsys, "generate", "--from", out, "--prompt", "The keeper", "--temperature", 0,
                          "--max-new-tokens", 24, "--threads", 1, "--no-echo")
    assert rc == 0, err
    from zoo import Model
    from zoo.generate import generate, prompt_tokens
    from zoo.text.tokenizers import Tokenizer

    tok = Tokenizer.from_pretrained(out)
    ids = generate(Model.from_pretrained(out), prompt_tokens(tok, "The keeper"), 24, stop_ids=tok.eos_ids)
    assert stdout == tok.decode([i for i in ids if i not in tok.eos_ids]) + "\n"

    (out / "loss.png").unlink()
    rc, stdout, _ = run(capsys, "plot", out)
    assert rc == 0 and Path(stdout.strip()) == out / "loss.png" and (out / "loss.png").stat().st_size > 1000


@needs_shared(STORIES)
def test_generate_from_token_ids(tmp_path, capsys):
    """--prompt-ids: a checkpoint without tokenizer files generates (stopping at its config's
    EOS), printing ids; with a tokenizer, their text follows; bad ids are refused by name."""
    import zoo
    from zoo import Model
    from zoo.generate import generate
    from zoo.io.checkpoints import save_pretrained

    stories = STORIES  # a Llama that transformers wrote, with no tokenizer files
    greedy = ["--temperature", 0, "--threads", 1]
    rc, stdout, err = run(capsys, "generate", "--from", stories, "--prompt-ids", "1,403, 407", "--max-new-tokens", 40,
                          *greedy)
    assert rc == 0, err
    new = generate(Model.from_pretrained(stories), [1, 403, 407], 40, stop_ids=[2])
    assert stdout == " ".join(map(str, [1, 403, 407] + new)) + "\n"
    assert new[-1] == 2 or len(new) == 40  # config.json's eos_token_id 2 ends it
    rc, stdout, err = run(capsys, "generate", "--from", stories, "--prompt-ids", 1, 403, 407, "--no-echo",
                          "--max-new-tokens", 5, *greedy)
    assert rc == 0 and stdout == " ".join(map(str, new[:5])) + "\n", err

    for ids, message in (("1,x", "'x' is not a token id"), ("1 -2", "'-2' is not a token id"), (",", "no token ids"),
                         ("3 512", "id 512 is outside the model's vocabulary (vocab_size 512: ids 0 to 511)"),
                         (" ".join(["5"] * 513), "513 ids, beyond the model's max_seq_len 512")):
        rc, stdout, err = run(capsys, "generate", "--from", stories, "--prompt-ids", ids, *greedy)
        assert rc == 1 and f"--prompt-ids: {message}" in err and stdout == "", (ids, err)
    rc, _, err = run(capsys, "generate", "--from", stories, "--prompt", "Once", *greedy)
    assert rc == 1 and "no tokenizer here" in err and "--prompt-ids" in err

    folder = save_pretrained(zoo.Model(zoo.preset("tiny-llama"), seed=0), tmp_path / "bytes",
                             tokenizer=zoo.Tokenizer.byte_level())
    rc, stdout, err = run(capsys, "generate", "--from", folder, "--prompt-ids", "257 72 105", "--max-new-tokens", 6,
                          *greedy)
    assert rc == 0, err
    ids_line, _, text = stdout.partition("\n")  # the text may hold newlines of its own
    ids = [int(i) for i in ids_line.split()]
    assert ids[:3] == [257, 72, 105] and 3 < len(ids) <= 9
    assert text == zoo.Tokenizer.byte_level().decode(ids) + "\n" and text.startswith("<|bos|>Hi")


def test_config_file_and_flags(tmp_path, capsys, cache):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"preset: tiny-gpt2\ndata: [{DEMO_DATA}]\nout: out\nsteps: 3\nbatch_size: 2\nseq_len: 16\n"
                   f"cache_dir: {cache}\neval_every: 0\n")
    rc, _, err = run(capsys, "train", "--config", cfg, "--steps", 2, *FAST)  # the flag wins over the file
    assert rc == 0, err
    assert [s for s, _ in train_losses(tmp_path / "out")] == [1, 2]  # out is relative to the config file

    # A budget or model source given higher up replaces the whole group below it.
    from zoo.cli.train import _layer

    assert _layer({"steps": 600, "preset": "tiny-llama", "lr": 1.0}, {"epochs": 2}, {"from_dir": "d"}) == \
        {"lr": 1.0, "epochs": 2, "from_dir": "d"}

    cfg.write_text("preset: tiny-gpt2\nbogus_field: 1\n")
    rc, _, err = run(capsys, "train", "--config", cfg)
    assert rc == 1 and "run.yaml" in err and "bogus_field" in err
    cfg.write_text("steps: [oops\n")
    rc, _, err = run(capsys, "train", "--config", cfg)
    assert rc == 1 and "run.yaml: not valid YAML" in err


# --- Ctrl-C and --resume ---------------------------------------------------------------


def test_ctrl_c_saves_and_resume_continues_exactly(tmp_path, capsys, cache):
    args = ["train", "--preset", "tiny-llama", "--data", DEMO_DATA, "--steps", 400, "--batch-size", 4, "--seq-len", 32,
            "--eval-every", 50, "--save-every", 100, "--cache-dir", cache, *FAST]
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "zoo.cli", *map(str, args), "--out", str(cut)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (cut / "metrics.jsonl").is_file() and len(train_losses(cut)) >= 5:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted at step" in err and "--resume" in err
    stopped = train_losses(cut)[-1][0]
    assert 5 <= stopped < 400 and (cut / "checkpoints" / f"step-{stopped:08d}").is_dir()

    rc, _, err = run(capsys, *args, "--out", cut, "--resume")
    assert rc == 0, err
    rc, _, err = run(capsys, *args, "--out", tmp_path / "full")
    assert rc == 0, err
    assert train_losses(cut) == train_losses(tmp_path / "full")
    assert val_losses(cut) == val_losses(tmp_path / "full")


# --- bad input ------------------------------------------------------------------------


def small_run(*extra):
    return ["train", "--preset", "tiny-gpt2", "--steps", 2, "--batch-size", 2, "--seq-len", 16, *FAST, *extra]


def test_missing_empty_short_and_non_utf8_data(tmp_path, capsys):
    c = ["--cache-dir", tmp_path / "c", "--out", tmp_path / "o"]
    rc, _, err = run(capsys, *small_run("--data", tmp_path / "nope.txt", *c))
    assert rc == 1 and "nope.txt: no such file" in err

    (tmp_path / "empty.txt").write_text("")
    rc, _, err = run(capsys, *small_run("--data", tmp_path / "empty.txt", *c))
    assert rc == 1 and "empty.txt: empty" in err

    (tmp_path / "short.txt").write_text("To be.")
    rc, _, err = run(capsys, *small_run("--data", tmp_path / "short.txt", *c))
    assert rc == 1 and "shorter than one sequence" in err

    (tmp_path / "bad.txt").write_bytes(b"good text\n" * 10 + b"\xff\xfe bad")
    rc, _, err = run(capsys, *small_run("--data", tmp_path / "bad.txt", *c))
    assert rc == 1 and "bad.txt: not UTF-8" in err and "byte offset 100" in err


@needs("torch", "transformers")
@needs_shared(LLAMA2_TOKENIZER)
def test_bad_checkpoint_arguments(tmp_path, capsys):
    from hf_helpers import gpt2_checkpoint

    rc, _, err = run(capsys, "finetune", "--from", tmp_path / "nowhere", "--data", DEMO_DATA, "--out", tmp_path / "o")
    assert rc == 1 and "nowhere" in err and "no such file or folder (--from takes" in err
    rc, _, err = run(capsys, "finetune", "--data", DEMO_DATA, "--out", tmp_path / "o")
    assert rc == 1 and "--from DIR is required" in err

    src = gpt2_checkpoint(tmp_path / "gpt2", (DEMO_DATA / "001.txt").read_text(), n_positions=64)
    base = ["finetune", "--from", src, "--data", DEMO_DATA, "--out", tmp_path / "o", "--cache-dir", tmp_path / "c", *FAST]
    rc, _, err = run(capsys, "finetune", "--from", src, "--out", tmp_path / "o", "--seq-len", 32, *FAST)
    assert rc == 1 and "no training data given" in err
    rc, _, err = run(capsys, *base, "--seq-len", 65)
    assert rc == 1 and "seq_len: 65 is beyond the model's max_seq_len 64" in err

    # A tokenizer whose vocabulary does not match the checkpoint: given apart from it...
    rc, _, err = run(capsys, *base, "--tokenizer", LLAMA2_TOKENIZER)
    assert rc == 1 and "llama2-tokenizer.model: its vocabulary has 32000 tokens" in err and "vocab_size" in err
    # ...or inside the checkpoint folder itself.
    (src / "vocab.json").unlink()
    (src / "merges.txt").unlink()
    (src / "tokenizer.model").write_bytes(LLAMA2_TOKENIZER.read_bytes())
    rc, _, err = run(capsys, *base)
    assert rc == 1 and "config.json" in err and "vocab_size" in err


def test_nan_loss_stops_with_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "o"
    rc, _, err = run(capsys, *small_run("--data", DEMO_DATA, "--out", out, "--cache-dir", tmp_path / "c",
                                        "--steps", 10, "--lr", 1e30, "--max-grad-norm", 0, "--save-every", 1))
    assert rc == 1 and "loss became nan at step 2" in err and "step-00000001" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000001"]
    assert not (out / "config.json").exists()  # nothing published as a final model


def test_unwritable_out(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    rc, _, err = run(capsys, *small_run("--data", DEMO_DATA, "--out", tmp_path / "file" / "run"))
    assert rc == 4 and "--out" in err and "cannot write there" in err and str(tmp_path / "file" / "run") in err


# --- extending a finished run; the run folder named in full -----------------------------


def test_finetune_resume_with_more_steps_extends_the_run(tmp_path, capsys, cache):
    base = tmp_path / "base"
    rc, _, err = run(capsys, *small_run("--data", DEMO_DATA, "--out", base, "--cache-dir", cache))
    assert rc == 0, err
    out = tmp_path / "tuned"
    rc, _, err = run(capsys, "finetune", "--from", base, "--data", DEMO_DATA, "--out", out, "--cache-dir", cache,
                     "--steps", 4, "--batch-size", 2, "--seq-len", 16, *FAST)
    assert rc == 0, err
    rc, _, err = run(capsys, "finetune", "--out", out, "--resume", "--steps", 6, *FAST)
    assert rc == 0, err
    assert f"extending the run in {out} from 4 to 6 steps" in err
    assert [s for s, _ in train_losses(out)] == list(range(1, 7))
    assert (out / "checkpoints" / "step-00000006").is_dir()
    assert err.splitlines()[-1].startswith("done: step 6") and err.splitlines()[-1].endswith(f"are in {out}")

    rc, _, err = run(capsys, "finetune", "--out", out, "--resume", "--steps", 5, *FAST)
    assert rc == 1 and "--steps 5 ends at or before step 6" in err and "cannot be shrunk" in err
    rc, _, err = run(capsys, "finetune", "--out", out, "--resume", "--steps", 8, "--lr", 1e-2, *FAST)
    assert rc == 1 and "lr: 0.0003 -> 0.01" in err  # other changes are refused as before


def test_the_run_folder_is_named_in_full_at_start_and_end(tmp_path, capsys, cache, monkeypatch):
    (tmp_path / "configs").mkdir()
    cfg = tmp_path / "configs" / "run.yaml"
    cfg.write_text(f"preset: tiny-gpt2\ndata: [{DEMO_DATA}]\nout: out\nsteps: 3\nbatch_size: 2\nseq_len: 16\n"
                   f"cache_dir: {cache}\n")
    monkeypatch.chdir(tmp_path)  # the relative out: is the config file's folder's, not the working directory's
    rc, _, err = run(capsys, "train", "--config", Path("configs") / "run.yaml", *FAST)
    assert rc == 0, err
    out = tmp_path / "configs" / "out"
    lines = err.splitlines()
    assert [l for l in lines if l.startswith("starting:")][0].endswith(f"run folder {out}")
    assert lines[-1].startswith("done: step 3") and lines[-1].endswith(f"are in {out}")
    assert (out / "train.log").read_text() == err

    # A run that fails says where it was too, and leaves its plot and log.
    rc, _, err = run(capsys, "train", "--config", cfg, "--overwrite", "--steps", 10, "--lr", 1e30,
                     "--max-grad-norm", 0, "--save-every", 1, *FAST)
    assert rc == 1
    assert err.splitlines()[-2] == f"stopped at step 1 (error): checkpoint step-00000001, loss.png, train.log in {out}"
    assert (out / "loss.png").is_file() and "error: loss became nan at step 2" in (out / "train.log").read_text()
