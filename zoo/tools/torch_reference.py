"""An independent PyTorch implementation of zoo's architecture space, written from the block
definitions (not from zoo's kernels). One model for two uses:

- `zoo bench` times its training step against zoo's (bench_torch.py: `Decoder`, AdamW);
- the parity tests compare zoo's logits, loss and gradients with it (`Reference`).

It never imports zoo: zoo bench runs it in a process of its own (bench_torch.py, run by path)
that must hold PyTorch alone, not zoo's native core and its BLAS threads and memory. So it
takes the config as a plain dict (ModelConfig.model_dump()) and zoo's parameter layout as plain
records {"name", "shape", "role", "layer"} in arena order: zoo bench's manifest.json holds
them, and zoo_layout() makes them in a process that has zoo anyway (the tests).

Parameters are held by role, as zoo binds them: a role-less record is the fused neighbour of
the role before it (q|k|v in "qkv_w", gate|up in "fc_w"), so each role is one tensor whose
rows are its records' rows, in layout order.

The blocks it implements are the keys of NORMS, MLPS and POSITIONS. A config that asks for
anything else, or that has a field this file does not know, is refused with the field and the
value: the reference never stands in one block for another.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# --- blocks -------------------------------------------------------------------------------


def layer_norm(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def rms_norm(x, w, b, eps):
    # x / sqrt(mean(x^2) + eps) * w; zoo's layout gives RMSNorm no bias (b is None)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def rms_norm_1p(x, w, b, eps):
    # Gemma's: the weight is stored around 0 and scales by 1 + w, all in float32 or wider
    return F.rms_norm(x, (x.shape[-1],), None, eps) * (1.0 + w)


def gelu(h):
    return F.gelu(h, approximate="tanh")


def swiglu(h):
    gate, up = h.chunk(2, dim=-1)  # fc_w holds [gate; up]
    return F.silu(gate) * up


def relu2(h):
    return F.relu(h).square()


def geglu(h):
    gate, up = h.chunk(2, dim=-1)  # fc_w holds [gate; up]
    return F.gelu(gate, approximate="tanh") * up


def rotate_half(t):
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def rope_inverse_frequencies(cfg: dict, theta: float | None = None) -> torch.Tensor:
    """theta^(-2i/d) over the rotated part d of a head (rotary_dim, else head_dim), float32, with
    Llama 3's rope_scaling when the config has it and no theta is given: long wavelengths
    divided by `factor`, short ones kept, a smooth blend in between."""
    hd = cfg.get("rotary_dim") or cfg["head_dim"]
    inv = 1.0 / ((theta or cfg["rope_theta"]) ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = cfg.get("rope_scaling")
    if not s or theta is not None:
        return inv
    if s.get("rope_type") == "linear":  # every frequency divided by the factor
        return inv / s["factor"]
    orig, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"],
                               s["high_freq_factor"], s["factor"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= orig / high) & (wavelen <= orig / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: dict, seq_len: int, theta: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x inverse frequency, (seq_len, rotated dims), float32."""
    freqs = torch.arange(seq_len, dtype=torch.float32)[:, None] * rope_inverse_frequencies(cfg, theta)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def learned_positions(model, x):
    """Adds the position embedding; queries and keys are left as they are."""
    return x + model.wpe[: x.shape[1]], lambda t, local=False: t


def rotary_positions(model, x):
    """Leaves x as it is; queries and keys get rotated (rotate-half RoPE over their first
    rotary_dim values), by the sliding layers' own table where the config gives them one."""
    tables = {False: rope_tables(model.cfg, x.shape[1])}
    if model.cfg.get("sliding_rope_theta"):
        tables[True] = rope_tables(model.cfg, x.shape[1], model.cfg["sliding_rope_theta"])

    def rotate(t, local=False):
        cos, sin = (u.to(x.dtype) for u in tables[local])
        d = cos.shape[-1]
        rotated, rest = t[..., :d], t[..., d:]
        return torch.cat((rotated * cos + rotate_half(rotated) * sin, rest), dim=-1)
    return x, rotate


