"""The trainer: schedule, accumulation, exact resume, Ctrl-C, divergence, unwritable output.

Tiny Llama preset, byte-level tokenizer, the demo text shipped in the package, one thread
(so runs are deterministic and fast on a shared 2-core machine)."""

import json
import os
import shutil
import signal
import subprocess

import numpy as np
import pytest

import zoo
from zoo.checkpoints import load_pretrained
from zoo.train_config import DEMO_DATA, TrainConfig
from zoo.trainer import Trainer, TrainError, TrainInterrupted, checkpoint_dirs, lr_at, read_state


@pytest.fixture(autouse=True)
def restore_threads():
    """Runs here set one thread for the process; give later tests back what they had."""
    import zoo

    n = zoo.get_threads()
    yield
    zoo.set_threads(n)


def config(tmp_path, name="run", **kw):
    base = dict(preset="tiny-llama", data=[str(DEMO_DATA)], out=str(tmp_path / name), cache_dir=str(tmp_path / "cache"),
                batch_size=4, seq_len=32, steps=12, lr=3e-3, warmup_steps=2, eval_every=4, eval_batches=2,
                save_every=4, threads=1, progress=False, sample_tokens=0)
    base.update(kw)
    return TrainConfig(**base)


def losses(out):
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r], [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]


def test_lr_schedule():
    c = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, steps=110)
    assert lr_at(c, 0, 110) == pytest.approx(0.1) and lr_at(c, 9, 110) == pytest.approx(1.0)
    assert lr_at(c, 10, 110) == pytest.approx(1.0) and lr_at(c, 109, 110) == pytest.approx(0.1)
    assert lr_at(c, 59, 110) == pytest.approx(0.55, abs=0.01)  # cosine midpoint
    lin = c.model_copy(update={"schedule": "linear"})
    assert lr_at(lin, 59, 110) == pytest.approx(0.55, abs=0.01) and lr_at(lin, 109, 110) == pytest.approx(0.1)
    const = c.model_copy(update={"schedule": "constant"})
    assert lr_at(const, 100, 110) == 1.0
    assert TrainConfig(lr=2.0).final_lr == pytest.approx(0.2)


def test_budgets():
    assert TrainConfig(epochs=2, batch_size=4, seq_len=10).total_steps(1000) == 50
    assert TrainConfig(tokens=401, batch_size=4, seq_len=10, grad_accum=2).total_steps(1000) == 6
    assert TrainConfig().total_steps(1000) == 1000
    with pytest.raises(ValueError, match="only one budget"):
        TrainConfig(steps=3, epochs=1)


def test_accumulation_adds_scaled_gradients():
    """What the trainer relies on: two half-scaled micro-batches give the gradient of their union."""
    m = zoo.Model(zoo.preset("tiny-llama"), seed=1)
    x = np.random.default_rng(0).integers(0, 258, (4, 17)).astype(np.int32)
    m.zero_grads()
    m.forward_backward(x[:2, :-1], x[:2, 1:], 0.5)
    m.forward_backward(x[2:, :-1], x[2:, 1:], 0.5)
    accumulated = {k: v.copy() for k, v in m.gradients().items()}
    m.zero_grads()
    m.forward_backward(x[:, :-1], x[:, 1:])
    for k, g in m.gradients().items():
        np.testing.assert_allclose(accumulated[k], g, rtol=1e-4, atol=1e-6, err_msg=k)


def test_training_reduces_loss_and_writes_a_run(tmp_path):
    result = Trainer(config(tmp_path, steps=40, eval_every=20, save_every=20, grad_accum=2)).run()
    train, val = losses(tmp_path / "run")
    assert [s for s, _ in train] == list(range(1, 41)) and [s for s, _ in val] == [0, 20, 40]
    assert val[-1][1] < 0.75 * val[0][1]
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-00000020", "step-00000040"]
    assert result["plot"].is_file() and result["plot"].stat().st_size > 1000
    # The run folder is itself a checkpoint with the final weights.
    final = load_pretrained(tmp_path / "run")
    last = load_pretrained(tmp_path / "run" / "checkpoints" / "step-00000040")
    for k, v in final.parameters().items():
        assert np.array_equal(v, last.parameters()[k])


def _interrupt_at(step):
    def hook(done, loss):
        if done == step:
            signal.raise_signal(signal.SIGINT)  # as Ctrl-C: the handler sets a flag
    return hook


def _crash_at(step):
    def hook(done, loss):
        if done == step:
            raise RuntimeError("simulated crash")
    return hook


