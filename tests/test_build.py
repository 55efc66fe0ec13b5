"""The native build's BLAS: oneMKL where the mkl wheels are installed, else OpenBLAS."""

import os
import platform
from importlib.metadata import PackageNotFoundError, distribution

import numpy as np

import zoo
from zoo._load_native import _native


def _installed(dist: str) -> bool:
    try:
        distribution(dist)
        return True
    except PackageNotFoundError:
        return False


def test_the_build_links_mkl_where_its_wheels_are_installed():
    # CMakeLists.txt picks oneMKL when the mkl and mkl-include wheels are there (x86_64) unless
    # ZOO_BLAS=openblas; falling back without a word would cost the GEMMs 7-10%.
    blas = zoo.build_info()["blas"]
    assert blas in ("mkl", "scipy-openblas32")
    if os.environ.get("ZOO_BLAS") == "openblas":
        assert blas == "scipy-openblas32"
    elif platform.machine() == "x86_64" and _installed("mkl") and _installed("mkl-include"):
        assert blas == "mkl"


def test_gemm_gives_the_same_product_at_every_thread_count():
    # zoo.set_threads reaches the BLAS (MKL runs on zoo's OpenMP threads): the product must
    # not depend on how many there are, beyond rounding
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 200), dtype=np.float32)
    w = rng.standard_normal((500, 200), dtype=np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    n = zoo.get_threads()
    try:
        for threads in (1, 2):
            zoo.set_threads(threads)
            assert zoo.get_threads() == threads
            got = _native.blocks.linear_forward(x, w, None)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    finally:
        zoo.set_threads(n)
