"""`python -m zoo.tools.bench_dpo` end to end on the tiny Llama: every system runs in its own
process, the table and the JSON come out, zoo's two layouts compute the same loss (the prompt
shared or not), and TRL's worker takes the same token ids (it checks them) and never imports
zoo. No timing assertions."""

import json
import math

import pytest

import zoo
from zoo.arch.lora import default_precision
from zoo.tools import bench_dpo


def test_every_system_runs_on_the_same_pair(tmp_path, capsys):
    pytest.importorskip("trl")
    out = tmp_path / "dpo.json"
    assert bench_dpo.main(["--preset", "tiny-llama", "--prompt-len", "12", "--answer-len", "6", "--rank", "4",
                           "--threads", "1", "--rounds", "1", "--steps", "2", "--warmup", "1", "--systems",
                           *bench_dpo.SYSTEMS, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["schema"] == bench_dpo.SCHEMA and set(r["systems"]) == set(bench_dpo.SYSTEMS)
    for name, s in r["systems"].items():
        assert s["step_ms_min"] <= s["step_ms_median"] <= s["step_ms_max"] and len(s["step_ms"]) == 2, name
        assert s["peak_rss_mib"] > 0 and all(math.isfinite(x) for x in s["losses"]), name
        assert f"| {name} |" in table
    zoo, apart, trl = r["systems"]["zoo"], r["systems"]["zoo_unshared"], r["systems"]["trl"]
    # the same first loss (log 2: the policy is its reference), whatever the layout
    for s in (zoo, apart, r["systems"]["zoo_checkpointing"], r["systems"]["zoo_no_checkpointing"], trl):
        assert s["losses"][0] == pytest.approx(math.log(2), rel=1e-4)
    # the zoo system is what a run of the method has by default: DPO over LoRA checkpoints
    assert "activation checkpointing" in zoo["implementation"]
    assert "activations kept" in r["systems"]["zoo_no_checkpointing"]["implementation"]
    assert (zoo["tokens_forward"], apart["tokens_forward"], trl["tokens_forward"]) == (11 + 6 + 6, 2 * 17, 2 * 18)
    assert "prompt_sharing" in r["ratios"] and "zoo_over_trl" in r["ratios"]
    # zoo's peak memory, accounted for: its arenas as the model reports them, within the peak
    for name in ("zoo", "zoo_no_checkpointing"):
        s = r["systems"][name]
        assert {"frozen_base", "weights", "gradients", "moments", "activations"} <= set(s["arena_mib"])
        assert s["rss_after_import_mib"] + sum(s["arena_mib"].values()) < s["peak_rss_mib"]
        assert f"- {name}'s peak RSS, MiB:" in table
    assert r["systems"]["zoo"]["checkpointing"] and not r["systems"]["zoo_no_checkpointing"]["checkpointing"]
    assert (r["systems"]["zoo"]["arena_mib"]["activations"]
            < r["systems"]["zoo_no_checkpointing"]["arena_mib"]["activations"])


def test_the_profile_splits_a_dpo_step_into_its_parts(tmp_path, capsys):
    """`python -m zoo.tools.profile_dpo`: the step's parts (the reference's forward, the policy's,
    the pullback, AdamW) each timed and profiled per block, within the step's time; the SFT step
    beside it; the method's default checkpointing."""
    from zoo.tools import profile_dpo

    out = tmp_path / "profile.json"
    assert profile_dpo.main(["--preset", "tiny-llama", "--prompt-len", "12", "--answer-len", "6", "--rank", "4",
                             "--threads", "1", "--steps", "1", "--sft", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    parts = ("reference_forward", "policy_forward", "python_loss", "pullback", "adamw")
    assert set(parts) <= set(r["dpo"]) and r["tokens"] == 11 + 6 + 6
    assert sum(r["dpo"][p]["s"] for p in parts) <= r["dpo"]["step_s"]
    assert "lora" not in r["dpo"]["reference_forward"]["blocks"]  # the adapters off
    assert "lora" in r["dpo"]["policy_forward"]["blocks"] and "linear" in r["dpo"]["pullback"]["blocks"]
    assert r["dpo"]["pullback"]["blocks"]["linear"][1] > 0 and r["sft"]["forward_backward"]["s"] > 0
    assert r["checkpoint_layers"] == r["n_layer"] == 2  # the default at this shape: both layers
    assert r["precision"] == default_precision("bf16")  # what this CPU runs best
    assert "dpo step:" in capsys.readouterr().out
