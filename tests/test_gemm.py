"""The GEMM libraries (native/kernels/gemm.hpp): which are built in and chosen, each one's products in
every shape class a linear layer makes, bf16 products against an fp64 reference within the
bound bf16 rounding predicts, and the refusal where a CPU has no bf16 dot products."""

import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution

import numpy as np
import pytest

import zoo
from zoo.core.gemm import PrecisionError
from zoo.core.native import _native

GEMM = zoo.gemm_info()
BF16 = GEMM["bf16_native"]
needs_bf16 = pytest.mark.skipif(not BF16, reason=f"no bf16 dot products here (oneDNN ISA {GEMM['onednn_isa']!r})")


def _installed(dist: str) -> bool:
    try:
        distribution(dist)
        return True
    except PackageNotFoundError:
        return False


# The three products of a linear layer y = x W^T, W stored (out, in), x (N, in), as stored:
# (A, B, trans_a, trans_b). N = 256 rows as in a GPT-2 step of 4 x 64, widths of its layers.
def products(rng, N=256, d_in=192, d_out=320):
    x = rng.standard_normal((N, d_in), dtype=np.float32)
    W = (0.05 * rng.standard_normal((d_out, d_in))).astype(np.float32)
    dy = rng.standard_normal((N, d_out), dtype=np.float32)
    return {
        "forward x W^T": (x, W, False, True),
        "input gradient dy W": (dy, W, False, False),
        "weight gradient dy^T x": (dy, x, True, False),
        "both transposed": (x.T.copy(), W, True, True),
    }


def reference(a, b, ta, tb):
    a = a.astype(np.float64).T if ta else a.astype(np.float64)
    b = b.astype(np.float64).T if tb else b.astype(np.float64)
    return a @ b, np.abs(a) @ np.abs(b)


def test_the_libraries_built_in_follow_the_wheels_installed():
    built = GEMM["built_in"]
    assert "openblas" in built  # always: the fp32 fallback everywhere
    if platform.machine() == "x86_64" and _installed("onednn-devel-cpu-gomp"):
        assert "onednn" in built and GEMM["bf16"] == "onednn"
    if _installed("mkl"):
        assert "mkl" in built
    # The default for this CPU: oneMKL on Intel where built in (0-10% faster there), OpenBLAS
    # elsewhere (oneMKL runs 20-40% slower on AMD EPYC); docs/benchmarks.md.
    want = "mkl" if "mkl" in built and GEMM["cpu_vendor"] == "GenuineIntel" else "openblas"
    assert GEMM["fp32_default"] == want
    assert zoo.build_info()["gemm"]["fp32"] in built


@pytest.mark.parametrize("library", GEMM["built_in"])
def test_every_fp32_library_computes_every_product_class(library):
    rng = np.random.default_rng(0)
    try:
        zoo.set_gemm_library(library)
        assert zoo.gemm_info()["fp32"] == library
        for what, (a, b, ta, tb) in products(rng).items():
            want, _ = reference(a, b, ta, tb)
            got = _native.gemm(a, b, ta, tb, "fp32")
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{library}: {what}")
            # Accumulating (beta 1), as the weight-gradient products do.
            c = np.ones_like(got)
            np.testing.assert_allclose(_native.gemm(a, b, ta, tb, "fp32", c), want + 1, rtol=1e-4, atol=1e-4)
    finally:
        zoo.set_gemm_library("auto")
    assert zoo.gemm_info()["fp32"] == GEMM["fp32_default"]


@needs_bf16
def test_bf16_products_are_within_the_bound_bf16_rounding_predicts():
    # Each operand rounded to bf16 (relative error <= 2^-9 each), products exact in fp32, sums
    # in fp32 over K terms: |C - exact| <= (2 * 2^-9 + 2^-18 + K * 2^-24) * (|A||B|). The bound
    # is an elementwise one; the products must also show bf16's error (far above fp32's), so a
    # library that quietly ran them in fp32 fails too.
    rng = np.random.default_rng(1)
    for what, (a, b, ta, tb) in products(rng).items():
        exact, magnitude = reference(a, b, ta, tb)
        K = a.shape[0] if ta else a.shape[1]
        got = _native.gemm(a, b, ta, tb, "bf16").astype(np.float64)
        bound = (2 * 2.0**-9 + 2.0**-18 + K * 2.0**-24) * magnitude
        err = np.abs(got - exact)
        assert (err <= bound).all(), f"{what}: error {np.max(err / bound):.2f}x the bf16 bound"
        rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert 1e-4 < rel < 1e-2, f"{what}: relative error {rel:.1e} is not bf16's"
        c = np.full(got.shape, 0.5, np.float32)  # accumulating into C
        added = _native.gemm(a, b, ta, tb, "bf16", c).astype(np.float64)
        assert (np.abs(added - 0.5 - exact) <= bound + 1e-6).all(), what


