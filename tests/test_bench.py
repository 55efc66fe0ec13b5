"""`zoo bench` end to end on the tiny presets: it runs, prints its table, writes the JSON the
issue specifies and a PNG. No timing assertions: only that the numbers are there, positive and
consistent with each other, and that zoo and PyTorch computed the same loss from the same
weights and data. One thread: fast and steady on a shared machine."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import zoo
from helpers import needs
from zoo.cli import main
from zoo.arch.layout import num_parameters, parameter_shapes
from zoo.arch.config import ModelConfig
from zoo.arch.presets import preset
from zoo.tools import bench

FAST = ["--steps", "2", "--warmup", "1", "--threads", "1"]
SYSTEM_KEYS = {"step_ms_median", "step_ms_min", "step_ms_max", "tokens_per_s", "peak_rss_mib"}
FP32_SYSTEMS = {"zoo", "torch_fused", "torch_default"}
BF16_SYSTEMS = {"zoo", "zoo_bf16", "torch_fused", "torch_fused_bf16", "torch_default"}
GEMM = zoo.gemm_info()
needs_bf16 = pytest.mark.skipif(not (GEMM["bf16_native"] and GEMM["bf16"]),
                                reason="bf16 products cannot run here (no bf16 dot products, or no oneDNN)")


def check_system(s: dict, tokens: int, steps: int) -> None:
    assert SYSTEM_KEYS <= set(s)
    for k in SYSTEM_KEYS:
        assert isinstance(s[k], float) and s[k] > 0 and math.isfinite(s[k]), (k, s[k])
    assert s["step_ms_min"] <= s["step_ms_median"] <= s["step_ms_max"]
    assert len(s["step_ms"]) == steps
    assert s["tokens_per_s"] == pytest.approx(tokens / (s["step_ms_median"] / 1000), rel=1e-9)
    assert s["threads"] == 1
    assert math.isfinite(s["loss_first"]) and s["loss_first"] > 0


def check_common(r: dict, cfg, batch: int, seq_len: int, steps: int = 2, precision: str = "fp32",
                 rounds: int = 1) -> None:
    tokens = batch * seq_len
    assert r["schema"] == "zoo-bench/2" and r["precision"] == precision
    assert f"--precision {precision}" in r["command"]
    assert r["batch"] == batch and r["seq_len"] == seq_len and r["tokens_per_step"] == tokens
    assert r["threads"] == 1 and r["steps"] == steps
    assert set(r["systems"]) == (BF16_SYSTEMS if precision == "bf16" else FP32_SYSTEMS)
    check_system(r["systems"]["zoo"], tokens, steps * rounds)  # the steps of every round, pooled
    assert r["flops_per_step"] == bench.step_flops(cfg, batch, seq_len)["total"] > 0
    for k in ("sgemm_gflops", "zoo_step_gflops"):
        assert isinstance(r[k], float) and r[k] > 0 and math.isfinite(r[k])
    zoo_ms = r["systems"]["zoo"]["step_ms_median"]
    assert r["zoo_step_gflops"] == pytest.approx(r["flops_per_step"] / (zoo_ms / 1000) / 1e9, rel=1e-9)
    assert r["zoo_step_fraction_of_sgemm"] == pytest.approx(r["zoo_step_gflops"] / r["sgemm_gflops"], rel=1e-9)
    assert r["sgemm"]["m"] == tokens and r["sgemm"]["k"] == cfg.d_model and r["sgemm"]["n"] == cfg.vocab_size
    assert set(r["blocks"]) >= {"embedding", "norm", "linear", "attention", "activation", "cross_entropy", "adamw"}
    for kind, b in r["blocks"].items():
        assert b["forward_ms"] >= 0 and b["pullback_ms"] >= 0
        assert b["total_ms"] == pytest.approx(b["forward_ms"] + b["pullback_ms"])
    assert r["blocks"]["linear"]["forward_ms"] > 0 and r["blocks"]["linear"]["pullback_ms"] > 0
    assert r["blocks_profile"]["in_blocks_ms"] > 0 and r["blocks_profile"]["precision"] == precision
    # (JSON has lists where the config has tuples: nope_layers, sliding_layers)
    assert ModelConfig(**r["model"]["config"]) == cfg and r["model"]["n_params"] == num_parameters(cfg)
    assert r["command"].startswith("zoo bench ")
    # The GEMM libraries and the CPU, as the zoo workers reported them.
    g = r["gemm"]
    assert g["fp32_library"] in GEMM["built_in"]
    assert g["lm_head_kernel"]["fp32"].split(":")[0] == g["fp32_library"]
    assert g["lm_head_shape"] == {"m": tokens, "k": cfg.d_model, "n": cfg.vocab_size}
    assert g["cpu_vendor"] == GEMM["cpu_vendor"] and g["onednn_isa"] == GEMM["onednn_isa"]
    assert g["bf16_native"] == GEMM["bf16_native"]
    assert isinstance(g["cpu"], str) and g["cpu"]
    assert set(g["cpu_flags"]) <= {"avx512_bf16", "amx_bf16", "amx_tile", "avx_ne_convert", "avx512f", "avx2"}


def check_bf16(r: dict, cfg, batch: int, seq_len: int) -> None:
    """zoo_bf16 ran with bf16 products through oneDNN, and the report says so."""
    from zoo.core.native import _native

    tokens = batch * seq_len
    check_common(r, cfg, batch, seq_len, precision="bf16")
    zoo_s, bf16_s = r["systems"]["zoo"], r["systems"]["zoo_bf16"]
    check_system(bf16_s, tokens, 2)
    assert zoo_s["precision"] == "fp32" and bf16_s["precision"] == "bf16"
    assert "bf16" in bf16_s["implementation"] and "fp32" in zoo_s["implementation"]
    # bf16 operands change the loss a little, never much: a zoo_bf16 that ran fp32 fails the first
    # (bf16 moves the first loss of these tiny models by 6e-5 to 7e-5; fp32 in another order of
    # sums by 1e-7 at most).
    assert abs(bf16_s["loss_first"] - zoo_s["loss_first"]) > 5e-6
    assert bf16_s["loss_first"] == pytest.approx(zoo_s["loss_first"], abs=1e-2)
    assert bf16_s["loss_last"] < bf16_s["loss_first"]
    g = r["gemm"]
    assert g["bf16_library"] == "onednn" and g["bf16_native"] is True
    assert g["lm_head_kernel"]["bf16"].startswith("onednn:")
    assert g["lm_head_kernel"]["bf16"] == _native.gemm_kernel("bf16", False, True, tokens, cfg.vocab_size, cfg.d_model)
    assert set(g["cpu_flags"]) & {"avx512_bf16", "amx_bf16", "avx_ne_convert"}
    bg = r["bf16_gemm"]
    assert bg["precision"] == "bf16" and (bg["m"], bg["k"], bg["n"]) == (tokens, cfg.d_model, cfg.vocab_size)
    assert r["sgemm"]["precision"] == "fp32"  # the fp32 rate is still there, from zoo's own worker
    assert isinstance(r["bf16_gemm_gflops"], float) and r["bf16_gemm_gflops"] > 0
    assert r["zoo_bf16_step_gflops"] == pytest.approx(r["flops_per_step"] / (bf16_s["step_ms_median"] / 1000) / 1e9,
                                                      rel=1e-9)
    assert r["zoo_bf16_step_fraction_of_bf16_gemm"] == pytest.approx(
        r["zoo_bf16_step_gflops"] / r["bf16_gemm_gflops"], rel=1e-9)
    # Every product zoo_bf16 ran, as oneDNN reported it: bf16 ones on bf16 kernels, the LM
    # head's forward among them, each called every step.
    used = g["products"]["bf16"]
    assert used and all(u["precision"] == "bf16" and u["bf16_kernel"] for u in used), used
    head = [u for u in used if (u["M"], u["N"], u["K"]) == (tokens, cfg.vocab_size, cfg.d_model)]
    assert head and head[0]["calls"] >= 2 and head[0]["kernel"] == g["lm_head_kernel"]["bf16"]


def check_vs_torch(r: dict, table: str, name: str, batch: int, seq_len: int, rounds: int = 1) -> None:
    """A report of zoo against both PyTorch systems: its table, every system, the ratios, the same losses."""
    for row in ("| zoo |", "| torch_fused", "| torch_default", "| linear |", "| attention |", "sgemm"):
        assert row in table, row
    assert ("| rope |" in table) == (name == "tiny-llama")
    cfg = preset(name)
    check_common(r, cfg, batch, seq_len, rounds=rounds)
    assert r["vs"] == "torch" and r["model"]["preset"] == name
    zoo_s = r["systems"]["zoo"]
    for other in ("torch_fused", "torch_default"):
        s = r["systems"][other]
        check_system(s, batch * seq_len, 2 * rounds)
        ratio = r["ratios"][f"zoo_over_{other}"]
        assert ratio["step_time"] == pytest.approx(zoo_s["step_ms_median"] / s["step_ms_median"], rel=1e-9)
        assert ratio["peak_rss"] == pytest.approx(zoo_s["peak_rss_mib"] / s["peak_rss_mib"], rel=1e-9)
        assert ratio["tokens_per_s"] == pytest.approx(1 / ratio["step_time"], rel=1e-9)
        # Same weights, same tokens, same optimizer: the same losses, step after step.
        assert s["loss_first"] == pytest.approx(zoo_s["loss_first"], rel=1e-4)
        assert s["loss_last"] == pytest.approx(zoo_s["loss_last"], rel=1e-3)
    assert zoo_s["loss_last"] < zoo_s["loss_first"]  # the optimizer steps did something


@needs("torch")
def test_bench_vs_torch(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny-llama", "--batch-size", "2", "--seq-len", "48", "--json", str(out),
                 *FAST]) == 0
    check_vs_torch(json.loads(out.read_text()), capsys.readouterr().out, "tiny-llama", 2, 48)
    png = out.with_suffix(".png")  # the chart goes next to the JSON by default
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.read_text())["png"] == str(png)


def test_bench_zoo_alone_from_config_file(tmp_path, capsys):
    cfg = preset("tiny-gpt2")
    cfg_file = tmp_path / "model.json"
    cfg_file.write_text(json.dumps(cfg.model_dump()))
    out, png = tmp_path / "r" / "zoo.json", tmp_path / "chart.png"
    assert main(["bench", "--config", str(cfg_file), "--batch-size", "2", "--seq-len", "16", "--vs", "none",
                 "--json", str(out), "--png", str(png), *FAST]) == 0
    table = capsys.readouterr().out
    assert "| zoo |" in table and "torch_fused" not in table
    r = json.loads(out.read_text())
    check_common(r, cfg, 2, 16)
    assert r["vs"] == "none" and r["model"]["config_file"] == str(cfg_file)
    assert r["systems"]["torch_fused"] is None and r["systems"]["torch_default"] is None
    assert r["ratios"] == {"zoo_over_torch_fused": None, "zoo_over_torch_default": None}
    # fp32 alone: no bf16 system, rate or library in the report.
    assert "zoo_bf16" not in table and "bf16 GEMM" not in table and "GEMM as zoo's workers ran it" in table
    assert r["bf16_gemm"] is None and r["bf16_gemm_gflops"] is None
    assert r["gemm"]["bf16_library"] is None and r["gemm"]["lm_head_kernel"]["bf16"] is None
    assert png.read_bytes()[:4] == b"\x89PNG" and not out.with_suffix(".png").exists()


@needs("torch")
def test_bench_rounds_pool_the_steps_and_report_each_round(tmp_path, capsys):
    """Against PyTorch in 2 rounds (each system in turn, twice): the report of one round, with
    each round's figures and the steps of both pooled."""
    out = tmp_path / "rounds.json"
    assert main(["bench", "--preset", "tiny-gpt2", "--batch-size", "2", "--seq-len", "32", "--rounds", "2",
                 "--json", str(out), *FAST]) == 0
    table = capsys.readouterr().out
    r = json.loads(out.read_text())
    check_vs_torch(r, table, "tiny-gpt2", 2, 32, rounds=2)
    assert "| round |" in table and "in turn 2 times" in table
    assert r["rounds"] == 2 and "--rounds 2" in r["command"]
    assert len(r["by_round"]) == 2
    for e in r["by_round"]:
        assert e["sgemm_gflops"] > 0 and e["zoo_step_ms"] > 0
        assert e["zoo_step_fraction_of_sgemm"] == pytest.approx(
            r["flops_per_step"] / (e["zoo_step_ms"] / 1000) / 1e9 / e["sgemm_gflops"], rel=1e-9)
        assert e["zoo_over_torch_fused"] == pytest.approx(e["zoo_step_ms"] / e["torch_fused_step_ms"], rel=1e-9)
    rates = sorted(e["sgemm_gflops"] for e in r["by_round"])
    assert r["sgemm_gflops"] == pytest.approx((rates[0] + rates[1]) / 2, rel=1e-9)  # their median
    assert r["zoo_step_fraction_of_sgemm"] == pytest.approx(r["zoo_step_gflops"] / r["sgemm_gflops"], rel=1e-9)
    assert main(["bench", "--preset", "tiny-gpt2", "--rounds", "0", *FAST]) == 1
    assert "--rounds must be at least 1" in capsys.readouterr().err


