"""Imports the compiled core. OpenBLAS comes from the scipy-openblas32 wheel: it is loaded
first, globally, so the extension finds it wherever the package was built or installed."""

import ctypes
import os

# OpenMP threads that spin at barriers steal the cores OpenBLAS (and anything else running)
# needs: on a 2-core machine a step ran 1.6x slower with spinning, and tiny models 40x
# slower next to a busy process. Sleeping waits cost a few microseconds per parallel loop.
# Must be set before the OpenMP runtime starts; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Likewise OpenBLAS's workers spin for 2^28 cycles after each GEMM by default, competing with
# the OpenMP loops that follow: 2^4 cycles made a GPT-2 step about 10% faster here.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import scipy_openblas32

ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so"), mode=ctypes.RTLD_GLOBAL)

from . import _native  # noqa: E402

__all__ = ["_native"]
