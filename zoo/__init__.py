"""zoo: GPT-2 and Llama from declarative configs, native C++ blocks, fast CPU finetuning."""

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
    """How the native core was built (compiler, BLAS, OpenMP, AD backends)."""
    return dict(_native.build_info())


__all__ = ["Model", "ModelConfig", "RopeScaling", "PRESETS", "preset", "set_threads", "get_threads",
           "build_info"]

# OMP_NUM_THREADS (or OpenMP's default) decides; the BLAS follows the same count.
_native.set_threads(_native.get_threads())
