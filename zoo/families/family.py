"""What a family is: everything one Hugging Face architecture means to zoo, as data and a few
functions, so that the loaders, writers and tools read it instead of branching on a name.

A family module (gpt2.py, llama.py, ...) defines one `Family`; families/__init__.py lists
them. docs/adding_a_family.md walks through writing one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..core.errors import CheckpointError
from ..core.files import show_value


@dataclass(frozen=True)
class TensorNames:
    """Where a family's checkpoints keep each tensor, by the role zoo binds it to (layout.py).

    A layer's tensors are `layer.format(i=...) + part + ".weight"` (and ".bias"). A fused
    group lists its parts in order: q, k and v as three tensors (Llama) or one (GPT-2's
    c_attn); a gated MLP's gate and up as two, or one holding [gate; up]."""

    embedding: str  # token embeddings, without ".weight"
    positions: str  # learned position embeddings (a config with learned positions)
    layer: str  # prefix of layer i's tensors, with {i}
    norm1: str  # the norm before attention (the only one of a parallel-residual layer)
    norm2: str  # the norm before the MLP
    qkv: tuple[str, ...]  # q, k, v projections: 3 parts, or 1 fused (q | k | v rows)
    attn_out: str
    mlp_in_gated: tuple[str, ...]  # a gated MLP's input: (gate, up), or 1 fused ([gate; up] rows)
    mlp_in: str  # an ungated MLP's input
    mlp_out: str
    final_norm: str
    head: str  # the untied LM head
    transposed: bool  # layer matrices stored (in, out), as GPT-2's Conv1D: transposed on load and save
    base_prefix: str  # dropped by checkpoints of the bare model (GPT2Model, LlamaModel)
    buffers: tuple[str, ...] = ()  # name endings of stored tensors that are no parameters (masks, inv_freq)
    q_norm: str = "self_attn.q_norm"  # the q and k norms (ModelConfig.qk_norm)
    k_norm: str = "self_attn.k_norm"
    post_norm1: str = "post_attention_norm"  # the norms on the branches' outputs (ModelConfig.branch_norms)
    post_norm2: str = "post_feedforward_norm"


