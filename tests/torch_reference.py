"""An independent PyTorch implementation of zoo's architecture space, written from the
definitions (not from zoo's kernels), for parity tests. Takes zoo's parameter dict."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from zoo.config import ModelConfig
from zoo.layout import parameter_layout


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = cfg.rope_scaling
    if s is None:
        return inv
    low, high = s.original_max_position_embeddings / s.low_freq_factor, s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high) * ~(wavelen > low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Reference:
    """Functional model over a dict of torch tensors keyed like zoo.layout (roles)."""

    def __init__(self, cfg: ModelConfig, params: dict[str, np.ndarray], dtype=torch.float32):
        self.cfg = cfg
        self.tensors = {k: torch.tensor(np.array(v), dtype=dtype, requires_grad=True) for k, v in params.items()}
        self.by_role: dict[tuple[str, int], list[str]] = {}
        self.layout = parameter_layout(cfg)
        current = None
        for p in self.layout:
            if p.role:
                current = (p.role, p.layer)
                self.by_role[current] = [p.name]
            else:  # fused neighbour of the previous role
                self.by_role[current].append(p.name)
        self.dtype = dtype

    def t(self, role, layer=-1):
        names = self.by_role.get((role, layer))
        if names is None:
            return None
        return torch.cat([self.tensors[n] for n in names], dim=0)

    def norm(self, x, w, b):
        c = self.cfg
        if c.norm == "layernorm":
            return F.layer_norm(x, (c.d_model,), w, b, c.norm_eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w

    def logits(self, tokens: np.ndarray):
        c = self.cfg
        tok = torch.tensor(tokens, dtype=torch.long)
        B, T = tok.shape
        x = self.t("wte")[tok]
        if c.positions == "learned":
            x = x + self.t("wpe")[:T]
        else:
            freqs = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq(c)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        hd, nh, nkv = c.head_dim, c.n_head, c.n_kv_head
        for i in range(c.n_layer):
            h = self.norm(x, self.t("ln1_w", i), self.t("ln1_b", i))
            qkv = F.linear(h, self.t("qkv_w", i), self.t("qkv_b", i))
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.view(B, T, nh, hd).transpose(1, 2)
            k = k.view(B, T, nkv, hd).transpose(1, 2)
            v = v.view(B, T, nkv, hd).transpose(1, 2)
            if c.positions == "rope":
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            a = (att @ v).transpose(1, 2).reshape(B, T, nh * hd)
            x = x + F.linear(a, self.t("attn_out_w", i), self.t("attn_out_b", i))
            h = self.norm(x, self.t("ln2_w", i), self.t("ln2_b", i))
            f = F.linear(h, self.t("fc_w", i), self.t("fc_b", i))
            if c.mlp == "swiglu":
                g, u = f.split(c.d_ff, dim=-1)
                f = F.silu(g) * u
            elif c.mlp == "relu2":
                f = F.relu(f).square()
            else:
                f = F.gelu(f, approximate="tanh")
            x = x + F.linear(f, self.t("proj_w", i), self.t("proj_b", i))
        x = self.norm(x, self.t("lnf_w"), self.t("lnf_b"))
        head = self.t("wte") if c.tied_embeddings else self.t("lm_head_w")
        return x @ head.T

    def loss(self, tokens, targets):
        logits = self.logits(tokens)
        tgt = torch.tensor(targets, dtype=torch.long)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)

    def loss_and_grads(self, tokens, targets):
        loss = self.loss(tokens, targets)
        loss.backward()
        return loss.item(), {k: v.grad.numpy() for k, v in self.tensors.items()}
