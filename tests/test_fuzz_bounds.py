"""Fuzz cases of "validated before allocated" (issue 17): sizes beyond zoo's bounds in a
config.json, a batch x sequence length past the native core's int range, non-finite optimizer
settings, and models or batches too big for the memory the machine has. Each is refused at once,
naming the field, flag or argument (and for memory both numbers), never reaching an allocator,
a native integer overflow (SIGFPE) or a NaN weight. Each case runs in its own subprocess
through tests/helpers.py, from files made at test time from a tiny model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import helpers
import pytest
from helpers import STORIES, needs_shared

import zoo
from zoo.arch.config import MAX_LAYERS, MAX_SEQ_LEN, MAX_TOKENS, MAX_VOCAB, MAX_WIDTH
from zoo.arch.layout import num_parameters
from zoo.core.errors import EXIT_INPUT, EXIT_RESOURCES


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Saved tiny GPT-2 and Llama checkpoints, and a text file to train on."""
    root = tmp_path_factory.mktemp("fuzz_bounds")
    out = {}
    for name in ("tiny-gpt2", "tiny-llama"):
        zoo.Model(zoo.preset(name)).save_pretrained(root / name)
        out[name] = root / name
    out["data"] = helpers.write(root / "data.txt", "Once upon a time there was a tiny model. " * 200)
    return out


def with_config(folders, tmp_path, preset: str, **changes) -> Path:
    """A copy of a saved tiny model whose config.json has `changes`."""
    folder = tmp_path / "bad"
    folder.mkdir()
    for f in folders[preset].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# --- sizes in config.json: refused at once, naming the key and the bound ----------------

CONFIG_CASES = [
    ("tiny-gpt2", {"n_layer": 10**8}, ["'n_layer'", str(MAX_LAYERS)]),
    ("tiny-gpt2", {"vocab_size": 2 * 10**9}, ["'vocab_size'", str(MAX_VOCAB)]),
    ("tiny-gpt2", {"n_embd": 2**40}, ["'n_embd'", str(MAX_WIDTH)]),
    ("tiny-gpt2", {"n_head": 0}, ["'n_head'", "greater than 0"]),
    ("tiny-gpt2", {"n_head": -1}, ["'n_head'", "greater than 0"]),
    ("tiny-gpt2", {"n_layer": 2.5}, ["'n_layer'", "2.5"]),
    ("tiny-gpt2", {"n_layer": "two"}, ["'n_layer'", "'two'"]),
    # Values that pass every field bound, but not as a product: vocab_size x d_model floats.
    ("tiny-gpt2", {"vocab_size": MAX_VOCAB, "n_embd": MAX_WIDTH, "n_inner": 64},
     ["'vocab_size'", "vocab_size x d_model"]),
    # Beyond an int: once a pybind11 cast error with a traceback.
    ("tiny-gpt2", {"n_positions": 2**40}, ["'n_positions'", str(MAX_SEQ_LEN)]),
    ("tiny-llama", {"num_hidden_layers": 10**8}, ["'num_hidden_layers'", str(MAX_LAYERS)]),
    ("tiny-llama", {"intermediate_size": 2**31}, ["'intermediate_size'", str(MAX_WIDTH)]),
    ("tiny-llama", {"num_key_value_heads": 0}, ["'num_key_value_heads'", "greater than 0"]),
]


@pytest.mark.parametrize("preset,changes,needles", CONFIG_CASES,
                         ids=[f"{p}-{'-'.join(c)}={list(c.values())[0]}" for p, c, _ in CONFIG_CASES])
def test_config_sizes_refused_before_anything_is_built(folders, tmp_path, preset, changes, needles):
    folder = with_config(folders, tmp_path, preset, **changes)
    r = helpers.cli("inspect", folder)
    helpers.assert_error(r, "config.json", *needles, status=EXIT_INPUT)


# --- batch x sequence length: one clear error, never SIGFPE ---------------------------------

