"""How much memory finetuning a config takes, from the config alone (no arena is built, so it
works for models far larger than the machine).

Full finetuning keeps everything in float32: parameters, gradients, AdamW's two moments (16
bytes per parameter; under ZeRO-1 each of N processes keeps 1/N of the moments). A LoRA run
keeps its frozen base in its format (bf16, int8, nf4: native/kernels/quant.hpp) and 16 bytes per
adapter parameter (a bf16 base packed for its input gradients, --packed-base, a second copy
of its matrices). Both add the activation arena the native planner lays out for one
micro-batch of batch x seq_len tokens (activation_bytes, the same figure a built model uses).
"""

from __future__ import annotations

import operator
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..core.errors import ResourceError
from ..core.native import _native
from .config import MAX_SEQ_LEN, MAX_TOKENS, ModelConfig
from .layout import frozen_table, num_parameters, parameter_layout
from .lora import LoraConfig, adapter_layout, default_precision, run_setup

FLOAT_BYTES = 4

# Set to 1 to skip the memory checks (check_memory), for users who know better than the estimate.
SKIP_CHECK_ENV = "ZOO_SKIP_MEMORY_CHECK"
# Bytes to take as available instead of measuring: for tests, and for containers whose limits zoo
# cannot see (a limit enforced outside the cgroup files, a VM's balloon).
AVAILABLE_ENV = "ZOO_MEMORY_AVAILABLE"


def check_batch_shape(batch_size: int, seq_len: int, batch_name: str = "batch", seq_name: str = "seq_len") -> None:
    """Raises ValueError, naming both, unless batch_size and seq_len are positive integers whose
    product is within the native core's bound on tokens per micro-batch (config.MAX_TOKENS)."""
    for name, value in ((batch_name, batch_size), (seq_name, seq_len)):
        try:
            positive = operator.index(value) > 0  # ints, numpy's included
        except TypeError:
            positive = False
        if not positive:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    batch_size, seq_len = operator.index(batch_size), operator.index(seq_len)
    if seq_len > MAX_SEQ_LEN:
        raise ValueError(f"{seq_name} {seq_len} is above zoo's bound of {MAX_SEQ_LEN}")
    if batch_size * seq_len > MAX_TOKENS:
        raise ValueError(f"{batch_name} {batch_size} x {seq_name} {seq_len} = {batch_size * seq_len} tokens per "
                         f"micro-batch is above zoo's bound of {MAX_TOKENS}")


def checkpoint_layers(cfg: ModelConfig, checkpointing: bool | int) -> int:
    """The layers activation checkpointing covers, from the first: all or none for a bool, else
    the number given (0 to n_layer; ValueError otherwise)."""
    if isinstance(checkpointing, bool):
        return cfg.n_layer if checkpointing else 0
    if not isinstance(checkpointing, int) or not 0 <= checkpointing <= cfg.n_layer:
        raise ValueError(f"checkpointing={checkpointing!r}: give True, False or a number of layers from 0 to "
                         f"{cfg.n_layer} (the first ones are checkpointed)")
    return checkpointing


def activation_bytes(cfg: ModelConfig, batch_size: int, seq_len: int, checkpointing: bool | int = False,
                     clad_blocks: tuple[str, ...] = (), precision: str = "fp32", setup: Optional[dict] = None) -> int:
    """The activation arena a training step at (batch_size, seq_len) plans, without building a
    model. checkpointing: every layer, none, or the first k (checkpoint_layers). setup: the run's
    (lora.run_setup), for a LoRA run or a frozen base."""
    check_batch_shape(batch_size, seq_len)
    return FLOAT_BYTES * int(_native.activation_floats(setup or cfg.model_dump(), int(batch_size), int(seq_len),
                                                       checkpoint_layers(cfg, checkpointing), list(clad_blocks),
                                                       precision))


def base_bytes(cfg: ModelConfig, base_dtype: str) -> int:
    """Bytes of the model's tensors as a frozen base stores them (matrices in base_dtype, the
    rest in fp32, scales included)."""
    rows, _ = frozen_table(parameter_layout(cfg), base_dtype)
    return sum(int(_native.storage_bytes(fmt, r, c)) for _, _, r, c, fmt in rows)


def packed_base_bytes(cfg: ModelConfig) -> int:
    """Bytes of a bf16 frozen base's packed copy (Model.set_packed_base): the layers' matrices
    and the LM head's, in the layout this CPU's bf16 kernels read (0 where it has none)."""
    rows, _ = frozen_table(parameter_layout(cfg), "bf16")
    return sum(int(_native.packed_matrix_bytes(r, c)) for role, _, r, c, fmt in rows
               if fmt == "bf16" and (role != "wte" or cfg.tied_embeddings))