def test_resume_is_exact(tmp_path):
    full = Trainer(config(tmp_path, "full"))
    full.run()
    reference = losses(tmp_path / "full")

    # Ctrl-C at step 6: a checkpoint is saved at 6, the run stops, --resume finishes it.
    with pytest.raises(TrainInterrupted) as info:
        Trainer(config(tmp_path, "cut")).run(on_step=_interrupt_at(6))
    assert info.value.step == 6 and info.value.checkpoint.name == "step-00000006"
    resumed = Trainer(config(tmp_path, "cut", resume=True))
    assert resumed.step == 6
    resumed.run()
    assert losses(tmp_path / "cut") == reference

    # A crash at step 7 (metrics written past the step-4 checkpoint): resume from 4 drops them.
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(config(tmp_path, "crash")).run(on_step=_crash_at(7))
    again = Trainer(config(tmp_path, "crash", resume=True))
    assert again.step == 4
    again.run()
    assert losses(tmp_path / "crash") == reference

    for k, v in full.model.parameters().items():
        assert np.array_equal(v, resumed.model.parameters()[k]), k
    assert np.array_equal(full.model.optimizer_state()["v"], resumed.model.optimizer_state()["v"])


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    trainer = Trainer(config(tmp_path))

    def poison(done, loss):
        if done == 5:
            trainer.model.parameters()["model.norm.weight"][0] = np.nan

    with pytest.raises(TrainError, match=r"loss became nan at step 6.*last good checkpoint is .*step-00000004"):
        trainer.run(on_step=poison)
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-00000004"]
    good = load_pretrained(checkpoint_dirs(tmp_path / "run")[0])
    assert all(np.isfinite(v).all() for v in good.parameters().values())
    assert read_state(checkpoint_dirs(tmp_path / "run")[0])["step"] == 4


def _make_unwritable(path):
    """chmod for ordinary users; root ignores modes, so chattr +i where the filesystem has it."""
    probe = path / "probe"
    os.chmod(path, 0o555)
    try:
        probe.write_bytes(b"")
    except OSError:
        return lambda: os.chmod(path, 0o755)
    probe.unlink()
    os.chmod(path, 0o755)
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)
    pytest.skip("cannot make a folder unwritable here (root without chattr)")


def test_unwritable_out_at_checkpoint_time(tmp_path):
    trainer = Trainer(config(tmp_path))
    ckpts = tmp_path / "run" / "checkpoints"
    restore = []

    def lock(done, loss):
        if done == 4:
            restore.append(_make_unwritable(ckpts))

    try:
        with pytest.raises(TrainError, match=r"cannot write checkpoint .*step-00000008.*step-00000004 is intact"):
            trainer.run(on_step=lock)
    finally:
        for r in restore:
            r()
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-00000004"]
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp")]
    assert read_state(ckpts / "step-00000004")["step"] == 4
    load_pretrained(ckpts / "step-00000004")


def test_run_folder_guards(tmp_path):
    Trainer(config(tmp_path, steps=4)).run()
    with pytest.raises(TrainError, match="already holds a run.*--resume"):
        Trainer(config(tmp_path, steps=4))
    with pytest.raises(TrainError, match=r"differ .*lr: 0\.003 -> 0\.001"):
        Trainer(config(tmp_path, steps=4, resume=True, lr=1e-3))
    with pytest.raises(TrainError, match="no checkpoint"):
        Trainer(config(tmp_path, "other", resume=True))
    Trainer(config(tmp_path, steps=4, overwrite=True)).run()  # replaces the run


def test_resume_refuses_changed_data(tmp_path):
    data = tmp_path / "text"
    shutil.copytree(DEMO_DATA, data)
    Trainer(config(tmp_path, data=[str(data)], steps=6, save_every=3)).run()
    (data / "001.txt").write_text("An edited story.\n" * 20)
    with pytest.raises(TrainError, match="data or tokenizer changed"):
        Trainer(config(tmp_path, data=[str(data)], steps=6, save_every=3, resume=True))


def test_activation_checkpointing_gives_the_same_losses(tmp_path):
    Trainer(config(tmp_path, "plain", steps=4, eval_every=0, save_every=0)).run()
    t = Trainer(config(tmp_path, "ckpt", steps=4, eval_every=0, save_every=0, checkpointing=True))
    assert t.model.checkpointing
    t.run()
    plain, ckpt = losses(tmp_path / "plain")[0], losses(tmp_path / "ckpt")[0]
    np.testing.assert_allclose([l for _, l in ckpt], [l for _, l in plain], rtol=1e-6)
