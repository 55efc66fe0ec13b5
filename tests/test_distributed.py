"""Data-parallel training (docs/distributed.md).

First the pieces that need no MPI: AdamW over a shard of the parameters, clipping by a given
norm, and the split of a global batch across ranks. Then whole runs under mpirun (skipped, with
the reason, where mpi4py or mpirun is missing; `make test` installs both through the `mpi`
extra): tiny Llama, byte-level tokenizer, the demo text, one thread per rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import needs, zoo_command

import zoo
from zoo.arch.layout import num_parameters
from zoo.train.config import DEMO_DATA, TrainConfig


def _batch(seed=0, B=4, T=32):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 258, (B, T)), rng.integers(0, 258, (B, T))


def test_adamw_over_shards_equals_adamw_over_all():
    """Two models holding half the moments each, clipped by the norm summed from both halves and
    merged after each step, follow the model that holds them all, bitwise: the same element-wise
    update. The whole model's own norm sums the same squares in another order, equal to 1e-6;
    all three clip by the summed one (the other order's last bits can round the float32 clip
    factor to its neighbour: so they did with OpenBLAS's SkylakeX kernels' gradients)."""
    cfg = zoo.preset("tiny-llama")
    whole = zoo.Model(cfg, seed=0)
    n, cut = whole.n_params, whole.n_params // 2 + 5  # a cut inside a tensor, off the 16-float grid
    halves = [zoo.Model(cfg, seed=0), zoo.Model(cfg, seed=0)]
    halves[0].set_moment_range(0, cut)
    halves[1].set_moment_range(cut, n)
    assert halves[0].optimizer_state()["m"].size == cut and halves[1].optimizer_state()["v"].size == n - cut
    x, y = _batch()
    for _ in range(3):
        for m in (whole, *halves):
            m.zero_grads()
            m.forward_backward(x, y)
        norm = np.sqrt(halves[0].grad_sum_squares(0, cut) + halves[1].grad_sum_squares(cut, n))
        assert norm == pytest.approx(whole.grad_norm(), rel=1e-6)
        assert norm > 0.5  # so the step clips
        for m in (whole, *halves):
            assert m.adamw_step(1e-2, weight_decay=0.1, max_grad_norm=0.5, grad_norm=norm) == norm
        merged = np.concatenate([halves[0].parameter_block()[:cut], halves[1].parameter_block()[cut:]])
        for m in halves:
            m.parameter_block()[:] = merged
        np.testing.assert_array_equal(merged, whole.parameter_block())
    # The shards' moments are the whole model's, cut at the same place.
    np.testing.assert_array_equal(halves[1].optimizer_state()["v"], whole.optimizer_state()["v"][cut:])


def test_moment_range_is_fixed_once_the_moments_exist():
    m = zoo.Model(zoo.preset("tiny-llama"), seed=0)
    with pytest.raises(ValueError, match="not a non-empty range"):
        m.set_moment_range(5, 5)
    m.optimizer_state()
    with pytest.raises(RuntimeError, match="in use already"):
        m.set_moment_range(0, 10)


def test_reduced_gradients_replace_the_pass_norm():
    """reduce_gradients: what a collective writes into the block is what the step clips by."""
    m = zoo.Model(zoo.preset("tiny-llama"), seed=0)
    m.zero_grads()
    m.forward_backward(*_batch())
    before = m.grad_norm()
    m.reduce_gradients(lambda block: block.__imul__(2.0))
    assert m.grad_norm() == pytest.approx(2 * before, rel=1e-6)
    with pytest.raises(ValueError, match="grad_norm must be >= 0"):
        m.adamw_step(1e-3, grad_norm=float("nan"))


def test_batch_share_covers_the_global_batch_once():
    from zoo.train.data import DataError, batch_share

    rows = [batch_share(8, 3, r, 4) for r in range(4)]  # 8 rows split: a slice of every micro-batch
    assert [s.rows for s in rows] == [(0, 2), (2, 4), (4, 6), (6, 8)] and all(s.micros == range(3) for s in rows)
    assert rows[0].scale == 1 / 12
    dealt = [batch_share(2, 4, r, 4) for r in range(4)]  # 2 rows cannot: whole micro-batches, round robin
    assert [list(s.micros) for s in dealt] == [[0], [1], [2], [3]] and dealt[0].rows == (0, 2)
    assert dealt[0].scale == 1 / 4
    with pytest.raises(DataError, match="3 ranks cannot share a global batch of --batch-size 4 x --grad-accum 2"):
        batch_share(4, 2, 0, 3)


def test_shard_bounds_are_aligned_and_cover_the_region():
    from zoo.train.distributed import shard_bounds

    b = shard_bounds(0, 133_440, 3)
    assert b[0] == 0 and b[-1] == 133_440 and all(x % 16 == 0 for x in b[:-1]) and b == sorted(set(b))
    assert shard_bounds(100, 200, 2) == [100, 148, 200]


# --- runs under mpirun --------------------------------------------------------------------


def _mpi_missing() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'zoo[mpi]'; make test installs it)"
    from zoo.core.errors import DistributedError
    from zoo.train.launch import find_mpirun

    try:
        find_mpirun()
    except DistributedError as e:
        return str(e)
    return None


needs_mpi = pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))

# Steps of 8 x 32 tokens on the tiny Llama: a few ms each, so a run is mostly its start.
RUN = dict(preset="tiny-llama", data=[str(DEMO_DATA)], batch_size=4, grad_accum=2, seq_len=32, steps=6, lr=3e-3,
           warmup_steps=1, eval_every=3, eval_batches=3, save_every=3, threads=1, progress=False, sample_tokens=0)
TIMEOUT = 120  # seconds for any one launch; a hung test fails instead of hanging CI


def _flags(**settings) -> list[str]:
    out = []
    for k, v in settings.items():
        flag = "--from" if k == "from_dir" else "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, list):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


def _launch(ranks: int, out: Path, env: dict | None = None, verb: str = "train", **settings) -> tuple[int, str]:
    """`zoo launch -n RANKS train ...` in a subprocess: (exit status, console text)."""
    run = {k: v for k, v in RUN.items() if not (verb == "finetune" and k == "preset")}
    cmd = zoo_command("launch", "-n", ranks, verb,
                      *_flags(**{**run, "cache_dir": str(out.parent / "cache"), "out": str(out), **settings}))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, **(env or {})})
    return p.returncode, p.stdout + p.stderr


def _one_process(out: Path, **settings):
    """The run in this process (the trainer sets the thread count; conftest.py gives it back)."""
    from zoo.train.trainer import Trainer

    run = {k: v for k, v in RUN.items() if not ("from_dir" in settings and k == "preset")}
    Trainer(TrainConfig(**{**run, "cache_dir": str(out.parent / "cache"), "out": str(out), **settings})).run()


def _records(out: Path) -> tuple[list[dict], list[dict]]:
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [r for r in recs if "loss" in r], [r for r in recs if "val_loss" in r]


def _weights(folder: Path) -> dict[str, np.ndarray]:
    from zoo.io.safetensors import SafetensorsFile

    weights = folder / "model.safetensors"
    if not weights.exists():  # a LoRA run's: its adapters
        weights = folder / "adapter_model.safetensors"
    with SafetensorsFile(weights) as f:
        return {name: f.read(name) for name in f.tensors}


def _assert_same_run(got: Path, want: Path, steps: int = RUN["steps"]):
    """Per-step losses and gradient norms, and validation losses, within 1e-6 relative. The
    final weights: all but 0.1% within 1e-6, and none further than 5% of the learning rate.
    A weight's gradient is a sum over every token of the batch, summed here in another order;
    where its terms cancel, their last bits are a large part of it, and AdamW, which divides
    by the root of the second moment, moves such a weight by a part of lr that differs (the
    worst seen: 1.1% of lr after 6 steps, 4 ranks)."""
    (train_got, val_got), (train_want, val_want) = _records(got), _records(want)
    assert [r["step"] for r in train_got] == list(range(1, steps + 1)) == [r["step"] for r in train_want]
    for a, b in zip(train_got, train_want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6, abs=0), a["step"]
    assert [r["step"] for r in val_got] == [r["step"] for r in val_want]
    for a, b in zip(val_got, val_want):
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-6, abs=0), a["step"]
    w_got, w_want = _weights(got), _weights(want)
    assert w_got.keys() == w_want.keys()
    diff = np.concatenate([np.abs(w_got[k] - w_want[k]).reshape(-1) for k in w_got])
    assert (diff > 1e-6).mean() < 1e-3, (diff > 1e-6).mean()
    assert diff.max() <= 0.05 * RUN["lr"], diff.max()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process with gradient accumulation over the global batch: 4 x 2 micro-batches (the
    ranks split their rows), and 2 x 4 (4 ranks take whole micro-batches)."""
    root = tmp_path_factory.mktemp("distributed")
    _one_process(root / "rows")
    _one_process(root / "micros", batch_size=2, grad_accum=4)
    return root