class Getter:
    """Typed reads from a config dict, with errors naming the file and key; a missing key (or
    null) takes the default, as the transformers config class has it."""

    def __init__(self, hf: dict, source):
        self.hf, self.source = hf, source

    def __call__(self, key: str, default, kind: type):
        value = self.hf.get(key, default)
        if value is None:
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CheckpointError(self.source, f"expected {kind.__name__}, got {show_value(value)}", key=key)
        return value

    def require(self, key: str, expected, kind: type) -> None:
        value = self(key, expected, kind)
        if value != expected:
            raise CheckpointError(self.source, f"value {show_value(value)} is not supported by zoo (only {expected!r})",
                                  key=key)

    def activation(self, key: str, default: str, activations: dict[str, str]) -> str:
        """The zoo MLP block a Hugging Face activation name means in this family."""
        name = self(key, default, str)
        if name not in activations:
            raise CheckpointError(self.source, f"unsupported activation {show_value(name)} (zoo computes: "
                                               f"{', '.join(activations)})", key=key)
        return activations[name]


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture.

    name: zoo's name for it (ModelConfig.family), also its GGUF architecture where llama.cpp has
    one (gguf_arch). model_types / architectures: what config.json says. saves_as: the class
    written into a saved config.json. activations: Hugging Face activation name -> zoo's MLP
    block (the first entry of a block is the name written back). hf_keys: which config.json key
    feeds each ModelConfig field, for errors.

    read_config(hf, get) -> ModelConfig fields of a parsed config.json (get: a Getter).
    write_config(cfg) -> config.json keys (architectures and model_type included).
    cannot_express(cfg) -> (field, why) when saves_as cannot hold cfg, else None.
    read_gguf(key, f) -> ModelConfig fields from a GGUF file's metadata (key(name, kind, default)
    reads "{gguf_arch}.name"); write_gguf(cfg) -> {suffix: (value, gguf type name)} for the
    architecture's keys. gguf_rope_heads(cfg, role_part) -> the heads a tensor's rows are
    permuted over in GGUF (llama.cpp's rotation order), or None.
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    saves_as: str
    names: TensorNames
    activations: dict[str, str]
    hf_keys: dict[str, str]
    read_config: Callable[[dict, Getter], dict[str, Any]]
    write_config: Callable[[Any], dict[str, Any]]
    cannot_express: Callable[[Any], Optional[tuple[str, str]]]
    gguf_arch: Optional[str] = None
    read_gguf: Optional[Callable[[Callable, Any], dict[str, Any]]] = None
    write_gguf: Optional[Callable[[Any], dict[str, tuple[Any, str]]]] = None
    gguf_rope_heads: Callable[[Any, str], Optional[int]] = lambda cfg, part: None
    gguf_writes_tied_head: bool = False  # llama.cpp's converter writes a tied head out as output.weight
    # row_order(cfg, tensor name) -> the rows of a checkpoint tensor in zoo's order (zoo =
    # stored[order]) for a tensor the family stores in another order (GPT-NeoX's q|k|v
    # interleaved per head), else None; a PEFT adapter's lora_B follows its module's weight.
    row_order: Callable[[Any, str], Optional[Any]] = lambda cfg, name: None
    notes: tuple[str, ...] = field(default=())  # what zoo refuses of this family, and why (docs, errors)

    def rows_from_checkpoint(self, cfg, name: str, value):
        """A checkpoint tensor (numpy) with its rows in zoo's order."""
        order = self.row_order(cfg, _module_weight(name))
        return value if order is None else value[order]

    def rows_to_checkpoint(self, cfg, name: str, value):
        """A zoo tensor with its rows in the checkpoint's order."""
        order = self.row_order(cfg, _module_weight(name))
        if order is None:
            return value
        stored = value.copy()
        stored[order] = value
        return stored

    def activation_name(self, mlp: str) -> Optional[str]:
        """The Hugging Face activation name this family writes for zoo's MLP block, if any."""
        return next((hf for hf, block in self.activations.items() if block == mlp), None)

    @property
    def lora_modules(self) -> tuple[str, ...]:
        """Every module name an adapter can sit on, in layer order (q_proj ... down_proj)."""
        n = self.names
        out: list[str] = []
        for part in (*n.qkv, n.attn_out, *n.mlp_in_gated, n.mlp_in, n.mlp_out):
            short = part.rsplit(".", 1)[-1]
            if short not in out:
                out.append(short)
        return tuple(out)


# The options of the Llama variants (ModelConfig) and their values in a plain Llama (or GPT-2).
VARIANT_OPTIONS = {"qk_norm": "none", "branch_norms": "pre", "sliding_window": None, "sliding_layers": None,
                   "nope_layers": (), "embedding_scale": 1.0, "residual_scale": 1.0, "attention_scale": None,
                   "logit_scale": 1.0, "attention_softcap": None, "logit_softcap": None, "sliding_rope_theta": None,
                   "rotary_dim": None}


def unexpressed(cfg, arch: str, expresses: tuple[str, ...] = ()) -> Optional[tuple[str, str]]:
    """(field, why) for the first variant option cfg sets that arch does not hold (expresses:
    those it does), including an output-projection bias unlike q, k and v's; else None."""
    if "attention_out_bias" not in expresses and cfg.attention_out_bias != cfg.attention_bias:
        return "attention_out_bias", (f"{arch} gives o_proj a bias exactly when q, k and v have one "
                                      f"(attention_bias={cfg.attention_bias}, attention_out_bias={cfg.attention_out_bias})")
    for option, plain in VARIANT_OPTIONS.items():
        if option not in expresses and getattr(cfg, option) != plain:
            return option, f"{arch} cannot express {option}={getattr(cfg, option)!r}"
    return None


def _module_weight(name: str) -> str:
    """The module weight a tensor's rows follow: itself, or for an adapter's B its module's."""
    return name.replace(".lora_B.weight", ".weight")
