"""Every CPU class zoo runs on, on this machine: zoo's own vector paths (rounding to bf16, widening
a stored int8/nf4/bf16 matrix; native/kernels/isa.hpp) each against the scalar path, and each
class of x86 CPU forced through DNNL_MAX_CPU_ISA (AVX2, AVX-512 without bf16, AVX512_BF16, AMX
where the CPU has it), checking the path and the kernels it picks and its products' results
within the bounds of its precision."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import zoo
from zoo.core.native import _native

GEMM = zoo.gemm_info()
PATHS = ["scalar", "avx2", "avx512", "avx512_bf16"]
CPU_PATHS = PATHS[: PATHS.index(GEMM["cpu_vector_isa"]) + 1]


@pytest.fixture
def vector_path():
    """Sets a vector path for the test, and the default back after it."""
    yield _native.set_vector_isa
    _native.set_vector_isa("auto")


def _rounding_inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    # 1,003 values: 62 groups of 16 and a tail of 11. Normal values across exponents, exact ties
    # (odd and even: round to even), the largest finite values (rounding up to inf), infinities,
    # NaNs with a payload only in the low bits (which a carry would turn into inf), zeros.
    x = (rng.standard_normal(1003) * np.exp2(rng.integers(-60, 60, 1003))).astype(np.float32)
    bits = x.view(np.uint32)
    bits[:40] = (bits[:40] & 0xFFFF0000) | 0x8000  # halfway between two bf16 values
    x[40:44] = [np.inf, -np.inf, 3.4028235e38, -3.4028235e38]
    bits[44:48] = [0x7F800001, 0xFF800001, 0x7FC00000, 0x7F80FFFF]
    x[48:50] = [0.0, -0.0]
    bits[1000:] = 0x7F800001  # a NaN in the scalar tail too
    return x


@pytest.mark.parametrize("path", CPU_PATHS)
def test_every_vector_path_rounds_to_bf16_as_the_scalar_one(path, vector_path):
    x = _rounding_inputs()
    vector_path("scalar")
    want = _native.round_bf16(x)
    # The scalar rule itself: round to nearest even, a NaN stays a (quiet) NaN.
    finite = np.isfinite(x)
    u = x.view(np.uint32).astype(np.uint64)
    assert np.array_equal(want[finite], ((u + 0x7FFF + ((u >> 16) & 1)) >> 16)[finite].astype(np.uint16))
    nan = np.isnan(x)
    assert ((want[nan] & 0x7F80) == 0x7F80).all() and ((want[nan] & 0x7F) != 0).all()
    vector_path(path)
    assert _native.round_bf16(x).tobytes() == want.tobytes(), path
    # Denormals: AVX512_BF16's instruction flushes them to zero; the other paths round them.
    tiny = np.full(37, 1e-39, np.float32)
    got = _native.round_bf16(tiny)
    expect_zero = path == "avx512_bf16"
    assert (got[:32] == 0).all() == expect_zero and (got[32:] != 0).all()


# Shapes whose rows end in a tail no vector covers (7 and 11 columns after the last 16 or 8),
# a row shorter than one vector, and nf4 rows of one and a half blocks.
@pytest.mark.parametrize("cols", [203, 96, 5, 1])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "nf4"])
@pytest.mark.parametrize("path", CPU_PATHS)
def test_every_vector_path_widens_as_the_scalar_one(path, fmt, cols, vector_path):
    rng = np.random.default_rng(cols)
    w = (0.05 * rng.standard_normal((9, cols))).astype(np.float32)
    w[0, : min(cols, 3)] = 0.0  # zero rows and blocks (scale 0)
    vector_path("scalar")
    want32, want16 = _native.widen(w, fmt), _native.widen(w, fmt, to_bf16=True)
    vector_path(path)
    got32, got16 = _native.widen(w, fmt), _native.widen(w, fmt, to_bf16=True)
    assert got32.tobytes() == want32.tobytes(), (path, fmt, cols)
    assert got16.tobytes() == want16.tobytes(), (path, fmt, cols)
    # And the scalar path is the format's rule: within its stated error of the values stored.
    bound = {"bf16": 2.0**-8 * np.abs(w), "int8": np.abs(w).max(1, keepdims=True) / 254 + 1e-9,
             "nf4": 0.153 * np.abs(w).max(1, keepdims=True) + 1e-9}[fmt]
    assert (np.abs(want32 - w) <= bound).all()


def test_a_path_the_cpu_lacks_or_an_unknown_one_is_refused(vector_path):
    with pytest.raises(ValueError, match="vector path 'sse9' is unknown"):
        vector_path("sse9")
    for path in PATHS[len(CPU_PATHS):]:
        with pytest.raises(ValueError, match=f"vector path '{path}' needs instructions this CPU lacks"):
            vector_path(path)


@pytest.mark.parametrize("cls,path", [("SSE41", "scalar"), ("AVX2", "avx2"), ("AVX512_CORE", "avx512"),
                                      ("AVX512_CORE_BF16", "avx512_bf16")])
def test_the_vector_path_follows_the_class_forced(cls, path):
    # With or without oneDNN in the build: DNNL_MAX_CPU_ISA lowers zoo's own paths as oneDNN's.
    want = PATHS[min(PATHS.index(path), PATHS.index(GEMM["cpu_vector_isa"]))]
    r = subprocess.run([sys.executable, "-c", "import zoo; print(zoo.gemm_info()['vector_isa'])"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, DNNL_MAX_CPU_ISA=cls))
    assert r.returncode == 0 and r.stdout.strip() == want, (cls, r.stdout, r.stderr)


# --- each CPU class, forced -----------------------------------------------------------------

# What zoo should do in each class: oneDNN's ISA name, zoo's vector path, whether bf16 products
# run (and on which kernel), and the precision a LoRA run over a stored base takes by default.
CLASSES = {
    "AVX2": dict(onednn_isa="avx2", vector_isa="avx2", bf16=None, openblas="Haswell"),
    "AVX512_CORE": dict(onednn_isa="avx512_core", vector_isa="avx512", bf16=None, openblas="SkylakeX"),
    "AVX512_CORE_BF16": dict(onednn_isa="avx512_core_bf16", vector_isa="avx512_bf16",
                             bf16="brg:avx512_core_bf16 (operands rounded by zoo)"),
    "AVX512_CORE_AMX": dict(onednn_isa="avx512_core_amx", vector_isa="avx512_bf16", bf16="amx"),
}
ORDER = ["AVX2", "AVX512_CORE", "AVX512_CORE_BF16", "AVX512_CORE_AMX"]
# The classes this CPU can be lowered to: up to its own (oneDNN's ISA here).
RANK = {"avx2": 0, "avx2_vnni": 0, "avx2_vnni_2": 0, "avx512_core": 1, "avx512_core_vnni": 1,
        "avx512_core_bf16": 2, "avx512_core_fp16": 2, "avx512_core_amx": 3, "avx512_core_amx_fp16": 3}
REACHABLE = ORDER[: RANK.get(GEMM["onednn_isa"], -1) + 1]

# Run in a fresh process (DNNL_MAX_CPU_ISA is read once, when oneDNN starts): the class's
# choices, the kernels of a GPT-2-sized layer's three products in each precision it runs, and
# the products' errors against fp64, in a stored base too.
PROBE = r"""
import json, numpy as np, zoo
from zoo.core.native import _native
g = zoo.gemm_info()
out = {k: g[k] for k in ("onednn_isa", "vector_isa", "bf16_native", "openblas_core")}
rng = np.random.default_rng(0)
x = rng.standard_normal((256, 768), dtype=np.float32)
w = (0.05 * rng.standard_normal((2304, 768))).astype(np.float32)
dy = rng.standard_normal((256, 2304), dtype=np.float32)
products = {"forward": (x, w, False, True), "dx": (dy, w, False, False), "dW": (dy, x, True, False)}
precisions = ["fp32"] + (["bf16"] if g["bf16_native"] else [])
out["kernels"], out["errors"] = {}, {}
for p in precisions:
    for name, (a, b, ta, tb) in products.items():
        M, K = (a.shape[1], a.shape[0]) if ta else a.shape
        N = b.shape[0] if tb else b.shape[1]
        out["kernels"][p + " " + name] = _native.gemm_kernel(p, ta, tb, M, N, K)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        exact = (a64.T if ta else a64) @ (b64.T if tb else b64)
        got = _native.gemm(a, b, ta, tb, p).astype(np.float64)
        out["errors"][p + " " + name] = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