AUDIT = '''
import os, sys
RANK = os.environ.get("OMPI_COMM_WORLD_RANK")
WATCHED = os.environ["ZOO_TEST_WATCHED"]
LOG = os.path.join(os.environ["ZOO_TEST_AUDIT_DIR"], f"rank-{RANK}.txt")
EVENTS = {"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.listdir", "os.scandir", "shutil.rmtree",
          "os.link", "os.symlink", "os.truncate", "os.chmod", "os.utime"}

def _paths(args):
    for a in args:
        if isinstance(a, (str, bytes, os.PathLike)):
            yield os.fsdecode(os.fspath(a))

def _hook(event, args):
    if event in EVENTS:
        for p in _paths(args):
            if os.path.abspath(p).startswith(WATCHED):
                with open(LOG, "a") as f:  # outside WATCHED: no recursion
                    f.write(f"{event} {p}\\n")

if RANK is not None:
    sys.addaudithook(_hook)
'''


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """An uninterrupted run of 2 ranks, started by mpirun directly (as users of other launchers
    do), with an audit hook (a sitecustomize.py) recording per rank every file operation of
    Python on a path under --out: (run folder, audit folder, console). The reference of the
    fault tests below."""
    from zoo.train.launch import OPEN_MPI_ROOT_ENV, find_mpirun

    root = tmp_path_factory.mktemp("two-ranks")
    hook, audit, out = root / "hook", root / "audit", root / "run"
    hook.mkdir()
    audit.mkdir()
    (hook / "sitecustomize.py").write_text(AUDIT)
    env = {**os.environ, **OPEN_MPI_ROOT_ENV, "PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "ZOO_TEST_WATCHED": str(out), "ZOO_TEST_AUDIT_DIR": str(audit)}
    args = _flags(**{**RUN, "cache_dir": str(root / "cache"), "out": str(out)})
    p = subprocess.run([find_mpirun(), "-n", "2", "--oversubscribe", sys.executable, "-m", "zoo.cli", "train", *args],
                       capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return out, audit, p.stdout + p.stderr


@pytest.fixture(scope="module")
def zero_1(tmp_path_factory):
    """2 ranks under `zoo launch` with ZeRO-1: (run folder, console)."""
    out = tmp_path_factory.mktemp("zero-1") / "run"
    status, console = _launch(2, out, zero=1)
    assert status == 0, console
    return out, console


@needs_mpi
def test_two_ranks_train_as_one_process_and_only_rank_0_touches_the_run_folder(references, two_ranks):
    """Not bitwise: each rank's pullbacks sum over its rows only, and MPI adds the ranks' sums,
    in another order than one process adding micro-batch after micro-batch. Rank 0's file
    operations under --out are many (the hook works), rank 1's none; rank 0 alone speaks."""
    out, audit, console = two_ranks
    _assert_same_run(out, references / "rows")
    assert "distributed: 2 ranks on 1 host" in console and console.count("done: step 6") == 1
    assert (out / "train.log").read_text().count("step 6: val loss") == 1
    assert len((audit / "rank-0.txt").read_text().splitlines()) > 10
    assert not (audit / "rank-1.txt").exists(), (audit / "rank-1.txt").read_text()


@needs_mpi
def test_zero_1_trains_as_one_process(references, zero_1):
    out, console = zero_1
    _assert_same_run(out, references / "rows")
    assert "distributed: 2 ranks on 1 host" in console and console.count("done: step 6") == 1


@needs_mpi
def test_four_ranks_with_zero_1_taking_whole_micro_batches_train_as_one_process(references, tmp_path):
    """A global batch of 2 rows x 4 micro-batches: each of 4 ranks takes one micro-batch (2 rows
    cannot be split 4 ways) and keeps a quarter of the AdamW moments."""
    status, console = _launch(4, tmp_path / "run", zero=1, batch_size=2, grad_accum=4)
    assert status == 0, console
    _assert_same_run(tmp_path / "run", references / "micros")
    assert "distributed: 4 ranks on 1 host" in console and console.count("done: step 6") == 1


@needs_mpi
def test_packed_chats_and_lora_on_two_ranks_train_as_one_process(tmp_path):
    """Packed rows carry loss on different numbers of tokens: each rank's slice counts as its
    share of the micro-batch's tokens, so the ranks still compute one process's gradient. The
    chat template is rank 0's (sent to the others). With LoRA each rank reads the frozen base
    itself, rank 0 sends the adapters, and the ranks sum the adapters' gradients only."""
    rng = np.random.default_rng(0)
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(120):
            question = " ".join(rng.choice(["red", "blue", "green", "why", "how", "is"], rng.integers(1, 6)))
            answer = " ".join(rng.choice(["yes", "no", "maybe", "later"], rng.integers(1, 9)))
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    settings = dict(data=[str(chats)], seq_len=64, lora=True, lora_r=4, base_dtype="fp32")
    _one_process(tmp_path / "one", **settings)
    status, console = _launch(2, tmp_path / "two", **settings)
    assert status == 0, console
    assert "packed rows" in console and "the fp32 base is frozen" in console
    _assert_same_run(tmp_path / "two", tmp_path / "one")


@needs_mpi
@needs("torch", "transformers", "tokenizers")
def test_finetuning_a_hugging_face_checkpoint_on_two_ranks(tmp_path):
    """GPT-2 with its BPE files (vocab.json, merges.txt; its ids from config.json): rank 0
    loads it and sends the other rank the model config, the tokenizer's files and the weights."""
    from hf_helpers import gpt2_checkpoint

    text = "".join((DEMO_DATA / name).read_text() for name in sorted(os.listdir(DEMO_DATA)))
    ckpt = gpt2_checkpoint(tmp_path / "gpt2", text)
    _one_process(tmp_path / "one", from_dir=str(ckpt))
    status, console = _launch(2, tmp_path / "two", verb="finetune", from_dir=str(ckpt))
    assert status == 0, console
    _assert_same_run(tmp_path / "two", tmp_path / "one")


@needs_mpi
def test_zero_1_shards_the_moments_and_saves_them_whole(zero_1, two_ranks):
    """Each rank's moments cover its shard alone (the header's per-rank memory), and the
    checkpoint holds them whole, as a one-process run's: ZeRO-1 and plain data parallelism
    write the same moments to the last bits."""
    from zoo.arch.memory import human_bytes
    from zoo.io.safetensors import SafetensorsFile

    (zero, console), (plain, _, plain_console) = zero_1, two_ranks
    n = num_parameters(zoo.preset("tiny-llama"))
    assert f"AdamW moments {human_bytes(8 * (n // 2 // 16 * 16))}" in console  # rank 0's shard
    assert f"AdamW moments {human_bytes(8 * n)}" in plain_console
    ckpt = "checkpoints/step-00000006/optimizer.safetensors"
    with SafetensorsFile(zero / ckpt) as a, SafetensorsFile(plain / ckpt) as b:
        for name in ("m", "v"):
            assert a.info(name).shape == (n,)
            np.testing.assert_allclose(a.read(name), b.read(name), rtol=1e-4, atol=1e-9)


def _metrics_equal(got: Path, want: Path) -> None:
    """The same records, bit for bit, but for the speed."""
    def drop_speed(records):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]

    (train_got, val_got), (train_want, val_want) = _records(got), _records(want)
    assert drop_speed(train_got) == drop_speed(train_want) and val_got == val_want


@needs_mpi
def test_a_killed_rank_ends_every_rank_and_the_run_resumes_exactly(two_ranks, tmp_path):
    """kill -9 of rank 1 in step 5: mpirun ends the other rank at once and names the dead one.
    The checkpoint of step 3 is intact; resumed with the same rank count, the run ends bitwise
    where the uninterrupted one did (the data order is a function of the step, and MPI sums the
    ranks' gradients in the same order every time)."""
    reference = two_ranks[0]
    out = tmp_path / "run"
    status, console = _launch(2, out, env={"ZOO_TEST_FAULT": "1:5:die"})
    assert status != 0 and "rank 1" in console, console
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]
    assert not (out / "config.json").exists()  # nothing published
    zoo.Model.from_pretrained(out / "checkpoints" / "step-00000003")
    status, console = _launch(2, out, resume=True)
    assert status == 0, console
    _metrics_equal(out, reference)
    w, w_ref = _weights(out), _weights(reference)
    assert all(np.array_equal(w[k], w_ref[k]) for k in w_ref)


