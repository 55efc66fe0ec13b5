"""Preference tuning end to end: the data formats and the errors that name their file and line,
pairs cut or left out to fit a row, the losses' derivatives, the settings, the trainer under
each method (a cached reference for full finetuning, the adapters switched off under LoRA) with
exact resume, evaluation on held-out pairs, TRL's metric names and the plot, data-parallel runs;
and learning: an SFT run, then DPO from its checkpoint, on a generated task whose chosen answers
follow a rule the rejected ones break."""

import itertools
import json
import os
import random

import numpy as np
import pytest

import zoo
from zoo.text.chat_template import FALLBACK_TEMPLATE, ChatTemplate
from zoo.train.config import TrainConfig
from zoo.train.data import DataError
from zoo.train.preference import (
    PairSplits,
    answer_cap,
    pack_pairs,
    split_implicit_prompt,
    tokenize_pairs,
)
from zoo.train.preference_loss import PreferenceLoss
from zoo.train.trainer import Trainer, TrainInterrupted

BYTES = zoo.Tokenizer.byte_level()
TEMPLATE = ChatTemplate(FALLBACK_TEMPLATE, "zoo's fallback", BYTES.bos_token, BYTES.eos_token)


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def ids(text: str) -> list[int]:
    return list(BYTES.encode(text))


# --- formats ---------------------------------------------------------------------------


def test_the_formats_tokenize_as_trl_splits_them(tmp_path):
    user = [{"role": "user", "content": "2+2?"}]
    good, bad = [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]
    files = {
        "text.jsonl": [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}],
        "implicit_text.jsonl": [{"chosen": "2+2= four", "rejected": "2+2= three"}],
        "chat.jsonl": [{"prompt": user, "chosen": good, "rejected": bad}],
        "implicit_chat.jsonl": [{"chosen": user + good, "rejected": user + bad}],
    }
    got = {}
    for name, records in files.items():
        pairs = tokenize_pairs([write_jsonl(tmp_path / name, records)], BYTES, tmp_path / "cache", TEMPLATE)
        assert pairs.n_pairs == 1
        got[name] = [list(map(int, part)) for part in pairs.pair(0)]
    bos, eos = BYTES.bos_id, BYTES.eos_id  # text: BOS first (distinct from EOS here), EOS after each answer
    assert got["text.jsonl"] == [[bos] + ids("2+2="), ids("4") + [eos], ids("5") + [eos]]
    # TRL's extract_prompt: the space before the first difference goes to the answers
    assert split_implicit_prompt("2+2= four", "2+2= three") == ("2+2=", " four", " three")
    assert got["implicit_text.jsonl"] == [[bos] + ids("2+2="), ids(" four") + [eos], ids(" three") + [eos]]
    # a chat: the prompt with the generation prompt, the answers where the whole chats part from it
    prompt = ids(TEMPLATE.render(user, add_generation_prompt=True))
    assert got["chat.jsonl"][0] == prompt
    assert prompt + got["chat.jsonl"][1] == ids(TEMPLATE.render(user + good))
    assert prompt + got["chat.jsonl"][2] == ids(TEMPLATE.render(user + bad))
    assert got["implicit_chat.jsonl"] == got["chat.jsonl"]
    # the same files again come from the cache
    assert tokenize_pairs([tmp_path / "text.jsonl"], BYTES, tmp_path / "cache", TEMPLATE).reused