from zoo.arch.lora import default_precision
for fmt in ("int8", "nf4"):
    p = default_precision(fmt)
    y, _ = _native.stored_matrix_product(x, w, fmt, p, False, 1)
    widened = _native.widen(w, fmt).astype(np.float64)
    out["errors"][fmt + " base, " + p] = float(np.linalg.norm(y - x.astype(np.float64) @ widened.T)
                                                / np.linalg.norm(x.astype(np.float64) @ widened.T))
if not g["bf16_native"]:  # asked anyway (bench_gemm --bf16-emulated): oneDNN's fp32 kernels run it
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    got = _native.gemm(x, w, False, True, "bf16", allow_emulated=True)
    out["emulated"] = [float(np.linalg.norm(got - exact) / np.linalg.norm(exact)),
                       _native.gemm_kernel("bf16", False, True, 256, 2304, 768)]
try:
    zoo.Model(zoo.preset("tiny-gpt2"), precision="bf16")
    out["bf16_model"] = "made"
except zoo.core.gemm.PrecisionError as e:
    out["bf16_model"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.skipif(not GEMM["onednn_isa"], reason="no oneDNN in this build: DNNL_MAX_CPU_ISA forces nothing")
@pytest.mark.parametrize("cls", ORDER)
def test_each_cpu_class_forced_picks_its_kernels_and_stays_within_its_bounds(cls):
    if cls not in REACHABLE:
        pytest.skip(f"this CPU ({GEMM['onednn_isa']}) cannot run as {cls}")
    want = CLASSES[cls]
    # OpenBLAS's kernels follow the class unless the environment names its own (OPENBLAS_CORETYPE).
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                       env=dict(env, DNNL_MAX_CPU_ISA=cls))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["onednn_isa"] == want["onednn_isa"] and got["vector_isa"] == want["vector_isa"]
    assert got["bf16_native"] == (want["bf16"] is not None)
    if "openblas" in want:  # zoo/core/native.py forces OpenBLAS's kernels to the class too
        assert got["openblas_core"] == want["openblas"], got["openblas_core"]
    for name, kernel in got["kernels"].items():
        if name.startswith("fp32"):
            assert kernel == GEMM["fp32_default"], (cls, name, kernel)  # fp32 stays on its library
        else:
            assert kernel.startswith("onednn:") and want["bf16"] in kernel, (cls, name, kernel)
    for name, err in got["errors"].items():
        if name.startswith("fp32") or name.endswith("fp32"):
            assert err < 1e-5, (cls, name, err)  # fp32 products (over the widened base too)
        else:
            # bf16 operands: each rounded (2^-9 relative), a relative error of a few 1e-3, and
            # never fp32's, which would mean the products quietly ran unrounded.
            assert 1e-4 < err < 1e-2, (cls, name, err)
    if want["bf16"] is None:
        err, kernel = got["emulated"]
        assert err < 1e-5 and not _native.is_bf16_kernel(kernel), (cls, err, kernel)
        assert "needs a CPU with bf16 dot products" in got["bf16_model"]
        assert f"instruction set here: {want['onednn_isa']}" in got["bf16_model"]
    else:
        assert got["bf16_model"] == "made"