def test_train_batch_times_seq_len_past_int_range(folders, tmp_path):
    # 2^20 x 2^12 = 2^32 tokens: once a division by zero in the native planner (SIGFPE).
    r = helpers.cli("train", "--preset", "tiny-gpt2", "--data", folders["data"], "--out", tmp_path / "run",
                 "--steps", "1", "--batch-size", 2**20, "--seq-len", 2**12)
    helpers.assert_error(r, "--batch-size 1048576", "--seq-len 4096", "4294967296", str(MAX_TOKENS), status=EXIT_INPUT)


@pytest.mark.parametrize("batch,seq_len", [(100_000_000, 1000), (2**20, 2**12)])
def test_inspect_batch_times_seq_len_past_int_range(folders, batch, seq_len):
    r = helpers.cli("inspect", folders["tiny-gpt2"], "--batch", batch, "--seq-len", seq_len)
    helpers.assert_error(r, f"batch {batch}", f"seq_len {seq_len}", str(MAX_TOKENS), status=EXIT_INPUT)


def test_bindings_refuse_a_batch_past_the_bound_without_python_checks():
    # A library user calling the native core directly is refused there too.
    r = helpers.python(
        "import zoo\nfrom zoo.core.native import _native\n"
        "cfg = zoo.preset('tiny-gpt2').model_dump()\n"
        "try:\n    _native.activation_floats(cfg, 2**20, 2**12)\nexcept ValueError as e:\n    print(e)\n"
        "cfg['n_layer'] = 10**8\n"
        "try:\n    _native.activation_floats(cfg, 1, 1)\nexcept ValueError as e:\n    print(e)\n")
    assert r.returncode == 0, r.stderr
    assert "batch size 1048576 x sequence length 4096 is above zoo's bound of 16777216" in r.stdout
    assert "n_layer = 100000000 is above zoo's bound of 1024" in r.stdout


# --- optimizer settings: finite, or refused naming the flag -------------------------------

@pytest.mark.parametrize("flag,value,needle", [
    ("--lr", "nan", "a finite number"), ("--lr", "inf", "a finite number"), ("--lr", "-1", "greater than 0"),
    ("--weight-decay", "nan", "a finite number"), ("--weight-decay", "inf", "a finite number"),
    ("--max-grad-norm", "inf", "a finite number"), ("--max-grad-norm", "-1", "greater than or equal to 0"),
])
def test_train_refuses_non_finite_optimizer_flags(folders, tmp_path, flag, value, needle):
    r = helpers.cli("train", "--preset", "tiny-gpt2", "--data", folders["data"], "--out", tmp_path / "run",
                 "--steps", "1", f"{flag}={value}")
    helpers.assert_error(r, f"({flag})", needle, status=EXIT_INPUT)


ADAMW_SNIPPET = """
import numpy as np, zoo
m = zoo.Model(zoo.preset("tiny-gpt2"))
x = np.arange(16).reshape(2, 8) % 300
m.forward_backward(x, x)
before = {{k: v.copy() for k, v in m.parameters().items()}}
grads = {{k: v.copy() for k, v in m.gradients().items()}}
try:
    m.{call}
except ValueError as e:
    print("refused:", e)
assert all(np.array_equal(before[k], v) for k, v in m.parameters().items()), "weights changed"
assert all(np.array_equal(grads[k], v) for k, v in m.gradients().items()), "gradients changed"
print("untouched")
"""


@pytest.mark.parametrize("call,needle", [
    ("adamw_step(lr=float('nan'))", "lr"), ("adamw_step(lr=float('inf'))", "lr"),
    ("adamw_step(lr=1e-3, beta1=1.0)", "beta1"), ("adamw_step(lr=1e-3, eps=0.0)", "eps"),
    ("adamw_step(lr=1e-3, weight_decay=float('nan'))", "weight_decay"),
    ("adamw_step(lr=1e-3, max_grad_norm=float('inf'))", "max_grad_norm"),
    ("forward_backward(x, x, grad_scale=float('nan'))", "grad_scale"),
])
def test_model_refuses_non_finite_hyperparameters_before_touching_weights(call, needle):
    r = helpers.python(ADAMW_SNIPPET.format(call=call))
    assert r.returncode == 0, r.stderr
    assert f"refused: {needle} must be" in r.stdout and "untouched" in r.stdout, r.stdout