@pytest.mark.parametrize("lines,message", [
    (['{"prompt": "a", "chosen": "b"}'], r"line 1: a record with keys \['chosen', 'prompt'\] is no preference pair"),
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', "{oops"], r"line 2: not JSON"),
    (['{"prompt": "a", "chosen": "b", "rejected": 3}'], r"line 1: \"rejected\" must be a string or a list"),
    (['{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}'],
     r"line 1: the fields mix text and messages"),
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', '{"chosen": "ab", "rejected": "ac"}'],
     r"line 2: a text record with an implicit prompt in a file of text records with an explicit prompt"),
    (['{"prompt": [{"role": "user", "content": "a"}], "chosen": [], "rejected": [{"role": "assistant", '
      '"content": "c"}]}'], r"line 1: \"chosen\" is an empty list of messages"),
    (['{"prompt": [{"role": "user"}], "chosen": [{"role": "assistant", "content": "b"}], "rejected": '
      '[{"role": "assistant", "content": "c"}]}'], r"line 1: prompt\[0\] must be an object with string"),
    (['{"prompt": [{"role": "robot", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}], '
      '"rejected": [{"role": "assistant", "content": "c"}]}'], r"line 1: .*role 'robot'"),
    (['{"text": "an SFT record"}'], r"no preference pair .*--method sft"),
    ([], r"no records"),
])
def test_bad_records_name_the_file_and_line(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "pairs.jsonl", lines)
    with pytest.raises(DataError, match=message) as info:
        tokenize_pairs([path], BYTES, tmp_path / "cache", TEMPLATE)
    assert str(path) in str(info.value)