@needs_bf16
def test_bench_bf16_zoo_alone(tmp_path, capsys):
    cfg = preset("tiny-gpt2")
    out = tmp_path / "bf16.json"
    assert main(["bench", "--preset", "tiny-gpt2", "--batch-size", "2", "--seq-len", "16", "--vs", "none",
                 "--precision", "bf16", "--json", str(out), *FAST]) == 0
    table = capsys.readouterr().out
    for row in ("| zoo: fp32 |", "| zoo_bf16: bf16 matmuls |", "bf16 GEMM", "bf16 on onednn", "bf16 matmuls, ms per step"):
        assert row in table, row
    assert "torch_fused" not in table
    r = json.loads(out.read_text())
    check_bf16(r, cfg, 2, 16)
    assert r["vs"] == "none"
    assert {k for k, v in r["systems"].items() if v is not None} == {"zoo", "zoo_bf16"}
    assert r["ratios"] == {"zoo_over_torch_fused": None, "zoo_bf16_over_torch_fused_bf16": None,
                           "zoo_over_torch_default": None}
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


@needs_bf16
def test_bench_bf16_vs_torch_autocast(tmp_path, capsys):
    pytest.importorskip("torch")
    cfg = preset("tiny-llama")
    out = tmp_path / "bf16.json"
    assert main(["bench", "--preset", "tiny-llama", "--batch-size", "2", "--seq-len", "16",
                 "--precision", "bf16", "--json", str(out), *FAST]) == 0
    table = capsys.readouterr().out
    for row in ("| torch_fused_bf16: eager, autocast bf16, AdamW(fused=True) |", "| torch_fused: eager fp32",
                "- zoo_bf16 / torch_fused_bf16: step time", "- zoo / torch_fused: step time"):
        assert row in table, row
    r = json.loads(out.read_text())
    check_bf16(r, cfg, 2, 16)
    for name in BF16_SYSTEMS:
        check_system(r["systems"][name], 2 * 16, 2)
    zoo_s, bf16_s, torch_bf16 = r["systems"]["zoo"], r["systems"]["zoo_bf16"], r["systems"]["torch_fused_bf16"]
    assert torch_bf16["precision"] == "bf16" and "autocast bf16" in torch_bf16["implementation"]
    # Same weights and data: PyTorch's autocast and zoo's bf16 products agree to bf16's precision,
    # and autocast really ran (the fp32 PyTorch loss is another number, as for zoo: check_bf16).
    assert torch_bf16["loss_first"] == pytest.approx(bf16_s["loss_first"], abs=1e-2)
    assert abs(torch_bf16["loss_first"] - r["systems"]["torch_fused"]["loss_first"]) > 5e-6
    assert r["systems"]["torch_fused"]["loss_first"] == pytest.approx(zoo_s["loss_first"], rel=1e-4)
    ratio = r["ratios"]["zoo_bf16_over_torch_fused_bf16"]
    assert ratio["step_time"] == pytest.approx(bf16_s["step_ms_median"] / torch_bf16["step_ms_median"], rel=1e-9)
    assert ratio["peak_rss"] == pytest.approx(bf16_s["peak_rss_mib"] / torch_bf16["peak_rss_mib"], rel=1e-9)
    assert r["ratios"]["zoo_over_torch_fused"]["step_time"] == pytest.approx(
        zoo_s["step_ms_median"] / r["systems"]["torch_fused"]["step_ms_median"], rel=1e-9)
    (e,) = r["by_round"]
    assert e["zoo_bf16_over_torch_fused_bf16"] == pytest.approx(e["zoo_bf16_step_ms"] / e["torch_fused_bf16_step_ms"])


