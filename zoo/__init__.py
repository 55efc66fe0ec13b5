"""zoo: GPT-2 and Llama from declarative configs, native C++ blocks, fast CPU finetuning."""

from .arch.config import ModelConfig
from .arch.lora import LoraConfig
from .arch.presets import PRESETS, preset
from .core.gemm import gemm_info, set_gemm_library
from .core.native import _native, get_threads, set_threads
from .core.rope import RopeScaling
from .model import Model
from .text.tokenizers import Tokenizer

__version__ = "0.1.0"


def build_info() -> dict:
    """How the native core was built (compiler, OpenMP, AD backends, the registry) and its GEMM
    libraries: `gemm` says which ones are built in, which one fp32 products run on now, whether
    bf16 products can run, and the CPU as they see it."""
    info = dict(_native.build_info())
    info["gemm"] = gemm_info()
    return info


__all__ = ["Model", "ModelConfig", "LoraConfig", "RopeScaling", "Tokenizer", "PRESETS", "preset", "set_threads", "get_threads",
           "build_info", "gemm_info", "set_gemm_library"]

# OMP_NUM_THREADS (or OpenMP's default) decides; the BLAS follows the same count.
_native.set_threads(_native.get_threads())