def test_preference_data_must_be_jsonl(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("some text")
    with pytest.raises(DataError, match=r"notes.txt: preference data is JSONL"):
        tokenize_pairs([path], BYTES, tmp_path / "cache", TEMPLATE)


def test_pairs_too_long_for_a_row_are_cut_or_left_out(tmp_path):
    # BOS + prompt, answer + EOS: the row holds the prompt but its last token, then both answers
    records = [{"prompt": "p" * 5, "chosen": "c" * 4, "rejected": "r" * 3},  # fits: 5 + 5 + 4 = 14 tokens
               {"prompt": "p" * 5, "chosen": "c" * 20, "rejected": "r" * 2},  # the longer answer cut
               {"prompt": "p" * 5, "chosen": "c" * 9, "rejected": "r" * 9},  # both cut to the same length
               {"prompt": "p" * 16, "chosen": "c", "rejected": "r"}]  # the prompt fills the row: left out
    pairs = tokenize_pairs([write_jsonl(tmp_path / "p.jsonl", records)], BYTES, tmp_path / "cache")
    assert [answer_cap(*map(int, n), 16) for n in pairs.lengths()] == [5, 8, 5, 0]
    splits = PairSplits(pairs, 2, 16, 0.0, 1, 0)
    assert (splits.truncated, splits.dropped) == (2, 1)
    assert splits.describe() == "3 train pairs, 0 val, 2 longer than a row cut to it, 1 left out (the prompt alone fills a row)"
    batch = pack_pairs(splits.pairs([0, 1, 2]), 16)
    assert batch.x.shape == (3, 16)  # one pair a row
    np.testing.assert_array_equal(batch.lengths, [[5, 4], [8, 3], [5, 5]])
    assert np.count_nonzero(batch.answer >= 0) == batch.lengths.sum()


def test_the_prompt_is_computed_once_in_a_packed_pair():
    pair = (np.arange(1, 7), np.arange(10, 14), np.arange(20, 23))
    shared = pack_pairs([pair], 32)
    apart = pack_pairs([pair], 32, share_prompt=False)
    # the shared row: the prompt but its last token, then each answer's inputs (12 tokens where the
    # two sequences apart take 17), the rejected answer hiding the chosen one
    np.testing.assert_array_equal(shared.x[0, :12], [1, 2, 3, 4, 5, 6, 10, 11, 12, 6, 20, 21])
    np.testing.assert_array_equal(shared.positions[0, :12], [0, 1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7])
    np.testing.assert_array_equal(shared.hidden[0, 9:12], [[5, 9]] * 3)
    np.testing.assert_array_equal(apart.x[0, :17], [1, 2, 3, 4, 5, 6, 10, 11, 12, 1, 2, 3, 4, 5, 6, 20, 21])
    assert not apart.hidden.any()
    for batch in (shared, apart):
        np.testing.assert_array_equal(batch.y[batch.answer == 0], [10, 11, 12, 13])
        np.testing.assert_array_equal(batch.y[batch.answer == 1], [20, 21, 22])


# --- the losses ---------------------------------------------------------------------------


@pytest.mark.parametrize("loss", [PreferenceLoss("dpo", 0.3), PreferenceLoss("dpo", 0.2, label_smoothing=0.15),
                                  PreferenceLoss("ipo", 0.4), PreferenceLoss("orpo", 0.5),
                                  PreferenceLoss("simpo", 2.0, label_smoothing=0.1, simpo_gamma=0.7)])
def test_the_derivatives_are_the_losses(loss):
    rng = np.random.default_rng(0)
    nc, nr = rng.integers(1, 9, 5), rng.integers(1, 9, 5)
    pc, pr = -rng.uniform(0.5, 3, 5) * nc, -rng.uniform(0.5, 3, 5) * nr
    rc, rr = pc + rng.normal(0, 1, 5), pr + rng.normal(0, 1, 5)
    terms = loss.pairs(pc, pr, nc, nr, rc, rr)
    h = 1e-6
    for which, d in (("chosen", terms.d_chosen), ("rejected", terms.d_rejected)):
        up = loss.pairs(pc + h * (which == "chosen"), pr + h * (which == "rejected"), nc, nr, rc, rr).loss
        down = loss.pairs(pc - h * (which == "chosen"), pr - h * (which == "rejected"), nc, nr, rc, rr).loss
        np.testing.assert_allclose(d, (up - down) / (2 * h), rtol=1e-5, atol=1e-8)
    if loss.needs_reference:  # at the reference the rewards are zero and dpo's loss is log 2
        same = loss.pairs(pc, pr, nc, nr, pc, pr)
        assert np.all(same.metrics["rewards/margins"] == 0)
        if loss.method == "dpo" and not loss.label_smoothing:
            np.testing.assert_allclose(same.loss, np.log(2))


def test_settings_belong_to_their_methods():
    with pytest.raises(ValueError, match="--beta apply to --method dpo or ipo or orpo or simpo, not sft"):
        TrainConfig(beta=0.2)
    with pytest.raises(ValueError, match="--label-smoothing apply to --method dpo or simpo, not ipo"):
        TrainConfig(method="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="--simpo-gamma, --cpo-alpha apply to --method simpo, not dpo"):
        TrainConfig(method="dpo", simpo_gamma=1.0, cpo_alpha=1.0)
    with pytest.raises(ValueError, match="--train-on-everything is for --method sft"):
        TrainConfig(method="orpo", train_on_everything=True)
    with pytest.raises(ValueError, match="label_smoothing"):
        TrainConfig(method="dpo", label_smoothing=0.5)
    assert TrainConfig(method="simpo", beta=2.0, simpo_gamma=1.0, cpo_alpha=0.5).method == "simpo"


# --- runs ----------------------------------------------------------------------------------


def rule_task(tmp_path, n_held: int = 40):
    """Three-letter words; an answer is the word in upper case (the rule) or as it is. SFT data
    has both, so the SFT model follows the rule half the time; the preference pairs choose the
    upper case. The last n_held words are held out (the validation split's pairs)."""
    words = ["".join(w) for w in itertools.permutations("abcdefgh", 3)]
    random.Random(0).shuffle(words)
    held, train = words[:n_held], words[n_held:]
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": w + "=", "completion": a} for w in train for a in (w.upper(), w)])
    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": w + "=", "chosen": w.upper(), "rejected": w}
                                           for w in train + held])
    return held, len(train) + len(held)


def settings(tmp_path, name, **kw):
    base = dict(preset="tiny-llama", data=[str(tmp_path / "pairs.jsonl")], out=str(tmp_path / name),
                cache_dir=str(tmp_path / "cache"), batch_size=8, seq_len=32, steps=8, lr=1e-3, warmup_steps=1,
                eval_every=4, eval_batches=2, save_every=4, threads=1, progress=False, sample_tokens=0,
                method="dpo", val_fraction=0.1)
    base.update(kw)
    return TrainConfig(**base)


