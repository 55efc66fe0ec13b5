"""Imports the compiled core. OpenBLAS comes from the scipy-openblas32 wheel: it is loaded
first, globally, so the extension finds it wherever the package was built or installed."""

import ctypes
import os

import scipy_openblas32

ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so"), mode=ctypes.RTLD_GLOBAL)

from . import _native  # noqa: E402

__all__ = ["_native"]
