"""The matrix products as Python sees them (native/kernels/gemm.hpp does them): which GEMM library fp32
products run on, whether bf16 products can run here, and the precisions a model may take."""

from __future__ import annotations

import os
from typing import Optional

from . import blocks
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
    bf16_native (whether this CPU has bf16 dot products), cpu_vendor, onednn_isa, vector_isa
    (zoo's own vector loops) and cpu_vector_isa (the CPU's), openblas_core (OpenBLAS's kernels)
    and openblas_threads (the threads an OpenBLAS product runs on)."""
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


def cpu_fields() -> dict:
    """The first CPU's fields in /proc/cpuinfo ("model name", "vendor_id", "flags", ...; empty
    where there is none: not Linux)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset:
    """The first CPU's flags (x86's "flags", ARM's "Features")."""
    fields = cpu_fields()
    return frozenset(fields.get("flags", fields.get("Features", "")).split())


def bf16_slower_than_fp32(info: Optional[dict] = None, flags: Optional[frozenset] = None) -> bool:
    """Whether this CPU's bf16 products, though it has bf16 dot products, run slower than its fp32
    ones: an Intel core of the Sapphire Rapids generation or later (AVX512-FP16) whose products
    run without AMX, where the system hides AMX (a Linux kernel before 5.16, a virtual machine
    that does not pass it through) or DNNL_MAX_CPU_ISA lowers the class. oneDNN 3.2's AVX512_BF16
    kernels ran GPT-2's products there at 0.62x and 0.47x OpenBLAS's fp32 rate, on two such Xeons
    (docs/benchmarks.md, "What forcing a class shows"). Cooper Lake, the one Intel CPU with
    AVX512_BF16 and without AVX512-FP16, was never measured, and AMD's Zen 4 and 5 run the same
    kernels at two to four times their fp32 rate: both keep bf16."""
    info = gemm_info() if info is None else info
    flags = cpu_flags() if flags is None else flags
    return (bool(info["bf16_native"]) and info["cpu_vendor"] == "GenuineIntel"
            and "amx" not in info["onednn_isa"] and "avx512_fp16" in flags)


# --- which kernels a model's products run on -------------------------------------------------

PRODUCTS = ("forward", "dx", "dW")


def linear_shapes(cfg) -> list[dict]:
    """Every distinct linear layer shape (in, out) of a step, with how many times a step runs
    it; layers of the same shape are merged (their names joined by '+')."""
    gate_width = blocks.activations()[cfg.mlp]["gate_width"]
    layers = [
        ("qkv", cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, cfg.n_layer),
        ("attn_out", cfg.n_head * cfg.head_dim, cfg.d_model, cfg.n_layer),
        ("mlp_in", cfg.d_model, gate_width * cfg.d_ff, cfg.n_layer),
        ("mlp_out", cfg.d_ff, cfg.d_model, cfg.n_layer),
        ("lm_head", cfg.d_model, cfg.vocab_size, 1),
    ]
    shapes: list[dict] = []
    for name, n_in, n_out, count in layers:
        same = [s for s in shapes if s["in"] == n_in and s["out"] == n_out]
        if same:
            same[0]["layer"] += "+" + name
            same[0]["count"] += count
        else:
            shapes.append({"layer": name, "in": n_in, "out": n_out, "count": count})
    return shapes


def product_shape(product: str, rows: int, n_in: int, n_out: int) -> tuple[bool, bool, int, int, int]:
    """(trans_a, trans_b, M, N, K) of a linear layer's product, as native/blocks/linear.hpp runs
    it: forward y = x W^T, dx = dy W, dW += dy^T x."""
    return {"forward": (False, True, rows, n_out, n_in), "dx": (False, False, rows, n_in, n_out),
            "dW": (True, False, n_out, n_in, rows)}[product]


def is_bf16_kernel(kernel: str) -> bool:
    """Whether a kernel name (as _native.gemm_kernel gives it) runs on bf16 dot products: oneDNN's
    AMX, AVX512_BF16 or AVX-NE-CONVERT kernels (gemm.cpp's is_bf16_kernel)."""
    return _native.is_bf16_kernel(kernel)


def product_kernels(cfg, precision: str, rows: int, base_dtype: str = "fp32") -> list[dict]:
    """The kernel each linear layer's products run on in a step of `rows` rows, as the GEMM
    library reports it (oneDNN names the implementation it picks): {layer, product, M, N, K,
    kernel}. A frozen base (base_dtype other than fp32) has no weight-gradient products, and in
    bf16 its products take bf16 operands (stored, or widened to bf16 a tile at a time)."""
    apply_gemm_environment()
    frozen = base_dtype != "fp32"
    out = []
    for s in linear_shapes(cfg):
        for product in PRODUCTS[:2] if frozen else PRODUCTS:
            ta, tb, M, N, K = product_shape(product, rows, s["in"], s["out"])
            kernel = _native.gemm_kernel(precision, ta, tb, M, N, K, bf16_operands=frozen and precision == "bf16")
            out.append({"layer": s["layer"], "product": product, "M": M, "N": N, "K": K, "kernel": kernel})
    return out


def products_report(cfg, precision: str, rows: int, base_dtype: str = "fp32") -> tuple[str, Optional[str]]:
    """What a run's products run on, for its first lines: a summary ("bf16 products on
    onednn:brg:avx512_core_bf16 (operands rounded by zoo)"), and a one-line warning where bf16
    products would run on kernels without bf16 dot products (None where all have them)."""
    kernels = product_kernels(cfg, precision, rows, base_dtype)
    names = sorted({k["kernel"] for k in kernels})
    summary = f"{precision} products on {', '.join(names)}"
    if precision != "bf16":
        return summary, None
    slow = [k for k in kernels if not is_bf16_kernel(k["kernel"])]
    if not slow and bf16_slower_than_fp32():
        return summary, (f"warning: bf16 products here run on oneDNN's AVX512_BF16 kernels of an Intel CPU whose "
                         f"AMX is not in use (oneDNN ISA {gemm_info()['onednn_isa']}), which ran at about half "
                         f"fp32's rate on such Xeons (docs/training.md): --precision fp32 is faster here")
    if not slow:
        return summary, None
    first = slow[0]
    return summary, (f"warning: {len(slow)} of the {len(kernels)} bf16 products of a step run on kernels "
                     f"without bf16 dot products ({', '.join(sorted({k['kernel'] for k in slow}))}; e.g. "
                     f"{first['layer']} {first['product']} {first['M']}x{first['N']}x{first['K']}): "
                     f"rounded to bf16, they run no faster than fp32 here")