def records(out):
    """(train, val) records of a run's metrics.jsonl, without the timings."""
    recs = [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"}
            for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in recs if "loss" in r], [r for r in recs if "val_loss" in r]


def interrupt_at(step):
    def on_step(done, loss):
        if done == step:
            os.kill(os.getpid(), 2)
    return on_step


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_dpo_run_logs_trl_metrics_and_resumes_exactly(tmp_path, lora):
    rule_task(tmp_path)
    extra = dict(lora=True, lora_r=4, base_dtype="fp32", lr=3e-3) if lora else {}
    Trainer(settings(tmp_path, "full", **extra)).run()
    train, val = records(tmp_path / "full")
    assert [r["step"] for r in train] == list(range(1, 9))
    for r in train:
        assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"} <= set(r)
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"])
    # before the first step the model is its reference: every reward is 0, exactly
    assert val[0]["step"] == 0 and val[0]["val_rewards/margins"] == 0 and val[0]["val_rewards/accuracies"] == 0
    assert val[0]["val_loss"] == pytest.approx(np.log(2))
    assert val[-1]["val_rewards/margins"] > 0
    log = (tmp_path / "full" / "train.log").read_text()
    assert "objective: DPO (sigmoid), beta 0.1" in log
    assert ("the base with the adapters off" in log) == lora
    assert ("reference log-probabilities computed for" in log) != lora
    assert "data: 1 file(s) of preference pairs (text)" in log
    # DPO over LoRA checkpoints by default (both of tiny-llama's layers at this shape), and says so
    assert ("activation checkpointing: on for the first 2 of 2 layers (dpo's default with --lora" in log) == lora

    with pytest.raises(TrainInterrupted):
        Trainer(settings(tmp_path, "cut", **extra)).run(on_step=interrupt_at(4))
    resumed = Trainer(settings(tmp_path, "cut", resume=True, **extra))
    assert resumed.step == 4
    resumed.run()
    assert records(tmp_path / "cut") == records(tmp_path / "full")
    if not lora:  # the second run found the reference in the cache
        assert "reference log-probabilities from the cache" in (tmp_path / "cut" / "train.log").read_text()


@pytest.mark.parametrize("method,lora,given,expected", [
    ("dpo", True, None, True), ("ipo", True, None, True), ("dpo", True, False, False),
    ("dpo", False, None, False), ("orpo", True, None, False), ("simpo", True, None, False),
    ("sft", True, None, False), ("sft", False, True, True), ("orpo", True, True, True)])
def test_reference_losses_under_lora_checkpoint_unless_told_not_to(tmp_path, method, lora, given, expected):
    """--checkpointing unset: on for dpo and ipo with --lora (their step runs the reference's
    forward too), off otherwise; given, as given. The model the trainer builds follows it."""
    extra = dict(lora=True, lora_r=4, base_dtype="fp32") if lora else {}
    cfg = settings(tmp_path, "run", method=method, checkpointing=given, **extra)
    assert cfg.uses_checkpointing == expected
    if method == "dpo" and lora:
        rule_task(tmp_path)
        model = Trainer(cfg).model
        assert model.checkpointing == expected
        assert model.checkpoint_layers == (cfg.checkpoint_layers(model.config, cfg.batch_size) if given is None else
                                           model.config.n_layer * expected)