# What this file implements, one dict per config field. A block added to zoo's registry
# (zoo.core.blocks: norms, MLP activations) goes here too; tests/test_torch_reference.py checks that
# every value a config may name is here.
NORMS = {"layernorm": layer_norm, "rmsnorm": rms_norm, "layernorm_nobias": layer_norm, "rmsnorm_1p": rms_norm_1p}  # (x, weight, bias, eps)
MLPS = {"gelu": gelu, "swiglu": swiglu, "relu2": relu2, "geglu": geglu, "gelu_erf": F.gelu}  # fc's output -> proj's input
POSITIONS = {"learned": learned_positions, "rope": rotary_positions}  # (model, x) -> (x, rotate q/k)
# Whether attention and MLP both read the one norm's output and add into the stream together
# (the parallel residual, GPT-J style) or run one after the other, each after its own norm.
LAYERS = {"sequential": False, "parallel": True, "parallel_two_norms": True}
BLOCK_TABLES = (("norm", "NORMS", NORMS), ("mlp", "MLPS", MLPS), ("positions", "POSITIONS", POSITIONS),
                ("layer", "LAYERS", LAYERS))

# Every ModelConfig field the forward below reads or that is a plain shape. A field zoo gains
# later is refused until this file implements it.
# family names the tensors only: the reference reads them by role, so every family computes alike.
CONFIG_FIELDS = {"vocab_size", "max_seq_len", "d_model", "n_layer", "n_head", "n_kv_head", "head_dim", "d_ff",
                 "norm", "norm_eps", "mlp", "positions", "rope_theta", "rope_scaling", "attention_bias",
                 "mlp_bias", "tied_embeddings", "layer", "family", "attention_out_bias", "qk_norm", "branch_norms",
                 "sliding_window", "sliding_layers", "nope_layers", "embedding_scale", "residual_scale",
                 "attention_scale", "logit_scale", "attention_softcap", "logit_softcap", "sliding_rope_theta",
                 "rotary_dim"}
