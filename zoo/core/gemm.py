"""The matrix products as Python sees them (native/kernels/gemm.hpp does them): which GEMM library fp32
products run on, whether bf16 products can run here, and the precisions a model may take."""

from __future__ import annotations

import os

from .native import _native

PRECISIONS = ("fp32", "bf16")


class PrecisionError(ValueError):
    """A precision this build of zoo, or this CPU, cannot run well."""


def check_precision(precision: str) -> None:
    """Raises PrecisionError, naming what is missing, if precision cannot run here: bf16 needs
    oneDNN in the build and a CPU with bf16 dot products (docs/training.md)."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision {precision!r} is unknown: choose {' or '.join(PRECISIONS)}")
    try:
        _native.require_precision(precision)
    except RuntimeError as e:
        raise PrecisionError(str(e).removeprefix("zoo: ")) from None


def gemm_info() -> dict:
    """The GEMM libraries: built_in, fp32 (the one fp32 products run on now), fp32_default (the
    measured fastest for this CPU), bf16 (the library bf16 products run on, None without one),
    bf16_native (whether this CPU has bf16 dot products), cpu_vendor and onednn_isa."""
    apply_gemm_environment()
    return dict(_native.gemm_info())


def set_gemm_library(name: str) -> None:
    """The library fp32 products run on in this process: "openblas", "mkl" or "onednn" where
    built in, or "auto" (the measured fastest for this CPU). The environment's ZOO_GEMM sets
    the same at start."""
    try:
        _native.set_gemm_library(name)
    except ValueError as e:
        raise ValueError(str(e).removeprefix("zoo: ")) from None


_gemm_environment_applied = False


def apply_gemm_environment() -> None:
    """Honours ZOO_GEMM once, when the first model is made (an error then names the variable)."""
    global _gemm_environment_applied
    if _gemm_environment_applied:
        return
    name = os.environ.get("ZOO_GEMM", "").strip()
    if name:
        try:
            set_gemm_library(name)
        except ValueError as e:
            raise ValueError(f"ZOO_GEMM={name}: {e}") from None
    _gemm_environment_applied = True
