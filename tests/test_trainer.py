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
from zoo import Model
from zoo.io.run_folder import checkpoint_dirs
from zoo.train.checkpoint import read_state
from zoo.train.config import DEMO_DATA, TrainConfig
from zoo.train.trainer import Trainer, TrainError, TrainInterrupted, lr_at


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
    final = Model.from_pretrained(tmp_path / "run")
    last = Model.from_pretrained(tmp_path / "run" / "checkpoints" / "step-00000040")
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
    good = Model.from_pretrained(checkpoint_dirs(tmp_path / "run")[0])
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
    Model.from_pretrained(ckpts / "step-00000004")


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


# --- extending a run with a larger budget ----------------------------------------------


def test_extending_a_finished_run_follows_the_schedule_of_the_new_total(tmp_path, capsys):
    """A 100-step run extended to 150 equals, from step 100 on, a run that was at step 100 of a
    150-step plan: the same weights and moments at 100, then lr_at(cfg, step, 150)."""
    Trainer(config(tmp_path, "a", steps=100, eval_every=None, save_every=50)).run()
    # The reference: the same step-100 checkpoint, its saved plan rewritten to 150 steps, resumed as is.
    b_ckpt = tmp_path / "b" / "checkpoints" / "step-00000100"
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step-00000100", b_ckpt)
    state = read_state(b_ckpt)
    state["total_steps"], state["config"]["steps"] = 150, 150
    (b_ckpt / "trainer_state.json").write_text(json.dumps(state))

    capsys.readouterr()
    extended = Trainer(config(tmp_path, "a", steps=150, eval_every=None, save_every=50, resume=True))
    err = capsys.readouterr().err
    assert (extended.step, extended.total_steps) == (100, 150)
    assert f"extending the run in {tmp_path / 'a'} from 100 to 150 steps" in err
    extended.run()
    capsys.readouterr()
    reference = Trainer(config(tmp_path, "b", steps=150, eval_every=None, save_every=50, resume=True))
    assert "extending the run" not in capsys.readouterr().err  # the plan says 150 already: an exact resume
    reference.run()

    train_a, val_a = losses(tmp_path / "a")
    train_b, val_b = losses(tmp_path / "b")
    assert [s for s, _ in train_a] == list(range(1, 151))
    assert [r for r in train_a if r[0] > 100] == train_b and [s for s, _ in train_b] == list(range(101, 151))
    assert [r for r in val_a if r[0] > 100] == val_b
    for k, v in extended.model.parameters().items():
        assert np.array_equal(v, reference.model.parameters()[k]), k
    assert np.array_equal(extended.model.optimizer_state()["v"], reference.model.optimizer_state()["v"])

    # The rule, in the records: metrics step n used lr_at(n - 1) of the plan in force.
    cfg = config(tmp_path)
    lrs = {r["step"]: r["lr"] for r in map(json.loads, open(tmp_path / "a" / "metrics.jsonl")) if "lr" in r}
    assert all(lrs[n] == lr_at(cfg, n - 1, 100) for n in range(1, 101))
    assert all(lrs[n] == lr_at(cfg, n - 1, 150) for n in range(101, 151))
    # The final model is published again, and the plot covers the whole run.
    final = Model.from_pretrained(tmp_path / "a")
    for k, v in final.parameters().items():
        assert np.array_equal(v, extended.model.parameters()[k]), k
    assert read_state(checkpoint_dirs(tmp_path / "a")[-1])["total_steps"] == 150
    assert (tmp_path / "a" / "loss.png").is_file()


def test_a_resumed_budget_can_grow_but_not_shrink(tmp_path, capsys):
    Trainer(config(tmp_path, steps=8)).run()
    with pytest.raises(TrainError, match=r"--steps 6 ends at or before step 8.*cannot be shrunk"):
        Trainer(config(tmp_path, steps=6, resume=True))
    # Other settings that change the losses are still refused, the budget aside.
    with pytest.raises(TrainError, match=r"differ .*lr: 0\.003 -> 0\.001"):
        Trainer(config(tmp_path, steps=10, resume=True, lr=1e-3))

    # An interrupted run: the same budget resumes it exactly; a smaller one is refused; a larger
    # one extends it, the schedule of the new total taking over at the checkpoint.
    with pytest.raises(TrainInterrupted):
        Trainer(config(tmp_path, "cut", steps=12)).run(on_step=_interrupt_at(6))
    with pytest.raises(TrainError, match=r"--steps 10 is fewer than the 12 steps .* can only grow"):
        Trainer(config(tmp_path, "cut", steps=10, resume=True))
    capsys.readouterr()
    t = Trainer(config(tmp_path, "cut", steps=None, tokens=16 * 128, resume=True))  # 128 tokens a step
    assert "from 12 to 16 steps" in capsys.readouterr().err
    t.run()
    lrs = [(r["step"], r["lr"]) for r in map(json.loads, open(tmp_path / "cut" / "metrics.jsonl")) if "lr" in r]
    assert [s for s, _ in lrs] == list(range(1, 17))
    assert [lr for s, lr in lrs if s > 6] == [lr_at(t.cfg, s - 1, 16) for s in range(7, 17)]

    # A complete run resumed with its own budget has nothing to train: it says so and finishes.
    capsys.readouterr()
    done = Trainer(config(tmp_path, steps=8, resume=True)).run()
    assert done["step"] == 8 and "complete at step 8: nothing to train" in capsys.readouterr().err