# --- memory: checked against what the machine has, before allocating -----------------------

BIG_MODEL_SNIPPET = """
import resource, sys, zoo
from zoo.core.errors import ResourceError
try:
    zoo.Model(zoo.preset(sys.argv[1]))
    print("built")
except ResourceError as e:
    print("refused:", e)
# This process's own peak (VmHWM): getrusage's ru_maxrss survives exec, so a child forked
# from a large pytest process would report the parent's peak.
print("maxrss_kb", next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""


def test_model_too_big_for_memory_refused_before_allocating():
    r = helpers.python(BIG_MODEL_SNIPPET, "gpt2", env={"ZOO_MEMORY_AVAILABLE": "100000000"})
    assert r.returncode == 0, r.stderr
    # Both numbers (GPT-2's 124M float32 weights, and the figure given), and the ways out.
    assert "refused:" in r.stdout and "474.70 MiB" in r.stdout and "95.37 MiB" in r.stdout, r.stdout
    assert "smaller model" in r.stdout and "ZOO_SKIP_MEMORY_CHECK=1" in r.stdout, r.stdout
    maxrss_mb = int(r.stdout.split("maxrss_kb")[1]) / 1024
    assert maxrss_mb < 300, f"{maxrss_mb:.0f} MB resident: the arena was allocated before the check"


def test_memory_escape_hatch():
    # tiny-gpt2's 535 KiB of weights against 100 kB available: refused, and built with the hatch open.
    r = helpers.python(BIG_MODEL_SNIPPET, "tiny-gpt2", env={"ZOO_MEMORY_AVAILABLE": "100000"})
    assert r.returncode == 0 and "refused:" in r.stdout, r.stdout + r.stderr
    r = helpers.python(BIG_MODEL_SNIPPET, "tiny-gpt2",
                       env={"ZOO_MEMORY_AVAILABLE": "100000", "ZOO_SKIP_MEMORY_CHECK": "1"})
    assert r.returncode == 0, r.stderr
    assert "built" in r.stdout, r.stdout


def test_train_model_too_big_one_error_with_both_numbers(folders, tmp_path):
    r = helpers.cli("train", "--preset", "gpt2", "--data", folders["data"], "--out", tmp_path / "run", "--steps", "1",
                 env={"ZOO_MEMORY_AVAILABLE": "100000000"})
    helpers.assert_error(r, "474.70 MiB", "95.37 MiB", "ZOO_SKIP_MEMORY_CHECK=1", status=EXIT_RESOURCES)


def test_a_model_that_fits_to_generate_is_refused_training_at_its_first_step():
    # The weights (4 bytes per parameter) fit; the gradients and AdamW moments (12 more) do not:
    # the model is made and runs forward, and its first training step is refused before the
    # executor touches the training state.
    n_params = num_parameters(zoo.preset("tiny-gpt2"))
    r = helpers.python("""
import numpy as np, zoo
from zoo.core.errors import ResourceError
m = zoo.Model(zoo.preset("tiny-gpt2"))
x = np.zeros((2, 8), dtype=np.int64)
m.logits(x)
try:
    m.forward_backward(x, x)
    print("trained")
except ResourceError as e:
    print("refused:", e)