@needs_bf16
@pytest.mark.parametrize("M,N,K", [(64, 20000, 768), (20000, 96, 256), (140, 140, 16384), (24, 40, 70000)])
def test_bf16_products_larger_than_the_rounding_buffer_stay_within_the_bound(M, N, K):
    # Where zoo rounds the operands itself (oneDNN's fpmath mode has no bf16 kernel here), it
    # rounds them in panels of a 4M-value buffer: here one operand whole and the other in
    # blocks of columns or rows, both in blocks, and K in blocks summed into C. (Elsewhere these
    # are plain oneDNN products, held to the same bound.)
    rng = np.random.default_rng(M)
    for ta, tb in ((False, True), (True, False), (False, False), (True, True)):
        a = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32)
        b = rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
        exact, magnitude = reference(a, b, ta, tb)
        c = np.full((M, N), 0.25, np.float32)
        got = _native.gemm(a, b, ta, tb, "bf16", c).astype(np.float64) - 0.25
        bound = (2 * 2.0**-9 + 2.0**-18 + K * 2.0**-24) * magnitude + 1e-6
        assert (np.abs(got - exact) <= bound).all(), (ta, tb, np.max(np.abs(got - exact) / bound))
        rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert 1e-4 < rel < 1e-2, (ta, tb, rel)


@needs_bf16
def test_bf16_products_run_on_the_cpus_bf16_kernels():
    # Training shapes (GPT-2's qkv, a tiny test model's), and generation's one-row LM head
    # (whose weight-gradient product, a sum over one row, oneDNN runs in fp32: generation has none).
    for N, d_in, d_out in ((256, 768, 2304), (60, 48, 144), (1, 768, 50257)):
        for ta, tb, M, N_, K in ((False, True, N, d_out, d_in), (False, False, N, d_in, d_out),
                                 (True, False, d_out, d_in, N))[:3 if N > 1 else 2]:
            kernel = _native.gemm_kernel("bf16", ta, tb, M, N_, K)
            assert "amx" in kernel or "bf16" in kernel or "vnni_2" in kernel, (M, N_, K, kernel)


def test_an_unknown_or_missing_library_is_refused_by_name():
    with pytest.raises(ValueError, match="GEMM library 'blis' is unknown.*built in: openblas"):
        zoo.set_gemm_library("blis")
    for lib in ("mkl", "onednn"):
        if lib not in GEMM["built_in"]:
            with pytest.raises(ValueError, match=f"GEMM library '{lib}' is not built into this zoo"):
                zoo.set_gemm_library(lib)
    assert zoo.gemm_info()["fp32"] == GEMM["fp32"]


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


def test_zoo_gemm_in_the_environment_chooses_the_library():
    lib = GEMM["built_in"][-1]
    r = _run("import zoo; m = zoo.Model(zoo.preset('tiny-gpt2')); print(zoo.gemm_info()['fp32'])", ZOO_GEMM=lib)
    assert r.returncode == 0 and r.stdout.strip() == lib, r.stderr
    r = _run("import zoo; zoo.Model(zoo.preset('tiny-gpt2'))", ZOO_GEMM="blis")
    assert r.returncode != 0 and "ZOO_GEMM=blis: GEMM library 'blis' is unknown" in r.stderr


