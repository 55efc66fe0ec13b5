"""zoo: GPT-2 and Llama from declarative configs, native C++ blocks, fast CPU finetuning."""

import os

from ._load_native import _native
from .config import ModelConfig, RopeScaling
from .model import Model
from .presets import PRESETS, preset

__version__ = "0.1.0"


def set_threads(n: int) -> None:
    """Threads for zoo's kernels and its BLAS alike."""
    _native.set_threads(int(n))


def get_threads() -> int:
    return _native.get_threads()


def build_info() -> dict:
    """How the native core was built (compiler, OpenMP, AD backends, the registry) and its GEMM
    libraries: `gemm` says which ones are built in, which one fp32 products run on now, whether
    bf16 products can run, and the CPU as they see it."""
    info = dict(_native.build_info())
    info["gemm"] = gemm_info()
    return info


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


__all__ = ["Model", "ModelConfig", "RopeScaling", "PRESETS", "preset", "set_threads", "get_threads",
           "build_info", "gemm_info", "set_gemm_library"]

# OMP_NUM_THREADS (or OpenMP's default) decides; the BLAS follows the same count.
_native.set_threads(_native.get_threads())