""", env={"ZOO_MEMORY_AVAILABLE": str(8 * n_params)})
    assert r.returncode == 0, r.stderr
    assert "refused: training on a batch of 2 x 8 tokens (the gradients and AdamW moments" in r.stdout, r.stdout


def test_train_batch_too_big_for_memory_names_checkpointing(folders, tmp_path):
    # The model and its training state fit (16 bytes per parameter), its activations at 64 x 256 tokens do not.
    n_params = num_parameters(zoo.preset("tiny-gpt2"))
    available = 16 * n_params + (1 << 20)
    r = helpers.cli("train", "--preset", "tiny-gpt2", "--data", folders["data"], "--out", tmp_path / "run",
                 "--steps", "1", "--batch-size", "64", "--seq-len", "256",
                 env={"ZOO_MEMORY_AVAILABLE": str(available)})
    helpers.assert_error(r, "64 x 256", f"{available:,} bytes", "--checkpointing", status=EXIT_RESOURCES)


def test_forward_backward_checks_the_activation_arena_before_planning_it():
    r = helpers.python("""
import resource, numpy as np, zoo
from zoo.core.errors import ResourceError
m = zoo.Model(zoo.preset("tiny-gpt2"))
x = np.zeros((2, 8), dtype=np.int64)
m.forward_backward(x, x)  # small enough
big = np.zeros((4096, 256), dtype=np.int64)
try:
    m.forward_backward(big, big)
    print("planned")
except ResourceError as e:
    print("refused:", e)
# This process's own peak (VmHWM): getrusage's ru_maxrss survives exec, so a child forked
# from a large pytest process would report the parent's peak.
print("maxrss_kb", next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")))
""", env={"ZOO_MEMORY_AVAILABLE": str(200 << 20)})
    assert r.returncode == 0, r.stderr
    assert "refused: a batch of 4096 x 256 tokens" in r.stdout and "200.00 MiB" in r.stdout, r.stdout
    maxrss_mb = int(r.stdout.split("maxrss_kb")[1]) / 1024
    assert maxrss_mb < 300, f"{maxrss_mb:.0f} MB resident: the arena was planned before the check"


@needs_shared(STORIES)
def test_a_rope_context_beyond_the_bound_loads_with_a_smaller_max_seq_len(tmp_path):
    # RoPE positions are computed: a config.json naming a context of 4M tokens (long-context
    # Llama finetunes do) is refused as it is, and loads when max_seq_len caps it.
    folder = tmp_path / "long"
    shutil.copytree(STORIES, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=4194304)))
    r = helpers.python(f"""
import zoo
m = zoo.Model.from_pretrained({str(folder)!r}, max_seq_len=512)
print("context", m.config.max_seq_len)
try:
    zoo.Model.from_pretrained({str(folder)!r})
except ValueError as e:
    print("refused:", e)
""")
    assert r.returncode == 0, r.stderr
    assert "context 512" in r.stdout and "refused:" in r.stdout and "max_position_embeddings" in r.stdout, r.stdout


def test_a_kv_cache_too_big_for_memory_is_refused_before_it_is_allocated():
    n_params = num_parameters(zoo.preset("tiny-llama"))
    r = helpers.python("""
import zoo
from zoo.core.errors import ResourceError
m = zoo.Model(zoo.preset("tiny-llama"))
m.reset_cache(1, 16)  # small enough
print("cache bytes:", 4 * m._exec.cache_floats(64, 256))
try:
    m.reset_cache(64, 256)  # the keys and values alone: 2 layers x 64 x 2 heads x 256 x 16 x 2 = 8 MiB
    print("allocated")
except ResourceError as e:
    print("refused:", e)
""", env={"ZOO_MEMORY_AVAILABLE": str(4 * n_params + (8 << 20))})
    assert r.returncode == 0, r.stderr
    needed = int(r.stdout.split("cache bytes:")[1].split()[0])
    assert needed > 8 << 20
    assert "refused: generation of 64 x 256 tokens (the KV cache" in r.stdout, r.stdout
    assert f"({needed:,} bytes)" in r.stdout, r.stdout
    assert "is available ($ZOO_MEMORY_AVAILABLE)" in r.stdout, r.stdout