def test_bf16_without_bf16_dot_products_is_refused_with_the_reason(tmp_path):
    # DNNL_MAX_CPU_ISA hides the CPU's bf16 instructions from oneDNN: the path of a CPU without them.
    code = ("import zoo\n"
            "try:\n    zoo.Model(zoo.preset('tiny-gpt2'), precision='bf16')\n"
            "except zoo.core.gemm.PrecisionError as e:\n    print(e)\n")
    r = _run(code, DNNL_MAX_CPU_ISA="AVX2")
    assert r.returncode == 0, r.stderr
    if GEMM["bf16"] is None:
        assert "needs oneDNN" in r.stdout
    else:
        assert "needs a CPU with bf16 dot products (AVX512_BF16 or AMX-BF16" in r.stdout
        assert "instruction set here: avx2" in r.stdout and "Use precision fp32" in r.stdout
    # The command line: one line, no traceback, before any weights or data are read.
    r = subprocess.run([sys.executable, "-m", "zoo.cli", "train", "--preset", "tiny-gpt2", "--steps", "2",
                        "--out", "unused-run", "--precision", "bf16"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, DNNL_MAX_CPU_ISA="AVX2"), cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "zoo: error: settings: precision (--precision): precision bf16 needs" in r.stderr
    assert not (tmp_path / "unused-run").exists()


def test_an_unknown_precision_is_refused():
    with pytest.raises(PrecisionError, match="precision 'fp8' is unknown: choose fp32 or bf16"):
        zoo.Model(zoo.preset("tiny-gpt2"), precision="fp8")


def test_the_products_report_names_each_kernel_and_warns_of_bf16_products_without_bf16_kernels(monkeypatch):
    from zoo.core import gemm

    cfg = zoo.preset("tiny-gpt2")
    kernels = gemm.product_kernels(cfg, "fp32", 64)
    # Every linear layer's three products (a frozen base: forward and dx only), each named.
    assert [(k["layer"], k["product"]) for k in kernels] == [
        (s["layer"], p) for s in gemm.linear_shapes(cfg) for p in ("forward", "dx", "dW")]
    assert {k["kernel"] for k in kernels} == {_native.gemm_kernel("fp32", False, True, 64, 64, 64)}
    n_shapes = len(gemm.linear_shapes(cfg))
    assert [k["product"] for k in gemm.product_kernels(cfg, "fp32", 64, "int8")] == ["forward", "dx"] * n_shapes
    summary, warning = gemm.products_report(cfg, "fp32", 64)
    assert summary == f"fp32 products on {GEMM['fp32']}" and warning is None
    if BF16:
        summary, warning = gemm.products_report(cfg, "bf16", 64)
        assert summary.startswith("bf16 products on onednn:")
        assert (warning is None) != gemm.bf16_slower_than_fp32()  # the class of the next test
    # A CPU where oneDNN gives some bf16 products an fp32 kernel: one line says so.
    slow = {(False, True, 64, 320, 64): "onednn:brg:avx512_core"}
    monkeypatch.setattr(_native, "gemm_kernel", lambda p, ta, tb, M, N, K, bf16_operands=False:
                        slow.get((ta, tb, M, N, K), "onednn:brg:avx512_core_amx"))
    monkeypatch.setattr(_native, "is_bf16_kernel", lambda k: "amx" in k)
    summary, warning = gemm.products_report(cfg, "bf16", 64)
    assert summary == "bf16 products on onednn:brg:avx512_core, onednn:brg:avx512_core_amx"
    assert warning == (f"warning: 1 of the {3 * n_shapes} bf16 products of a step run on kernels without bf16 dot products "
                       "(onednn:brg:avx512_core; e.g. lm_head forward 64x320x64): rounded to bf16, they run no "
                       "faster than fp32 here")


def test_an_intel_cpu_without_amx_in_use_keeps_lora_in_fp32_and_warns_of_bf16(monkeypatch):
    """Sapphire Rapids and later with AMX hidden or forced off: their AVX512_BF16 kernels ran at
    about half fp32's rate (docs/benchmarks.md), so LoRA's default is fp32 there and an explicit
    bf16 run is told. Cooper Lake (no AVX512-FP16) and AMD keep bf16; AMX in use is the fast class."""
    from zoo.arch import lora
    from zoo.core import gemm

    spr = {"bf16_native": True, "cpu_vendor": "GenuineIntel", "onednn_isa": "avx512_core_fp16"}
    spr_flags = frozenset({"avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"})
    assert gemm.bf16_slower_than_fp32(spr, spr_flags)
    assert gemm.bf16_slower_than_fp32({**spr, "onednn_isa": "avx512_core_bf16"}, spr_flags)  # DNNL_MAX_CPU_ISA
    assert not gemm.bf16_slower_than_fp32({**spr, "onednn_isa": "avx512_core_amx"}, spr_flags)
    assert not gemm.bf16_slower_than_fp32({**spr, "onednn_isa": "avx512_core_bf16"}, frozenset({"avx512_bf16"}))
    assert not gemm.bf16_slower_than_fp32({**spr, "cpu_vendor": "AuthenticAMD"}, spr_flags)
    assert not gemm.bf16_slower_than_fp32({**spr, "bf16_native": False}, spr_flags)

    monkeypatch.setattr(lora, "gemm_info", lambda: {"bf16_native": True})
    for slower, want in ((False, "bf16"), (True, "fp32")):
        monkeypatch.setattr(lora, "bf16_slower_than_fp32", lambda: slower)
        assert [lora.default_precision(b) for b in ("bf16", "int8", "nf4", "fp32")] == [want] * 3 + ["fp32"]

    monkeypatch.setattr(_native, "gemm_kernel", lambda *a, **k: "onednn:brg:avx512_core_bf16")
    monkeypatch.setattr(_native, "is_bf16_kernel", lambda k: True)
    monkeypatch.setattr(gemm, "gemm_info", lambda: spr)
    monkeypatch.setattr(gemm, "cpu_flags", lambda: spr_flags)
    summary, warning = gemm.products_report(zoo.preset("tiny-gpt2"), "bf16", 64)
    assert summary == "bf16 products on onednn:brg:avx512_core_bf16"
    assert warning == ("warning: bf16 products here run on oneDNN's AVX512_BF16 kernels of an Intel CPU whose AMX "
                       "is not in use (oneDNN ISA avx512_core_fp16), which ran at about half fp32's rate on such "
                       "Xeons (docs/training.md): --precision fp32 is faster here")
    monkeypatch.setattr(gemm, "cpu_flags", lambda: frozenset({"avx512_bf16"}))  # Cooper Lake
    assert gemm.products_report(zoo.preset("tiny-gpt2"), "bf16", 64)[1] is None


@needs_bf16
def test_a_product_zoo_rounds_reports_the_kernels_its_panels_ran_on():
    """Too large to round whole (gemm.cpp's 4M-value buffer), an LM-head-like forward runs as
    panels of C's columns; oneDNN 3.2 runs such a panel (C strided) on its gemm, not on the
    brgemm it picks for the whole product, and the report says what ran."""
    M, N, K = 128, 8192, 768
    if "(operands rounded by zoo)" not in _native.gemm_kernel("bf16", False, True, M, N, K):
        pytest.skip("oneDNN's fpmath mode runs bf16 products of fp32 operands here (AMX): zoo rounds nothing")
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((M, K), dtype=np.float32), rng.standard_normal((N, K), dtype=np.float32)
    _native.gemm_kernels_used(reset=True)
    _native.gemm(x, w, False, True, "bf16")
    used = [u for u in _native.gemm_kernels_used() if (u["M"], u["N"], u["K"]) == (M, N, K)]
    assert len(used) == 1 and used[0]["calls"] == 1 and used[0]["bf16_kernel"]
    assert used[0]["kernel"] == "onednn:gemm:jit:bf16 (operands rounded by zoo)"


@needs_bf16
def test_the_kernels_a_process_ran_are_recorded_with_their_calls():
    _native.gemm_kernels_used(reset=True)
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((48, 80), dtype=np.float32), rng.standard_normal((96, 80), dtype=np.float32)
    for _ in range(3):
        _native.gemm(a, b, False, True, "bf16")
    used = [u for u in _native.gemm_kernels_used() if (u["M"], u["N"], u["K"]) == (48, 96, 80)]
    assert len(used) == 1 and used[0]["calls"] == 3 and used[0]["precision"] == "bf16"
    assert used[0]["kernel"] == _native.gemm_kernel("bf16", False, True, 48, 96, 80) and used[0]["bf16_kernel"]
    _native.gemm_kernels_used(reset=True)
    assert not any(u["calls"] for u in _native.gemm_kernels_used())