ROPE_SCALING_FIELDS = {"rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
# zoo's parameter roles (zoo/arch/layout.py): the tensors outside the layers, and those of a layer.
GLOBAL_ROLES = ("wte", "wpe", "lnf_w", "lnf_b", "lm_head_w")
LAYER_ROLES = ("ln1_w", "ln1_b", "qkv_w", "qkv_b", "q_norm_w", "k_norm_w", "attn_out_w", "attn_out_b",
               "post_attn_w", "post_attn_b", "ln2_w", "ln2_b", "fc_w", "fc_b", "proj_w", "proj_b", "post_mlp_w",
               "post_mlp_b")


def check_config(cfg: dict) -> None:
    """Raises NotImplementedError naming the field and the value this file does not implement."""
    for field in cfg:
        if field not in CONFIG_FIELDS:
            raise NotImplementedError(f"torch reference: config field {field}={cfg[field]!r} is not implemented "
                                      "here; add it to zoo/tools/torch_reference.py (CONFIG_FIELDS and the forward)")
    for field, table_name, table in BLOCK_TABLES:
        value = cfg.get(field)
        if value not in table:
            raise NotImplementedError(f"torch reference: {field}={value!r} is not implemented here (it has "
                                      f"{', '.join(table)}); add it to {table_name} in zoo/tools/torch_reference.py")
    for field in cfg.get("rope_scaling") or {}:
        if field not in ROPE_SCALING_FIELDS:
            raise NotImplementedError(f"torch reference: rope_scaling.{field} is not implemented here (it has "
                                      f"Llama 3's {', '.join(sorted(ROPE_SCALING_FIELDS))})")


def role_spans(layout: list[dict]) -> list[dict]:
    """The layout's records grouped by role, in arena order: {"role", "layer", "records",
    "shape"}, the shape the records' rows stacked (a fused q|k|v or gate|up is one span)."""
    spans: list[dict] = []
    for rec in layout:
        if rec["role"]:
            spans.append({"role": rec["role"], "layer": rec["layer"], "records": [rec]})
        elif spans:
            spans[-1]["records"].append(rec)
        else:
            raise ValueError(f"torch reference: {rec['name']} has no role and no tensor before it to fuse with")
    for s in spans:
        roles = LAYER_ROLES if s["layer"] >= 0 else GLOBAL_ROLES
        if s["role"] not in roles:
            raise NotImplementedError(f"torch reference: parameter role {s['role']!r} "
                                      f"({s['records'][0]['name']}) is not implemented here")
        first = s["records"][0]["shape"]
        s["shape"] = (sum(r["shape"][0] for r in s["records"]), *first[1:])
    return spans


# --- the model ----------------------------------------------------------------------------


class Decoder(nn.Module):
    """The model as a PyTorch user writes it: one parameter per zoo role (`model.wte`,
    `model.layers[i].qkv_w`, ...; None where the config has no such tensor), and a forward that
    returns the mean cross-entropy. Parameters start uninitialised: load them."""

    def __init__(self, cfg: dict, layout: list[dict], dtype: torch.dtype = torch.float32):
        super().__init__()
        check_config(cfg)
        self.cfg = dict(cfg)
        self.norm, self.mlp = NORMS[cfg["norm"]], MLPS[cfg["mlp"]]
        self.positions = POSITIONS[cfg["positions"]]
        self.parallel = LAYERS[cfg.get("layer", "sequential")]
        self.layers = nn.ModuleList(nn.Module() for _ in range(cfg["n_layer"]))
        for role in GLOBAL_ROLES:
            self.register_parameter(role, None)
        for layer in self.layers:
            for role in LAYER_ROLES:
                layer.register_parameter(role, None)
        self.spans = role_spans(layout)
        for s in self.spans:
            self.owner(s).register_parameter(s["role"], nn.Parameter(torch.empty(s["shape"], dtype=dtype)))

    def owner(self, span: dict) -> nn.Module:
        return self if span["layer"] < 0 else self.layers[span["layer"]]

    def parameter_of(self, span: dict) -> nn.Parameter:
        return getattr(self.owner(span), span["role"])

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        B, T = tokens.shape
        nh, nkv, hd, eps = c["n_head"], c["n_kv_head"], c["head_dim"], c["norm_eps"]
        pre, post = c.get("branch_norms", "pre") != "post", c.get("branch_norms", "pre") != "pre"
        qk_norm = c.get("qk_norm", "none")
        window = c.get("sliding_window")
        sliding = set(range(c["n_layer"]) if c.get("sliding_layers") is None else c["sliding_layers"])
        nope = set(c.get("nope_layers") or ())
        scale_residual = c.get("residual_scale", 1.0)
        x = F.embedding(tokens, self.wte) * c.get("embedding_scale", 1.0)
        x, rotate = self.positions(self, x)
        for i, layer in enumerate(self.layers):
            h = self.norm(x, layer.ln1_w, layer.ln1_b, eps) if pre else x
            q, k, v = F.linear(h, layer.qkv_w, layer.qkv_b).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            if qk_norm == "projection":  # over all heads of the token at once (OLMo-2)
                q, k = self.norm(q, layer.q_norm_w, None, eps), self.norm(k, layer.k_norm_w, None, eps)
            q, k = q.view(B, T, nh, hd).transpose(1, 2), k.view(B, T, nkv, hd).transpose(1, 2)
            if qk_norm == "head":  # over each head (Qwen3, Gemma 3)
                q, k = self.norm(q, layer.q_norm_w, None, eps), self.norm(k, layer.k_norm_w, None, eps)
            local = window is not None and i in sliding
            if i not in nope:
                q, k = rotate(q, local and bool(c.get("sliding_rope_theta"))), rotate(k, local and bool(c.get("sliding_rope_theta")))
            v = v.view(B, T, nkv, hd).transpose(1, 2)
            # The mask: causal, and within the window on the layers that have one.
            t = torch.arange(T)
            allowed = t[None, :] <= t[:, None]
            if local:
                allowed = allowed & (t[:, None] - t[None, :] < window)
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
            scores = q @ k.transpose(-1, -2) * (c.get("attention_scale") or hd ** -0.5)
            if c.get("attention_softcap"):
                scores = c["attention_softcap"] * torch.tanh(scores / c["attention_softcap"])
            a = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v
            attn_out = F.linear(a.transpose(1, 2).reshape(B, T, nh * hd), layer.attn_out_w, layer.attn_out_b)
            if post:
                attn_out = self.norm(attn_out, layer.post_attn_w, layer.post_attn_b, eps)
            if not self.parallel:
                x = x + scale_residual * attn_out
                h = self.norm(x, layer.ln2_w, layer.ln2_b, eps) if pre else x
            elif layer.ln2_w is not None:  # the two-norm parallel layer: the MLP reads norm2(x)
                h = self.norm(x, layer.ln2_w, layer.ln2_b, eps)
            mlp_out = F.linear(self.mlp(F.linear(h, layer.fc_w, layer.fc_b)), layer.proj_w, layer.proj_b)
            if post:
                mlp_out = self.norm(mlp_out, layer.post_mlp_w, layer.post_mlp_b, eps)
            x = x + scale_residual * mlp_out
            if self.parallel:
                x = x + attn_out
        x = self.norm(x, self.lnf_w, self.lnf_b, eps)
        logits = F.linear(x, self.wte if c["tied_embeddings"] else self.lm_head_w) * c.get("logit_scale", 1.0)
        if c.get("logit_softcap"):
            logits = c["logit_softcap"] * torch.tanh(logits / c["logit_softcap"])
        return logits

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


# --- the parity tests' view -----------------------------------------------------------------


def zoo_layout(cfg: dict) -> list[dict]:
    """zoo's parameter layout for a config, as the records this file takes. Imports zoo: for
    callers in a process that has it (the tests), never the bench's PyTorch worker."""
    from zoo.arch.config import ModelConfig
    from zoo.arch.layout import parameter_layout

    return [{"name": p.name, "shape": list(p.shape), "role": p.role, "layer": p.layer}
            for p in parameter_layout(ModelConfig(**cfg))]


class Reference:
    """zoo's parameters by name in (numpy arrays, e.g. zoo.Model.parameters()); logits, loss,
    and gradients by zoo's tensor names out. cfg: a dict of ModelConfig fields, or anything
    with model_dump() (a zoo ModelConfig); layout: records in arena order, or None for zoo's
    own (zoo_layout). dtype: torch.float32 or torch.float64. precision "bf16" runs the forward
    under torch.autocast("cpu", dtype=torch.bfloat16), as PyTorch users write mixed precision."""

    def __init__(self, cfg, params: dict, dtype: torch.dtype = torch.float32, layout: list[dict] | None = None,
                 precision: str = "fp32"):
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"torch reference: precision {precision!r} is not fp32 or bf16")
        self.autocast = precision == "bf16"
        cfg = cfg if isinstance(cfg, dict) else cfg.model_dump()
        self.model = Decoder(cfg, zoo_layout(cfg) if layout is None else layout, dtype)
        with torch.no_grad():
            for s in self.model.spans:
                rows = [torch.tensor(params[r["name"]]).reshape(r["shape"]) for r in s["records"]]
                self.model.parameter_of(s).copy_(torch.cat(rows, dim=0))

    def logits(self, tokens) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model.logits(torch.tensor(tokens, dtype=torch.long))
        return out.float() if self.autocast else out

    def loss(self, tokens, targets) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(torch.tensor(tokens, dtype=torch.long), torch.tensor(targets, dtype=torch.long))
        return out.float() if self.autocast else out

    def loss_and_grads(self, tokens, targets) -> tuple[float, dict]:
        """The loss and every tensor's gradient by zoo's name (fused roles split back)."""
        self.model.zero_grad(set_to_none=True)
        loss = self.loss(tokens, targets)
        loss.backward()
        grads = {}
        for s in self.model.spans:
            p = self.model.parameter_of(s)
            g = torch.zeros_like(p) if p.grad is None else p.grad
            for r, part in zip(s["records"], g.split([r["shape"][0] for r in s["records"]], dim=0)):
                grads[r["name"]] = part.reshape(r["shape"]).numpy()
        return loss.item(), grads