@needs_mpi
def test_a_stalled_rank_is_named_and_one_process_resumes_the_run(two_ranks, tmp_path):
    """Rank 1 sleeps at step 5: rank 0 waits --rank-timeout, names it in one line (also in
    train.log) and aborts the job (exit status 5) rather than hang (the launch's own timeout
    would fail the test). One process resumes the checkpoint of step 3: the same batches,
    summed in another order (losses within 1e-6)."""
    reference = two_ranks[0]
    out = tmp_path / "run"
    status, console = _launch(2, out, env={"ZOO_TEST_FAULT": "1:5:stall"}, rank_timeout=5)
    line = "rank 1 did not reach the gradient exchange of step 5 within --rank-timeout 5 s"
    assert status == 5 and console.count(line) == 1, console
    assert "the last checkpoint is" in console and line in (out / "train.log").read_text()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]
    _one_process(out, resume=True)
    assert "the run used 2 rank(s), this one 1" in (out / "train.log").read_text()
    _assert_same_run(out, reference)


@needs_mpi
def test_zero_1_resumes_with_another_rank_count(two_ranks, tmp_path):
    """ZeRO-1 checkpoints hold the moments whole: 4 ranks stop (rank 2 killed in step 4), 2
    ranks resume with their own shards."""
    reference = two_ranks[0]
    out = tmp_path / "run"
    status, console = _launch(4, out, env={"ZOO_TEST_FAULT": "2:4:die"}, zero=1)
    assert status != 0 and "rank 2" in console, console
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]
    status, console = _launch(2, out, resume=True, zero=1)
    assert status == 0, console
    _assert_same_run(out, reference)