@dataclass(frozen=True)
class FinetuneMemory:
    parameters: int  # the trainable ones: the model's, or a LoRA run's adapters
    gradients: int
    optimizer: int  # AdamW first and second moments
    activations: int
    base: int = 0  # a LoRA run's frozen base
    packed: int = 0  # its packed copy (packed_base_bytes)

    @property
    def total(self) -> int:
        return self.base + self.packed + self.parameters + self.gradients + self.optimizer + self.activations


def finetune_memory_bytes(cfg: ModelConfig, batch: int, seq_len: int, checkpointing: bool | int = False,
                          precision: str = "fp32", moment_floats: Optional[int] = None,
                          lora: Optional[LoraConfig] = None, base_dtype: Optional[str] = None,
                          zero_ranks: int = 1, packed_base: bool = False) -> FinetuneMemory:
    """Memory for finetuning with AdamW at micro-batch (batch, seq_len): full finetuning, or with
    lora adapters over a frozen base in base_dtype (default bf16); checkpointing: with activation
    checkpointing (each layer recomputed in the pullback; an int: the first k layers); precision: of the products (a bf16
    step keeps some activations in bf16); moment_floats: the parameters whose AdamW moments this
    process keeps (default all; a ZeRO-1 shard), or zero_ranks: the ranks the moments are
    sharded across (ZeRO-1), each keeping its share; packed_base: a bf16 base keeps a packed
    copy (packed_base_bytes)."""
    check_batch_shape(batch, seq_len)
    if lora is None:
        n = num_parameters(cfg)
        moments = -(-n // zero_ranks) if moment_floats is None else moment_floats
        return FinetuneMemory(parameters=FLOAT_BYTES * n, gradients=FLOAT_BYTES * n,
                              optimizer=2 * FLOAT_BYTES * moments,
                              activations=activation_bytes(cfg, batch, seq_len, checkpointing, precision=precision))
    base_dtype = base_dtype or "bf16"
    specs, table = adapter_layout(cfg, lora)
    n = sum(s.shape[0] * s.shape[1] for s in specs)
    moments = -(-n // zero_ranks) if moment_floats is None else moment_floats
    setup = run_setup(cfg, lora, base_dtype, True, table, 0)
    return FinetuneMemory(parameters=FLOAT_BYTES * n, gradients=FLOAT_BYTES * n, optimizer=2 * FLOAT_BYTES * moments,
                          activations=activation_bytes(cfg, batch, seq_len, checkpointing, precision=precision,
                                                       setup=setup),
                          base=base_bytes(cfg, base_dtype),
                          packed=packed_base_bytes(cfg) if packed_base and base_dtype == "bf16" else 0)


def partial_checkpoint_layers(cfg: ModelConfig, batch: int, seq_len: int, growth: float, precision: str = "fp32",
                              lora: Optional[LoraConfig] = None, base_dtype: Optional[str] = None,
                              zero_ranks: int = 1) -> int:
    """The fewest layers, from the first, to checkpoint so that the run's memory estimate
    (finetune_memory_bytes) is at most (1 + growth) times the estimate with every layer
    checkpointed: the other layers keep their activations, and their recompute is saved.
    growth 0: every layer (n_layer)."""
    if growth < 0:
        raise ValueError(f"growth must be at least 0, got {growth}")

    def total(k: int) -> int:
        return finetune_memory_bytes(cfg, batch, seq_len, k, precision, lora=lora, base_dtype=base_dtype,
                                     zero_ranks=zero_ranks).total

    budget = (1.0 + growth) * total(cfg.n_layer)
    # fewer checkpointed layers never take less memory: the first k that fits is the fewest
    return next(k for k in range(cfg.n_layer + 1) if total(k) <= budget)


def generation_bytes(cfg: ModelConfig, batch: int, seq_len: int, base_dtype: str = "fp32") -> int:
    """Memory to generate batch sequences of up to seq_len tokens: the weights (in base_dtype)
    and the KV cache with its buffers; no gradients, no moments, no training activations."""
    check_batch_shape(batch, seq_len)
    frozen = base_dtype != "fp32"
    setup = run_setup(cfg, None, base_dtype, frozen, [], 0)
    weights = base_bytes(cfg, base_dtype) if frozen else FLOAT_BYTES * num_parameters(cfg)
    return weights + FLOAT_BYTES * int(_native.cache_floats(setup, int(batch), int(seq_len)))


def finetune_ways(cfg: ModelConfig, batch: int, seq_len: int, lora_r: int = 16,
                  lora_precision: Optional[str] = None) -> list[tuple[str, int, int]]:
    """(way, bytes, bytes with activation checkpointing) of each way to finetune cfg with AdamW at
    (batch, seq_len), and of generation (one number, twice): full finetuning in fp32, and with
    its products in bf16 (--precision bf16: weights, gradients and moments stay fp32, some
    activations are kept in bf16); LoRA of rank lora_r on every linear layer over a bf16, int8
    and nf4 base, its products in lora_precision (None: what a LoRA run takes by default on this
    machine, lora.default_precision); generation with fp32 and bf16 weights. What `zoo inspect`
    prints and the model cards show."""
    out = [(f"full finetune ({precision}, AdamW)" if precision == "fp32" else f"full finetune ({precision} products)",
            finetune_memory_bytes(cfg, batch, seq_len, precision=precision).total,
            finetune_memory_bytes(cfg, batch, seq_len, checkpointing=True, precision=precision).total)
           for precision in ("fp32", "bf16")]
    lora = LoraConfig(r=lora_r, alpha=2 * lora_r)
    for fmt in ("bf16", "int8", "nf4"):
        precision = lora_precision or default_precision(fmt)
        out.append((f"LoRA r={lora_r}, {fmt} base",
                    finetune_memory_bytes(cfg, batch, seq_len, lora=lora, base_dtype=fmt, precision=precision).total,
                    finetune_memory_bytes(cfg, batch, seq_len, checkpointing=True, lora=lora, base_dtype=fmt,
                                          precision=precision).total))
    for fmt in ("fp32", "bf16"):
        g = generation_bytes(cfg, batch, seq_len, fmt)
        out.append((f"generation, {fmt} weights", g, g))
    return out


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"


# --- what the machine has -----------------------------------------------------------------


def _meminfo_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo: what the kernel can hand out without swapping."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _inactive_file(stat: Path, key: str) -> int:
    """Page cache the kernel reclaims before it fails an allocation (a cgroup's usage counts it)."""
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_available() -> Optional[int]:
    """The memory limit of this process's cgroup (v2, else v1) minus its usage; None without a limit.
    Usage includes page cache, of which the inactive part is reclaimable (as `docker stats` counts)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v2 = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    v1 = next((line.split(":", 2)[2] for line in lines if "memory" in line.split(":", 2)[1].split(",")), None)
    # Inside a container the process's path may name the host's hierarchy: try it, then the root.
    candidates = []
    if v1 is not None:
        root = Path("/sys/fs/cgroup/memory")
        candidates += [(root / v1.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
                       (root, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")]
    if v2 is not None:
        root = Path("/sys/fs/cgroup")
        candidates += [(root / v2.lstrip("/"), "memory.max", "memory.current", "inactive_file"),
                       (root, "memory.max", "memory.current", "inactive_file")]
    for folder, limit_file, usage_file, inactive_key in candidates:
        limit, usage = _read_int(folder / limit_file), _read_int(folder / usage_file)
        if usage is None:
            continue
        if limit is None or limit >= 1 << 60:  # "max", or v1's "no limit" (2^63 rounded to a page)
            return None
        return max(0, limit - usage + _inactive_file(folder / "memory.stat", inactive_key))
    return None


def _address_space_available() -> Optional[int]:
    """RLIMIT_AS (ulimit -v) minus the address space in use: arenas are mapped whole, so an
    arena beyond it fails however much memory is free."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(0, soft - int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory_bytes() -> Optional[tuple[int, str]]:
    """(bytes this process can still allocate, where the figure comes from), or None where zoo
    cannot tell (not Linux). The smallest of: MemAvailable, the cgroup's limit minus its usage,
    the address-space limit minus the address space used; or $ZOO_MEMORY_AVAILABLE if set."""
    override = os.environ.get(AVAILABLE_ENV)
    if override:
        try:
            return int(override), f"${AVAILABLE_ENV}"
        except ValueError:
            raise ValueError(f"${AVAILABLE_ENV} must be a number of bytes, got {override!r}") from None
    figures = [(n, where) for n, where in ((_meminfo_available(), "MemAvailable in /proc/meminfo"),
                                          (_cgroup_available(), "the cgroup's memory limit"),
                                          (_address_space_available(), "the address-space limit (ulimit -v)"))
               if n is not None]
    return min(figures) if figures else None


def check_memory(needed: int, what: str, fix: str) -> None:
    """Raises ResourceError if `what` needs more than this process can allocate: both numbers,
    and `fix`, what would make it fit. No-op where the figure is unknown or
    $ZOO_SKIP_MEMORY_CHECK=1."""
    if os.environ.get(SKIP_CHECK_ENV) == "1":
        return
    available = available_memory_bytes()
    if available is None or needed <= available[0]:
        return
    have, where = available
    raise ResourceError(f"{what} needs {human_bytes(needed)} ({needed:,} bytes), but {human_bytes(have)} "
                        f"({have:,} bytes) is available ({where}); {fix}. "
                        f"To try anyway, set {SKIP_CHECK_ENV}=1")


def describe(m: FinetuneMemory, base_dtype: Optional[str] = None) -> str:
    """'X = weights ... + activations ...': the parts of an estimate."""
    parts = ([f"frozen {base_dtype} base {human_bytes(m.base)}"]
             + ([f"its packed copy {human_bytes(m.packed)}"] if m.packed else [])
             + [f"adapters {human_bytes(m.parameters)}"] if m.base
             else [f"weights {human_bytes(m.parameters)}"])
    parts += [f"gradients {human_bytes(m.gradients)}", f"AdamW moments {human_bytes(m.optimizer)}",
              f"activations {human_bytes(m.activations)}"]
    return f"{human_bytes(m.total)} = " + " + ".join(parts)


# Narrower frozen bases, in order: each a way to fit a LoRA run that does not.
_NARROWER = {"fp32": ("bf16", "int8", "nf4"), "bf16": ("int8", "nf4"), "int8": ("nf4",), "nf4": ()}


def check_finetune_fits(cfg: ModelConfig, batch: int, seq_len: int, checkpointing: bool | int, precision: str,
                        lora: Optional[LoraConfig], base_dtype: Optional[str], what: str,
                        zero_ranks: int = 1, packed_base: bool = False) -> FinetuneMemory:
    """The memory a finetune of cfg needs (finetune_memory_bytes), checked before anything is
    allocated: a run that would not fit in what this process can allocate is refused with
    ResourceError giving the estimate, what is available, and the settings that would fit
    (--lora, a narrower base, --checkpointing, a smaller batch or sequence), each with its
    estimate. Returns the estimate."""
    need = finetune_memory_bytes(cfg, batch, seq_len, checkpointing, precision, lora=lora, base_dtype=base_dtype,
                                 zero_ranks=zero_ranks, packed_base=packed_base)
    available = available_memory_bytes()
    if os.environ.get(SKIP_CHECK_ENV) == "1" or available is None or need.total <= available[0]:
        return need
    have, where = available

    def estimate(**change) -> int:
        s = dict(batch=batch, seq_len=seq_len, checkpointing=checkpointing, lora=lora, base_dtype=base_dtype,
                 packed_base=packed_base)
        s.update(change)
        return finetune_memory_bytes(cfg, s["batch"], s["seq_len"], s["checkpointing"], precision,
                                     lora=s["lora"], base_dtype=s["base_dtype"], zero_ranks=zero_ranks,
                                     packed_base=s["packed_base"]).total

    options: list[tuple[str, int]] = []
    if need.packed:
        options.append(("--no-packed-base", estimate(packed_base=False)))
    adapters = lora or LoraConfig()
    base = base_dtype or "bf16"
    unpacked = " --no-packed-base" if packed_base else ""  # a narrower base has no packed copy
    bases = ([("--lora", "bf16")] if lora is None else []) + [
        (("" if lora else "--lora ") + f"--base-dtype {d}" + unpacked, d) for d in _NARROWER[base if lora else "bf16"]]
    for flags, d in bases:
        options.append((flags, estimate(lora=adapters, base_dtype=d)))
    every_layer = checkpoint_layers(cfg, checkpointing) == cfg.n_layer
    if not every_layer:
        options.append(("--checkpointing", estimate(checkpointing=True)))
    # A smaller batch or sequence (not below an eighth of the sequence), alone or checkpointed.
    for ckpt in ((False, True) if not every_layer else (False,)):
        for name, key, value, least in (("--batch-size", "batch", batch, 1),
                                        ("--seq-len", "seq_len", seq_len, max(1, seq_len // 8))):
            smaller = value // 2
            while smaller >= least and estimate(**{key: smaller}, checkpointing=ckpt or checkpointing) > have:
                smaller //= 2
            if smaller >= least:
                options.append((("--checkpointing " if ckpt else "") + f"{name} {smaller}",
                                estimate(**{key: smaller}, checkpointing=ckpt or checkpointing)))
    fits = [f"{flags} ({human_bytes(n)})" for flags, n in options if n <= have]
    if not fits:  # every way at once
        smallest = estimate(lora=adapters, base_dtype="nf4", checkpointing=True, batch=1)
        way = ("" if lora else "--lora ") + "--base-dtype nf4 --checkpointing --batch-size 1"
        fits = [f"not even {way} ({human_bytes(smallest)}): a smaller model"] if smallest > have else \
            [f"{way} ({human_bytes(smallest)})"]
    raise ResourceError(f"{what} at batch {batch} x {seq_len} needs {describe(need, base_dtype if lora else None)}, "
                        f"but {human_bytes(have)} ({have:,} bytes) is available ({where}); would fit: {'; '.join(fits)}. "
                        f"To try anyway, set {SKIP_CHECK_ENV}=1")
