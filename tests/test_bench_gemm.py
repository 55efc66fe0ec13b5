"""`python -m zoo.tools.bench_gemm` on a tiny preset: the shapes it takes from a model, the
products it times (checked against numpy in float64, on every library it times), its table and
JSON, and that it leaves the library choice at the default. No timing assertions beyond rates
being positive: the numbers themselves belong in docs/benchmarks.md, not in a test."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import bf16_round

import zoo
from zoo.core.native import _native
from zoo.arch.config import ModelConfig
from zoo.arch.presets import preset
from zoo.tools import bench, bench_gemm

GEMM = zoo.gemm_info()
BF16_NATIVE = GEMM["bf16"] is not None and GEMM["bf16_native"]
ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "tiny-gpt2", "--batch-size", "2", "--seq-len", "16", "--threads", "1", "--min-seconds", "0.01"]


def test_linear_shapes_follow_the_config():
    # tiny-llama: grouped-query attention (4 heads, 2 kv heads of 16) and SwiGLU (gate width 2).
    shapes = bench_gemm.linear_shapes(preset("tiny-llama"))
    assert [(s["layer"], s["in"], s["out"], s["count"]) for s in shapes] == [
        ("qkv", 64, (4 + 2 * 2) * 16, 2), ("attn_out", 64, 64, 2), ("mlp_in", 64, 2 * 176, 2),
        ("mlp_out", 176, 64, 2), ("lm_head", 64, 320, 1)]
    # Layers of the same shape are merged, their counts added: d_ff = d_model with a plain MLP.
    cfg = ModelConfig(vocab_size=320, max_seq_len=64, d_model=64, n_layer=3, n_head=4, d_ff=64)
    merged = {s["layer"]: (s["in"], s["out"], s["count"]) for s in bench_gemm.linear_shapes(cfg)}
    assert merged == {"qkv": (64, 192, 3), "attn_out+mlp_in+mlp_out": (64, 64, 9), "lm_head": (64, 320, 1)}


def expected(what: str, x, w, dy):
    """The product in float64, and |A||B| (the scale of its rounding errors)."""
    x, w, dy = (t.astype(np.float64) for t in (x, w, dy))
    if what == "forward":
        return x @ w.T, np.abs(x) @ np.abs(w).T
    if what == "dx":
        return dy @ w, np.abs(dy) @ np.abs(w)
    return dy.T @ x, np.abs(dy).T @ np.abs(x)


@pytest.mark.parametrize("column", GEMM["built_in"] + (["bf16"] if BF16_NATIVE else []))
def test_the_products_it_times_are_the_linear_layers_products(column):
    rng = np.random.default_rng(1)
    rows = 32
    try:
        for shape in bench_gemm.linear_shapes(preset("tiny-gpt2")):
            x = rng.standard_normal((rows, shape["in"]), dtype=np.float32)
            w = rng.standard_normal((shape["out"], shape["in"]), dtype=np.float32)
            dy = rng.standard_normal((rows, shape["out"]), dtype=np.float32)
            for what, (a, b, ta, tb, M, N, K) in bench_gemm.linear_products(x, w, dy).items():
                want, scale = expected(what, x, w, dy)
                assert want.shape == (M, N) and (a.shape[0] if ta else a.shape[1]) == K
                c = np.ones((M, N), dtype=np.float32)  # the tool adds into its output (beta = 1)
                if column == "bf16":
                    got = _native.gemm(a, b, ta, tb, "bf16", c).astype(np.float64) - 1
                    # Each operand rounded to bf16 (relative error <= 2^-8, so <= 2^-7 + 2^-16 for
                    # a product), then fp32 accumulation over K terms.
                    bound = (2.0**-7 + 2.0**-16 + (K + 2) * 2.0**-24) * scale + 2.0**-23
                    assert np.all(np.abs(got - want) <= bound), (shape, what)
                    # Rounded to nearest even, exactly: against the rounded operands, only the
                    # fp32 accumulation differs; and it is not an fp32 product in disguise (that one
                    # would be within the fp32 bound of the exact product).
                    ab, bb = bf16_round(a).astype(np.float64), bf16_round(b).astype(np.float64)
                    rounded = (ab.T if ta else ab) @ (bb.T if tb else bb)
                    assert np.all(np.abs(got - rounded) <= (K + 2) * 2.0**-24 * scale + 2.0**-23), (shape, what)
                    assert np.max(np.abs(got - want) / scale) > 2 * (K + 2) * 2.0**-24, (shape, what)
                else:
                    zoo.set_gemm_library(column)
                    assert _native.gemm_kernel("fp32", ta, tb, M, N, K).split(":")[0] == column
                    got = _native.gemm(a, b, ta, tb, "fp32", c).astype(np.float64) - 1
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.max(scale),
                                               err_msg=f"{column} {shape} {what}")
    finally:
        zoo.set_gemm_library("auto")


def check_result(r: dict, stdout: str, emulated_asked: bool = False) -> None:
    cfg = preset("tiny-gpt2")
    built = GEMM["built_in"]
    bf16_expected = BF16_NATIVE or (emulated_asked and GEMM["bf16"] is not None)
    assert r["columns"] == built + (["bf16"] if bf16_expected else [])
    assert r["rows"] == 32 and r["threads"] == 1
    # Every distinct shape, three products each, in the order the table prints them.
    shapes = bench_gemm.linear_shapes(cfg)
    assert [(m["layer"], m["product"]) for m in r["measurements"]] == [
        (s["layer"], p) for s in shapes for p in ("forward", "dx", "dW")]
    for m in r["measurements"]:
        assert m["flops"] == 2.0 * m["M"] * m["N"] * m["K"]
        assert set(m["results"]) == set(r["columns"])
        for column, t in m["results"].items():
            assert math.isfinite(t["gflops"]) and t["gflops"] > 0 and t["reps"] >= 3, (m, column)
            assert t["gflops"] == pytest.approx(m["flops"] / t["seconds_median"] / 1e9)
            assert t["gflops_best"] >= t["gflops"]
        if "bf16" in m["results"]:
            assert m["results"]["bf16"]["kernel"].startswith("onednn:")
    # The step: 6 N_matmul B T, as zoo bench counts it; each column's rate = FLOPs / time.
    matmul_flops = bench.step_flops(cfg, 2, 16)["matmul"]
    for column in r["columns"]:
        s = r["step"][column]
        assert s["flops"] == matmul_flops
        assert s["gflops"] == pytest.approx(s["flops"] / s["seconds"] / 1e9) and s["gflops"] > 0
    fp32 = {c: r["step"][c]["gflops"] for c in built}
    assert r["fastest_fp32"] == max(fp32, key=fp32.get)
    assert r["default_fp32"] == GEMM["fp32_default"]
    assert r["default_is_fastest"] == (r["default_fp32"] == r["fastest_fp32"])
    assert r["library_after"] == GEMM["fp32_default"]
    assert r["cpu"]["onednn_isa"] == GEMM["onednn_isa"] and r["cpu"]["bf16_native"] == GEMM["bf16_native"]
    # The table: its header names every column; one line per shape and product.
    header = next(line for line in stdout.splitlines() if line.startswith("| layer |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    for lib in built:
        assert lib in cells
    assert any(c.startswith("bf16") for c in cells) == bf16_expected
    assert ("bf16 kernel" in cells) == bf16_expected
    table = [line for line in stdout.splitlines() if line.startswith("| ") and " -> " in line and line != header]
    assert len(table) == len(r["measurements"])
    assert f"fastest fp32 library: {r['fastest_fp32']}" in stdout
    assert f"zoo's default here: {GEMM['fp32_default']} (" in stdout
    assert ("(agrees)" in stdout) == r["default_is_fastest"]
    assert f"oneDNN ISA: {GEMM['onednn_isa'] or 'none'}" in stdout


def test_the_command_prints_its_table_and_writes_json(tmp_path):
    out = tmp_path / "gemm.json"
    run = subprocess.run([sys.executable, "-m", "zoo.tools.bench_gemm", *TINY, "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    check_result(json.loads(out.read_text()), run.stdout)


def test_in_process_it_leaves_the_default_library_and_threads(tmp_path, capsys):
    threads = zoo.get_threads()
    others = [lib for lib in GEMM["built_in"] if lib != GEMM["fp32_default"]]
    if others:  # start from a library other than the default: the tool must set it back
        zoo.set_gemm_library(others[0])
    try:
        out = tmp_path / "gemm.json"
        assert bench_gemm.main([*TINY, "--bf16-emulated", "--json", str(out)]) == 0
        assert zoo.gemm_info()["fp32"] == GEMM["fp32_default"]
        assert zoo.get_threads() == threads
        check_result(json.loads(out.read_text()), capsys.readouterr().out, emulated_asked=True)
    finally:
        zoo.set_gemm_library("auto")