# --- what a run leaves and says, however it stops -----------------------------------------


def _sigint_at(step):
    def hook(done, loss):
        if done == step:
            os.kill(os.getpid(), signal.SIGINT)
    return hook


@pytest.mark.parametrize("how", ["complete", "sigint", "diverged", "crash"])
def test_plot_log_and_run_folder_however_the_run_stops(tmp_path, capsys, monkeypatch, how):
    monkeypatch.chdir(tmp_path)
    trainer = Trainer(config(tmp_path).model_copy(update={"out": "runs/rel"}))  # a relative --out
    out = tmp_path / "runs" / "rel"

    def poison(done, loss):
        if done == 5:
            trainer.model.parameters()["model.norm.weight"][0] = np.nan

    hooks = {"complete": None, "sigint": _sigint_at(5), "diverged": poison, "crash": _crash_at(5)}
    raised = {"complete": None, "sigint": TrainInterrupted, "diverged": TrainError, "crash": RuntimeError}[how]
    if raised is None:
        trainer.run(on_step=hooks[how])
    else:
        with pytest.raises(raised):
            trainer.run(on_step=hooks[how])
    err = capsys.readouterr().err
    lines = err.splitlines()

    assert (out / "loss.png").stat().st_size > 1000
    log = (out / "train.log").read_text()
    # Quiet mode: the console is exactly train.log, but for the error, which the caller prints.
    error_line = {"complete": None, "sigint": "interrupted at step 5; checkpoint saved to",
                  "diverged": "error: loss became nan at step 6", "crash": "error: RuntimeError: simulated crash"}[how]
    if error_line is None:
        assert log == err
    else:
        assert log.startswith(err) and log[len(err):].startswith(error_line) and log.count("\n") == len(lines) + 1
    # The run folder, in full, on the line that starts the run and on the one that ends it.
    starting = [l for l in lines if l.startswith("starting:")]
    assert len(starting) == 1 and starting[0].endswith(f"run folder {out}")
    end = {"complete": "done: step 12, train loss ", "sigint": "stopped at step 5 (Ctrl-C): checkpoint step-00000005, ",
           "diverged": "stopped at step 5 (error): checkpoint step-00000004, ",
           "crash": "stopped at step 5 (error): checkpoint step-00000004, "}[how]
    assert lines[-1].startswith(end) and lines[-1].endswith(f"loss.png and train.log are in {out}"
                                                            if how == "complete" else f"loss.png, train.log in {out}")


# --- evaluation spacing and the quiet mode's lines ---------------------------------------


def test_evaluations_are_spaced_to_the_run_by_default(tmp_path):
    assert TrainConfig().eval_interval(100) == 10 and TrainConfig().eval_interval(1000) == 100
    assert TrainConfig().eval_interval(7) == 1
    assert TrainConfig(eval_every=0).eval_interval(1000) == 0 and TrainConfig(eval_every=30).eval_interval(100) == 30
    assert Trainer(config(tmp_path, "long", steps=1000, eval_every=None)).eval_every == 100
    Trainer(config(tmp_path, steps=100, eval_every=None)).run()
    assert [s for s, _ in losses(tmp_path / "run")[1]] == list(range(0, 101, 10))
    Trainer(config(tmp_path, "ends", steps=10, eval_every=0)).run()
    assert [s for s, _ in losses(tmp_path / "ends")[1]] == [0, 10]


def test_quiet_mode_prints_a_line_per_interval(tmp_path, capsys):
    import re

    line = re.compile(r"step (\d+)/40: loss \d+\.\d{4}, lr [0-9.e-]+, [\d,]+ tok/s, val loss \d+\.\d{4}$")
    Trainer(config(tmp_path, steps=40, eval_every=None)).run()  # progress=False: --no-progress
    printed = [int(m[1]) for m in map(line.match, capsys.readouterr().err.splitlines()) if m]
    assert printed == list(range(2, 41, 2))  # default: every max(1, 40 // 20) steps

    Trainer(config(tmp_path, "every5", steps=12, print_every=5)).run()
    assert "step 5/12: loss" in capsys.readouterr().err

    # With the progress bar the lines go to train.log only.
    Trainer(config(tmp_path, "bar", steps=40, eval_every=None, progress=True)).run()
    assert not [l for l in capsys.readouterr().err.splitlines() if line.match(l)]
    logged = [int(m[1]) for m in map(line.match, (tmp_path / "bar" / "train.log").read_text().splitlines()) if m]
    assert logged == list(range(2, 41, 2))