def test_the_default_checkpoints_the_fewest_layers_its_memory_allowance_asks_for():
    """The method's default checkpoints the first k layers: the fewest whose memory estimate is
    within DEFAULT_CHECKPOINT_GROWTH of checkpointing every layer (llama-3.2-1b at the DPO
    benchmark's shape: some layers, not all)."""
    from zoo.arch.lora import LoraConfig, module_names
    from zoo.arch.memory import finetune_memory_bytes, partial_checkpoint_layers
    from zoo.arch.presets import preset
    from zoo.train.config import DEFAULT_CHECKPOINT_GROWTH

    cfg = preset("llama-3.2-1b")
    lora = LoraConfig(r=16, alpha=32.0, targets=module_names(cfg))

    def total(k):
        return finetune_memory_bytes(cfg, 1, 383, k, "bf16", lora=lora, base_dtype="bf16").total

    k = partial_checkpoint_layers(cfg, 1, 383, DEFAULT_CHECKPOINT_GROWTH, "bf16", lora, "bf16")
    assert 0 < k < cfg.n_layer
    assert total(k) <= (1 + DEFAULT_CHECKPOINT_GROWTH) * total(cfg.n_layer) < total(k - 1)
    assert partial_checkpoint_layers(cfg, 1, 383, 0.0, "bf16", lora, "bf16") == cfg.n_layer
    assert partial_checkpoint_layers(cfg, 1, 383, 10.0, "bf16", lora, "bf16") == 0
    with pytest.raises(ValueError, match="growth"):
        partial_checkpoint_layers(cfg, 1, 383, -0.1, "bf16", lora, "bf16")


def test_a_dpo_run_over_lora_keeps_the_later_layers_activations_where_they_are_a_small_share(tmp_path):
    """Eight layers at one pair of 32 tokens a micro-batch: the default checkpoints 7 of them, the
    trainer's model follows, the log says so, and the run trains."""
    from zoo.arch.presets import preset

    rule_task(tmp_path)
    model_cfg = preset("tiny-llama").model_copy(update={"n_layer": 8})
    cfg = settings(tmp_path, "run", model=model_cfg, preset=None, batch_size=1, lora=True, lora_r=4,
                   base_dtype="fp32", steps=2, eval_every=2, save_every=2)
    assert cfg.checkpoint_layers(model_cfg, 1) == 7
    trainer = Trainer(cfg)
    assert trainer.model.checkpoint_layers == 7
    trainer.run()
    assert "activation checkpointing: on for the first 7 of 8 layers" in (tmp_path / "run" / "train.log").read_text()
    assert all(np.isfinite(r["loss"]) for r in records(tmp_path / "run")[0])


def test_a_full_finetuning_run_without_its_cached_reference_cannot_resume(tmp_path):
    rule_task(tmp_path)
    with pytest.raises(TrainInterrupted):
        Trainer(settings(tmp_path, "run")).run(on_step=interrupt_at(4))
    for f in (tmp_path / "cache").glob("reference-*.npy"):
        f.unlink()
    with pytest.raises(DataError, match="reference log-probabilities .* are gone from the cache"):
        Trainer(settings(tmp_path, "run", resume=True))


@pytest.mark.parametrize("method,extra", [("orpo", {}), ("simpo", {"cpo_alpha": 0.5}), ("ipo", {"beta": 0.5})])
def test_the_other_methods_train(tmp_path, method, extra):
    rule_task(tmp_path)
    Trainer(settings(tmp_path, method, method=method, **extra)).run()
    train, val = records(tmp_path / method)
    assert all(np.isfinite(r["loss"]) for r in train)
    if method in ("orpo", "simpo"):  # the NLL term, and ORPO's odds
        assert "nll_loss" in train[-1] and "val_nll_loss" in val[-1]
    if method == "orpo":
        assert {"log_odds_ratio", "log_odds_chosen"} <= set(train[-1])
    assert (tmp_path / method / "loss.png").is_file()


