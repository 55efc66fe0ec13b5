"""Imports the compiled core. Its BLAS is oneMKL from the mkl wheel, or OpenBLAS from the
scipy-openblas32 wheel (CMakeLists.txt chooses): the extension finds either through its
run path; should OpenBLAS not be found there (a build moved elsewhere), it is loaded first,
globally, from its package."""

import ctypes
import os

# OpenMP threads that spin at barriers steal the cores OpenBLAS's workers (and anything else
# running) need: on a 2-core machine a step ran 1.6x slower with spinning (OpenBLAS), and tiny
# models 40x slower next to a busy process. Sleeping waits cost a few microseconds per
# parallel loop. Must be set before the OpenMP runtime starts; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Likewise OpenBLAS's workers spin for 2^28 cycles after each GEMM by default, competing with
# the OpenMP loops that follow: 2^4 cycles made a GPT-2 step about 10% faster here.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

try:
    from . import _native
except ImportError as e:
    if "libscipy_openblas" not in str(e):
        raise
    import scipy_openblas32

    ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so"), mode=ctypes.RTLD_GLOBAL)
    from . import _native

__all__ = ["_native"]