@needs_mpi
def test_ranks_whose_weights_differ_stop_before_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    status, console = _launch(2, out, env={"ZOO_TEST_FAULT": "1:3:perturb"})
    assert status == 1 and console.count("zoo: error: after step 3 the weights of rank 1 differ from rank 0's") == 1, \
        console
    assert not (out / "checkpoints").exists()


@needs_mpi
def test_ctrl_c_under_zoo_launch_stops_every_rank_after_a_checkpoint(tmp_path):
    """Ctrl-C reaches zoo launch alone (mpirun has a process group of its own); it asks every
    rank to stop (SIGUSR1, which mpirun forwards): they save a checkpoint after the same step,
    end with status 130, and the run resumes."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zoo.cli", "launch", "-n", "2", "train",
           *_flags(**{**RUN, "steps": 100_000, "save_every": 0, "eval_every": 0, "cache_dir": str(tmp_path / "cache"),
                      "out": str(out)})]
    # Ctrl-C's default action, as a terminal's foreground job has it: a suite started in the
    # background of a script inherits SIGINT ignored, and Python then leaves it ignored.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + TIMEOUT
    while not (out / "metrics.jsonl").exists() or len(_records(out)[0]) < 3:
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0] if p.poll() is not None else ""
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal sends its foreground process group
    console = p.communicate(timeout=TIMEOUT)[0]
    assert p.returncode == 130, console
    assert console.count("zoo: interrupted at step") == 1, console
    (ckpt,) = (out / "checkpoints").iterdir()
    assert f"checkpoint saved to {ckpt}" in console


def test_one_process_never_imports_mpi4py(tmp_path):
    code = ("import sys; from zoo.cli import main; status = main(sys.argv[1:]); "
            "assert 'mpi4py' not in sys.modules, 'mpi4py imported'; sys.exit(status)")
    args = _flags(**{**RUN, "steps": 1, "cache_dir": str(tmp_path / "cache"), "out": str(tmp_path / "run")})
    p = subprocess.run([sys.executable, "-c", code, "train", *args], capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_launched_rank_without_mpi4py_says_how_to_install_it(tmp_path):
    code = "import sys; sys.modules['mpi4py'] = None; from zoo.cli import main; sys.exit(main(sys.argv[1:]))"
    args = _flags(**{**RUN, "steps": 1, "cache_dir": str(tmp_path / "cache"), "out": str(tmp_path / "run")})
    p = subprocess.run([sys.executable, "-c", code, "train", *args], capture_output=True, text=True, timeout=TIMEOUT,
                       env={**os.environ, "OMPI_COMM_WORLD_SIZE": "2"})
    assert p.returncode == 1 and "pip install 'zoo[mpi]'" in p.stderr, p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv,message", [
    (["launch", "-n", "2", "generate", "--from", "x"], "must be one of train, finetune, demo, got generate"),
    (["launch", "-n", "0", "train"], "-n: must be at least 1"),
    (["launch", "-n", "2", "--mpirun", "/no/such/mpirun", "train"], "--mpirun /no/such/mpirun: no such program"),
    (["launch", "-n", "2", "--hostfile", "/no/such/file", "train"], "--hostfile /no/such/file: no such file"),
])
def test_launch_refuses_what_it_cannot_start(argv, message, capsys):
    from zoo.cli import main

    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_launch_command_binds_cores_or_oversubscribes():
    from zoo.train.launch import launch_command

    cmd, env = launch_command("/x/mpirun", 2, ["train"], open_mpi=True, cores=8)
    assert cmd[:7] == ["/x/mpirun", "-n", "2", "--map-by", "slot:PE=4", "--bind-to", "core"]
    assert cmd[-4:] == [sys.executable, "-m", "zoo.cli", "train"]
    cmd, _ = launch_command("/x/mpirun", 4, ["train"], open_mpi=True, cores=2)
    assert "--oversubscribe" in cmd and "--bind-to" in cmd and "none" in cmd
    if os.geteuid() == 0:
        assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    cmd, _ = launch_command("/x/mpiexec", 2, ["train"], open_mpi=False, hostfile="hosts")
    assert cmd[:5] == ["/x/mpiexec", "-n", "2", "-f", "hosts"]


@needs_mpi
def test_bench_dist_reports_every_system(tmp_path):
    out = tmp_path / "dist.json"
    p = subprocess.run([sys.executable, "-m", "zoo.tools.bench_dist", "--preset", "tiny-llama", "--batch-size", "4",
                        "--seq-len", "16", "--steps", "2", "--warmup", "1", "--rounds", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    s = r["systems"]
    assert set(s) == {"single", "dp", "zero1"} and "| dp | 2 x 1 |" in p.stdout
    assert s["dp"]["loss_first"] == pytest.approx(s["single"]["loss_first"], rel=1e-6)  # the same step
    half = s["dp"]["per_rank"][0]["moment_mib"] / 2
    assert [x["moment_mib"] for x in s["zero1"]["per_rank"]] == pytest.approx([half, half], rel=1e-3)
    assert {row["preset"] for row in r["cost_model"]} >= {"gpt2", "llama-3.1-8b"}
    assert "overlap_probe_median_ms" in s["dp"]


GATHER = '''
import numpy as np
from zoo.train import distributed
group = distributed.world()
distributed.BUCKET_FLOATS = 64
bounds = distributed.shard_bounds(0, 1000, group.size)
expected = np.concatenate([np.full(bounds[r + 1] - bounds[r], r + 1, np.float32) for r in range(group.size)])
for way in ("allgatherv", "bcast"):
    if way == "bcast":
        distributed.MAX_COUNT = 100  # as if the block were beyond MPI's int counts
    block = np.zeros(1000, np.float32)
    block[bounds[group.rank]:bounds[group.rank + 1]] = group.rank + 1
    group.all_gather("the test", block, bounds)
    print(f"{way} ok" if np.array_equal(block, expected) else f"{way}: rank {group.rank} wrong", flush=True)
'''


@needs_mpi
def test_all_gather_of_shards(tmp_path):
    """The weights' all-gather, in one Allgatherv and in the bucketed broadcasts used where a
    block's offsets are beyond MPI's int counts (a model of 2^31 parameters and more): both in
    one launch of 3 ranks."""
    from zoo.train.launch import OPEN_MPI_ROOT_ENV, find_mpirun

    script = tmp_path / "gather.py"
    script.write_text(GATHER)
    p = subprocess.run([find_mpirun(), "-n", "3", "--oversubscribe", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, **OPEN_MPI_ROOT_ENV})
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(p.stdout.split()) == sorted(["allgatherv", "ok"] * 3 + ["bcast", "ok"] * 3), p.stdout + p.stderr
