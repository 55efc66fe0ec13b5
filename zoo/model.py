"""Model: one class for GPT-2 and Llama. A config becomes a parameter layout (layout.py),
the layout is bound into the native executor's arena, and every call below is one native
call: forward, forward + pullback, or an optimizer step."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ._load_native import _native
from .config import ModelConfig
from .layout import ParamSpec, parameter_layout


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies in float32 (as transformers computes them), with Llama-3 scaling."""
    hd = cfg.head_dim
    inv = (1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd)))
    inv = inv.astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv).astype(np.float32)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / s.factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def activation_bytes(cfg: ModelConfig, batch_size: int, seq_len: int, checkpointing: bool = False) -> int:
    """The activation arena a training step at (batch_size, seq_len) plans, without building a model."""
    return 4 * int(_native.activation_floats(cfg.model_dump(), int(batch_size), int(seq_len), bool(checkpointing)))


def _as_tokens(a, what: str, vocab_size: int, allow_ignore: bool = False) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 2:
        raise ValueError(f"{what} must be a 2-D integer array (B, T), got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.max() >= vocab_size or arr.min() < (-100 if allow_ignore else 0)):
        bad = arr[(arr >= vocab_size) | (arr < 0) & ~((arr == -100) & allow_ignore)]
        raise ValueError(f"{what} hold id {int(bad.flat[0])} outside the vocabulary [0, {vocab_size})")
    return np.ascontiguousarray(arr, dtype=np.int32)


class Model:
    """A decoder-only transformer described by a ModelConfig.

    seed: GPT-2-style random init (normal(0, 0.02), residual projections scaled by
    1/sqrt(2 n_layer), zero biases, unit norms); None leaves every parameter zero (for loading).
    checkpointing: keep only each layer's input during training and recompute the layer's
    internals in the pullback (less activation memory, about one more forward of compute).
    """

    def __init__(self, config: ModelConfig, seed: Optional[int] = 0, checkpointing: bool = False):
        self.config = config
        self.layout: list[ParamSpec] = parameter_layout(config)
        offsets, at = {}, 0
        for p in self.layout:
            offsets[p.name] = at
            at += math.prod(p.shape)
        self.n_params = at
        bindings = [(p.role, p.layer, offsets[p.name]) for p in self.layout if p.role]
        inv_freq = rope_inv_freq(config).tolist() if config.positions == "rope" else []
        self._exec = _native.Executor(config.model_dump(), at, bindings, inv_freq)
        self._offsets = offsets
        self._params = self._views(self._exec.params())
        self._grads = self._views(self._exec.grads())
        self.set_decay_mask({p.name: p.decay for p in self.layout})
        self._exec.set_checkpointing(bool(checkpointing))
        if seed is not None:
            self.init_weights(seed)

    def _views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {p.name: flat[self._offsets[p.name]:self._offsets[p.name] + math.prod(p.shape)].reshape(p.shape)
                for p in self.layout}

    # --- parameters -------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        """Writable float32 views into the arena, in zoo's layout (see layout.py)."""
        return dict(self._params)

    def gradients(self) -> dict[str, np.ndarray]:
        """Views of the gradient arena (what the last pullbacks accumulated)."""
        return dict(self._grads)

    def init_weights(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for p in self.layout:
            view = self._params[p.name]
            if p.role in ("ln1_w", "ln2_w", "lnf_w"):
                view[...] = 1.0
            elif len(p.shape) == 1:
                view[...] = 0.0
            else:
                std = residual_std if p.role in ("attn_out_w", "proj_w") else 0.02
                view[...] = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(std)

    @property
    def decay_mask(self) -> dict[str, bool]:
        return dict(self._decay_mask)

    def set_decay_mask(self, mask: dict[str, bool]) -> None:
        """Which tensors AdamW decays. Unknown names are an error."""
        unknown = set(mask) - set(self._offsets)
        if unknown:
            raise KeyError(f"set_decay_mask: unknown parameters {sorted(unknown)[:5]}")
        current = dict(getattr(self, "_decay_mask", {}))
        current.update({k: bool(v) for k, v in mask.items()})
        self._decay_mask = current
        ranges = [(self._offsets[p.name], self._offsets[p.name] + math.prod(p.shape))
                  for p in self.layout if current.get(p.name)]
        self._exec.set_decay_ranges(ranges)

    # --- forward and pullback ---------------------------------------------------

    def logits(self, tokens) -> np.ndarray:
        tok = _as_tokens(tokens, "tokens", self.config.vocab_size)
        self._exec.forward(tok, None)
        B, T = tok.shape
        return np.array(self._exec.logits(B, T))

    def loss(self, tokens, targets) -> float:
        tok = _as_tokens(tokens, "tokens", self.config.vocab_size)
        tgt = _as_tokens(targets, "targets", self.config.vocab_size, allow_ignore=True)
        return float(self._exec.forward(tok, tgt))

    def loss_and_grads(self, tokens, targets) -> tuple[float, dict[str, np.ndarray]]:
        self.zero_grads()
        loss = self.forward_backward(tokens, targets)
        return loss, {k: v.copy() for k, v in self._grads.items()}

    def zero_grads(self) -> None:
        self._exec.zero_grads()

    def forward_backward(self, tokens, targets, grad_scale: float = 1.0) -> float:
        """Adds grad_scale * dloss/dparams into the gradient arena (for accumulation)."""
        tok = _as_tokens(tokens, "tokens", self.config.vocab_size)
        tgt = _as_tokens(targets, "targets", self.config.vocab_size, allow_ignore=True)
        if tgt.shape != tok.shape:
            raise ValueError(f"targets shape {tgt.shape} differs from tokens shape {tok.shape}")
        return float(self._exec.forward_backward(tok, tgt, float(grad_scale)))

    # --- optimizer ----------------------------------------------------------------

    def grad_norm(self) -> float:
        return float(self._exec.grad_norm())

    def adamw_step(self, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0, max_grad_norm: Optional[float] = None) -> float:
        """Global-norm clipping, then AdamW over every parameter. Returns the norm before clipping."""
        return float(self._exec.adamw_step(lr, beta1, beta2, eps, weight_decay,
                                           -1.0 if max_grad_norm is None else float(max_grad_norm)))

    def optimizer_state(self) -> dict:
        return {"m": self._exec.adam_m(), "v": self._exec.adam_v(), "step": self._exec.step_count}

    def set_optimizer_step(self, step: int) -> None:
        self._exec.step_count = int(step)

    # --- generation ---------------------------------------------------------------

    def reset_cache(self, batch_size: int, max_len: int) -> None:
        self._exec.reset_cache(int(batch_size), int(max_len))

    def forward_cached(self, tokens, start_pos: int) -> np.ndarray:
        """Runs new tokens (B, T) at positions start_pos.. through the KV cache; returns the
        last position's logits (B, V)."""
        tok = _as_tokens(tokens, "tokens", self.config.vocab_size)
        return self._exec.forward_cached(tok, int(start_pos))

    # --- profiling ----------------------------------------------------------------

    def set_profiling(self, on: bool) -> None:
        """Start (and reset) or stop timing every block call inside the native steps."""
        self._exec.set_profiling(bool(on))

    def block_profile(self) -> dict[str, tuple[float, float]]:
        """Seconds spent per block kind since set_profiling(True): (forward, pullback)."""
        return {k: (float(f), float(b)) for k, (f, b) in self._exec.profile().items()}

    # --- memory -------------------------------------------------------------------

    @property
    def checkpointing(self) -> bool:
        return bool(self._exec.checkpointing())

    def set_checkpointing(self, on: bool) -> None:
        """Turn activation checkpointing on or off (re-plans the activation arena)."""
        self._exec.set_checkpointing(bool(on))

    def activation_bytes(self, batch_size: int, seq_len: int) -> int:
        """Bytes of the activation arena for a training step at (batch_size, seq_len)."""
        return activation_bytes(self.config, batch_size, seq_len, self.checkpointing)

    # --- checkpoints --------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> "Model":
        from .checkpoints import load_pretrained

        return load_pretrained(path, **kwargs)

    def save_pretrained(self, path, **kwargs) -> None:
        from .checkpoints import save_pretrained

        save_pretrained(self, path, **kwargs)

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({c.family}-named, {self.n_params:,} parameters, d_model={c.d_model}, "
                f"n_layer={c.n_layer}, norm={c.norm}, mlp={c.mlp}, positions={c.positions})")