def test_bench_bf16_without_bf16_dot_products_fails_in_one_line(tmp_path):
    """oneDNN capped below bf16 (DNNL_MAX_CPU_ISA): zoo bench refuses before any work, in one line."""
    out = tmp_path / "never.json"
    env = dict(os.environ, DNNL_MAX_CPU_ISA="AVX512_CORE")
    proc = subprocess.run([sys.executable, "-m", "zoo.cli", "bench", "--preset", "tiny-gpt2", "--seq-len", "8",
                           "--vs", "none", "--precision", "bf16", "--json", str(out), *FAST],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no "writing weights", no worker started
    assert lines[0].startswith("zoo bench: error:") and "bf16" in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == "" and not out.exists()


def test_bench_bad_settings(tmp_path, capsys, monkeypatch):
    assert main(["bench", "--preset", "tiny-gpt2", "--seq-len", "100000", *FAST]) == 1
    assert "exceeds the model's context" in capsys.readouterr().err
    assert main(["bench", "--preset", "no-such-model", *FAST]) == 1
    assert "unknown preset" in capsys.readouterr().err
    # An AD backend zoo does not have: the zoo worker refuses it in one line.
    assert main(["bench", "--preset", "tiny-gpt2", "--seq-len", "8", "--vs", "none", "--ad", "bogus", *FAST]) == 1
    err = capsys.readouterr().err
    assert "bogus" in err and "Traceback" not in err
    monkeypatch.setattr(bench, "torch_available", lambda: False)
    assert main(["bench", "--preset", "tiny-gpt2", "--vs", "torch", *FAST]) == 1
    assert "PyTorch is not installed" in capsys.readouterr().err


def test_step_flops_gpt2():
    """GPT-2 124M at B=4, T=64: the issue's "about 190 GFLOP" per step."""
    f = bench.step_flops(preset("gpt2"), 4, 64)
    assert f["matmul_params"] == 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072) + 768 * 50257
    assert f["matmul"] == 6 * f["matmul_params"] * 256
    assert f["attention"] == 6 * 12 * 4 * 64 * 64 * 12 * 64
    assert 189e9 < f["total"] < 192e9


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_bench_weights_are_zoos_init(tmp_path, name):
    """weights.bin holds zoo.Model(cfg, seed)'s weights: one init (zoo.arch.layout.initial_value)."""
    cfg = preset(name)
    bench.write_workdir(tmp_path, cfg, 1, 8, seed=5)
    weights = np.fromfile(tmp_path / "weights.bin", dtype=np.float32)
    params = json.loads((tmp_path / "manifest.json").read_text())["params"]
    expected = zoo.Model(cfg, seed=5).parameters()
    assert [p["name"] for p in params] == list(parameter_shapes(cfg))
    for p in params:
        got = weights[p["offset"]:p["offset"] + math.prod(p["shape"])].reshape(p["shape"])
        np.testing.assert_array_equal(got, expected[p["name"]], err_msg=p["name"])


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_bench_ab_times_two_builds_from_their_own_roots(tmp_path, clock):
    """python -m zoo.tools.bench_ab: the base build is imported from its own root (here a copy of
    this zoo), not through the editable install; both give the same losses; on either clock."""
    import shutil

    from zoo.core.native import _native
    from zoo.tools import bench_ab

    root = tmp_path / "base"
    shutil.copytree(Path(zoo.__file__).parent, root / "zoo", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(_native.__file__, root / "zoo" / "core")  # where the package keeps its extension
    out = tmp_path / "ab.json"
    assert bench_ab.main(["--base", str(root), "--preset", "tiny-gpt2", "--batch-size", "2", "--seq-len", "8",
                          "--steps", "2", "--warmup", "1", "--rounds", "1", "--threads", "1", "--clock", clock,
                          "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["clock"] == clock
    (r,) = result["rounds"]
    assert r["same_losses"] and r["base_ms"] > 0 and r["current_ms"] > 0
    assert len(r["base_losses"]) == 3 and r["base_losses"] == r["current_losses"]  # warm-up step included
    assert r["max_loss_rel_diff"] == 0.0 and bench_ab._losses_verdict(r) == "identical"
    apart = dict(r, same_losses=False, first_loss_same=True,
                 max_loss_rel_diff=bench_ab._max_rel_diff([2.0, 1.0], [2.0, 1.0 + 3e-8]))
    assert bench_ab._losses_verdict(apart) == "NO: max relative difference 3.0e-08 (first step identical)"
    assert r["base_zoo"] == str(root / "zoo") and r["current_zoo"] != r["base_zoo"]
    with pytest.raises(SystemExit, match="no zoo package there"):
        bench_ab.main(["--base", str(tmp_path / "nowhere")])


def test_bench_ab_lora_between_two_built_roots(tmp_path):
    """--lora trains adapters over a frozen base (its losses are not the whole model's), and
    --current puts a second built root in place of this checkout: both processes import a root."""
    import shutil

    from zoo.core.native import _native
    from zoo.tools import bench_ab

    root = tmp_path / "built"
    shutil.copytree(Path(zoo.__file__).parent, root / "zoo", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(_native.__file__, root / "zoo" / "core")
    common = ["--base", str(root), "--current", str(root), "--preset", "tiny-llama", "--batch-size", "2",
              "--seq-len", "8", "--steps", "1", "--warmup", "1", "--rounds", "1", "--threads", "1"]
    lora, whole = tmp_path / "lora.json", tmp_path / "whole.json"
    assert bench_ab.main(common + ["--lora", "4", "--base-dtype", "fp32", "--json", str(lora)]) == 0
    assert bench_ab.main(common + ["--json", str(whole)]) == 0
    lora_run, whole_run = json.loads(lora.read_text()), json.loads(whole.read_text())
    assert (lora_run["lora"], lora_run["base_dtype"]) == (4, "fp32") and whole_run["base_dtype"] is None
    (r,) = lora_run["rounds"]
    assert r["base_zoo"] == r["current_zoo"] == str(root / "zoo") and r["same_losses"]
    # the same first loss (the same weights: the adapters start at zero), then apart: only the
    # adapters moved in the LoRA run
    assert r["base_losses"][0] == whole_run["rounds"][0]["base_losses"][0]
    assert r["base_losses"][1] != whole_run["rounds"][0]["base_losses"][1]
    assert lora_run["precision"] == "fp32"
    if zoo.gemm_info()["bf16_native"]:  # --precision reaches both processes' models
        bf16 = tmp_path / "bf16.json"
        assert bench_ab.main(common + ["--lora", "4", "--base-dtype", "fp32", "--precision", "bf16",
                                       "--json", str(bf16)]) == 0
        bf16_run = json.loads(bf16.read_text())
        (b,) = bf16_run["rounds"]
        assert bf16_run["precision"] == "bf16" and b["same_losses"]
        assert b["base_losses"][0] != r["base_losses"][0]  # bf16 products round: not fp32's loss
    with pytest.raises(SystemExit, match="--current .*no zoo package there"):
        bench_ab.main(["--base", str(root), "--current", str(tmp_path / "nowhere")])


def test_bench_generate_zoo_alone_writes_table_json_and_targets(tmp_path, capsys):
    # The generation benchmark without llama.cpp: zoo's side runs, the JSON records each run's load
    # average, and the targets are those that need no llama.cpp (the batch's, at the 1.1B shape).
    from zoo.tools import bench_generate

    out = tmp_path / "gen.json"
    assert bench_generate.main(["--preset", "tiny-llama", "--base", "int8", "--repeats", "1", "--new-tokens", "6",
                                "--prefill-len", "32", "--batch", "2", "--no-llama-cpp", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    from zoo.arch.lora import default_precision

    precision = default_precision("int8")  # an int8 base's products, by default
    assert f"| tiny-llama | int8 ({precision}) | - |" in table
    data = json.loads(out.read_text())
    assert data["schema"] == "zoo-bench-generate/3" and data["llama_cpp"] is None
    (zoo_run,) = data["results"][0]["runs"]["zoo"]
    assert zoo_run["decode_tokens_per_s"] > 0 and zoo_run["batch_tokens_per_s"] > 0
    assert zoo_run["prefill_tokens_per_s"] > 0 and zoo_run["load_before"] is not None
    assert data["targets"] == []  # no llama.cpp, and the batch target is the 1.1B shape's
    rows = [{"preset": "tinyllama-1.1b", "base": "int8",
             "runs": {"zoo": [{"decode_tokens_per_s": 10.0, "prefill_tokens_per_s": 100.0, "batch_tokens_per_s": 45.0}],
                      "llama.cpp": [{"decode_tokens_per_s": 11.0, "prefill_tokens_per_s": 90.0}]}}]
    args = bench_generate.argparse.Namespace(prefill_len=512, batch=8)
    got = {t["target"]: (round(t["value"], 3), t["met"]) for t in bench_generate._targets(args, rows, True)}
    assert got == {"decode tinyllama-1.1b int8 vs Q8_0": (0.909, False), "prompt 512 tinyllama-1.1b int8": (1.111, True),
                   "batch 8 vs one tinyllama-1.1b int8": (4.5, True)}