def test_sft_then_dpo_learns_the_rule(tmp_path):
    """SFT on both kinds of answer, then DPO from its checkpoint (through the CLI): the held-out
    pairs' preference accuracy reaches 95% and greedy generations follow the rule."""
    from zoo.cli import main
    from zoo.generate import generate, prompt_tokens

    held, n_pairs = rule_task(tmp_path)
    common = ["--cache-dir", str(tmp_path / "cache"), "--threads", "1", "--no-progress", "--sample-tokens", "0",
              "--batch-size", "16", "--seq-len", "64"]
    assert main(["train", "--preset", "tiny-llama", "--data", str(tmp_path / "sft.jsonl"), "--out",
                 str(tmp_path / "sft"), "--steps", "300", "--lr", "3e-3", "--warmup-steps", "20", *common]) == 0
    assert main(["finetune", "--from", str(tmp_path / "sft"), "--method", "dpo", "--beta", "0.1", "--data",
                 str(tmp_path / "pairs.jsonl"), "--out", str(tmp_path / "dpo"), "--steps", "60", "--lr", "5e-4",
                 "--val-fraction", str(len(held) / n_pairs), "--eval-batches", "3", *common]) == 0
    _, val = records(tmp_path / "dpo")
    assert val[0]["val_rewards/accuracies"] == 0 and val[-1]["val_rewards/accuracies"] >= 0.95

    def follows(src):
        model, tok = zoo.Model.from_pretrained(src), zoo.Tokenizer.from_pretrained(src)
        outs = [tok.decode(generate(model, prompt_tokens(tok, w + "="), 6, temperature=0, stop_ids=tok.eos_ids),
                           skip_special=True) for w in held]
        return np.mean([o == w.upper() for o, w in zip(outs, held)])

    before, after = follows(tmp_path / "sft"), follows(tmp_path / "dpo")
    assert before < 0.8  # the SFT model picks either answer
    assert after >= 0.95
    assert (tmp_path / "dpo" / "loss.png").is_file()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_ranks_train_as_one_process(tmp_path, lora):
    """Each rank takes its slice of every micro-batch's pairs, and divides by the whole batch's
    pairs (and NLL tokens): the ranks' summed gradients are one process's. Full finetuning: the
    ranks compute the reference a share each, in a cache of their own."""
    from test_distributed import _assert_same_run, _launch, _mpi_missing, _one_process

    if _mpi_missing():
        pytest.skip(_mpi_missing())
    rule_task(tmp_path)
    run = dict(data=[str(tmp_path / "pairs.jsonl")], method="orpo" if lora else "dpo", seq_len=32)
    if lora:
        run.update(lora=True, lora_r=4, base_dtype="fp32")
    _one_process(tmp_path / "one", **run)
    status, console = _launch(2, tmp_path / "two", cache_dir=str(tmp_path / "cache2"), **run)
    assert status == 0, console
    assert "distributed: 2 ranks" in console and console.count("done: step 6") == 1
    _assert_same_run(tmp_path / "two", tmp_path / "one")
    train_one, val_one = records(tmp_path / "one")
    train_two, val_two = records(tmp_path / "two")
    for a, b in zip(train_one + val_one, train_two + val_two):
        for k in a:  # accuracies count rewards above a tie, where the last bits decide: not compared
            if not k.endswith("accuracies"):
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (a["step"], k)


@pytest.mark.parametrize("base", ["bf16", "int8", "nf4"])
def test_lora_over_a_narrow_base(tmp_path, base):
    """DPO with LoRA over a bf16, int8 or nf4 base (products in bf16 where the CPU has them): the
    reference is that base with the adapters off, so at step 0 every reward is exactly 0, and the
    margin grows."""
    rule_task(tmp_path)
    Trainer(settings(tmp_path, base, lora=True, lora_r=4, base_dtype=base, lr=3e-3)).run()
    train, val = records(tmp_path / base)
    assert val[0]["val_rewards/margins"] == 0 and val[0]["val_loss"] == pytest.approx(np.log(2))
    assert all(np.isfinite(r["loss"]) for r in train) and val[-1]["val_rewards/margins"] > 0


def test_a_diverged_preference_run_stops_at_its_step(tmp_path):
    from zoo.train.trainer import TrainError

    rule_task(tmp_path)
    trainer = Trainer(settings(tmp_path, "nan"))

    def poison(done, loss):
        if done == 5:
            trainer.model.parameters()["model.norm.weight"][0] = np.nan

    with pytest.raises(TrainError, match=r"loss became nan at step 6.*last good checkpoint is .*step-00000004"):
        trainer.run(on_step=poison)
