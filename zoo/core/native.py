"""Imports the compiled core. Its GEMM libraries come from wheels (CMakeLists.txt): OpenBLAS
from scipy-openblas32, oneDNN from onednn-cpu-gomp on x86_64, oneMKL from mkl where it was
installed at build time. The extension finds them through its run path; should one not be
found there (a build moved elsewhere), it is loaded first, globally, from its wheel."""

import ctypes
import fnmatch
import numbers
import os
import sysconfig
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, distribution

# OpenMP threads that spin at barriers steal the cores OpenBLAS's workers (and anything else
# running) need: on a 2-core machine a step ran 1.6x slower with spinning (OpenBLAS), and tiny
# models 40x slower next to a busy process. Sleeping waits cost a few microseconds per
# parallel loop. Must be set before the OpenMP runtime starts; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Likewise OpenBLAS's workers spin for 2^28 cycles after each GEMM by default, competing with
# the OpenMP loops that follow: 2^4 cycles made a GPT-2 step about 10% faster here.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
# A CPU class forced for oneDNN and zoo's own vector code (DNNL_MAX_CPU_ISA, docs/benchmarks.md)
# forces OpenBLAS's kernels too, unless OPENBLAS_CORETYPE says otherwise: AVX2 and AVX-512
# without bf16 then run fp32 products on the kernels such a CPU would (OpenBLAS picks its own
# from CPUID otherwise, AVX-512 ones on any AVX-512 machine).
_OPENBLAS_CORE_OF_CLASS = {"AVX2": "Haswell", "AVX2_VNNI": "Haswell", "AVX512_CORE": "SkylakeX",
                           "AVX512_CORE_VNNI": "SkylakeX"}
if os.environ.get("DNNL_MAX_CPU_ISA", "").upper() in _OPENBLAS_CORE_OF_CLASS:
    os.environ.setdefault("OPENBLAS_CORETYPE", _OPENBLAS_CORE_OF_CLASS[os.environ["DNNL_MAX_CPU_ISA"].upper()])

# The libraries the extension may miss, by the wheel that ships each.
_WHEEL_LIBRARIES = {"libscipy_openblas": "scipy-openblas32", "libdnnl": "onednn-cpu-gomp",
                    "libmkl_": "mkl"}


def _load_from_wheel(missing: str) -> bool:
    """Loads, globally, every library of the wheel that ships `missing` (a name prefix)."""
    dist = next(d for prefix, d in _WHEEL_LIBRARIES.items() if missing.startswith(prefix))
    try:
        files = [f for f in distribution(dist).files or [] if fnmatch.fnmatch(f.name, missing + "*.so*")]
    except PackageNotFoundError:
        return False
    for f in files:
        ctypes.CDLL(str(f.locate()), mode=ctypes.RTLD_GLOBAL)
    return bool(files)


def _unbuilt_core_error(e: ImportError):
    """The error for a zoo/ folder without a compiled core this Python can load: a source checkout
    never built in place, whose zoo/ shadows an installed zoo when Python runs in it, or a core
    built for another Python. None where the folder holds this Python's core (whose import
    failed for another reason, which e says)."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = "_native" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    found = sorted(f for f in os.listdir(here) if f.startswith("_native.") and f.endswith((".so", ".pyd")))
    if ours in found:
        return None
    why = (f"it holds {', '.join(found)}, built for another Python (this one loads {ours})" if found
           else "this copy of zoo was never built")
    return ImportError(f"zoo: no compiled core in {here}: {why}. In a checkout, build it in place with "
                       f"`make setup` (or `pip install -e .`); to use a zoo installed elsewhere, run Python "
                       f"outside the checkout, whose zoo/ folder comes first on the path ({e})")


for _attempt in range(len(_WHEEL_LIBRARIES) + 1):
    try:
        from . import _native

        break
    except ImportError as e:
        missing = next((p for p in _WHEEL_LIBRARIES if p in str(e)), None)
        if missing is None and e.name == __package__ and (unbuilt := _unbuilt_core_error(e)):
            raise unbuilt from None
        if missing is None or _attempt == len(_WHEEL_LIBRARIES) or not _load_from_wheel(
                str(e)[str(e).index(missing):].split(".so")[0]):
            raise


# Far above any machine's cores; below what the native int takes (a larger count would be a
# cast error, not a message).
MAX_THREADS = 4096


def check_threads(n, name: str = "threads") -> int:
    """n as a thread count, an integer in [1, MAX_THREADS]; a ValueError naming `name` (the flag
    or field the count was given as) otherwise."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= MAX_THREADS:
        raise ValueError(f"{name} must be an integer in [1, {MAX_THREADS}], got {n!r}")
    return int(n)


def set_threads(n: int, name: str = "threads") -> None:
    """Threads for zoo's kernels and its BLAS alike (check_threads checks n; name: as there)."""
    _native.set_threads(check_threads(n, name))


def get_threads() -> int:
    return _native.get_threads()


@contextmanager
def threads_set_to(n: int):
    """The block runs at n threads; the count found before is given back after it."""
    before = get_threads()
    set_threads(n)
    try:
        yield
    finally:
        set_threads(before)


__all__ = ["_native", "MAX_THREADS", "check_threads", "get_threads", "set_threads", "threads_set_to"]
