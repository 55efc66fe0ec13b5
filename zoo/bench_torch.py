"""The PyTorch side of `zoo bench`: an independent eager implementation of zoo's architecture
space (GPT-2 and Llama shapes) as an nn.Module, and the worker that times its training step.

This file is run by path (`python .../zoo/bench_torch.py ...`), not as `-m zoo.bench_torch`,
so the measured process holds PyTorch alone: it imports neither zoo nor its native core
(whose OpenBLAS threads and memory would otherwise be counted against PyTorch). It reads
what `zoo bench` wrote into its work folder: manifest.json (the config, the batch shape, the
optimizer settings and zoo's parameter layout), weights.bin (every parameter as float32, in
zoo's arena order, which is also the order the fused q/k/v and gate/up tensors need) and
tokens.bin (int32, batch x (seq_len + 1)). The zoo worker reads the same files, so both
compute the same thing from the same weights and data.

A step is the one PyTorch users write: zero_grad, forward, cross-entropy, backward,
clip_grad_norm_, AdamW.step. "fused" is AdamW(fused=True), PyTorch's fastest eager setting
on the CPU; "default" is AdamW with no implementation flag (on the CPU, PyTorch then uses
its single-tensor for-loop implementation: foreach kernels are not the CPU default).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time


def _rss_now_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def build_module(cfg: dict):
    """The model as an nn.Module (imports torch here: torch is optional for zoo)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    d, hd, nh, nkv = cfg["d_model"], cfg["head_dim"], cfg["n_head"], cfg["n_kv_head"]
    d_ff, vocab = cfg["d_ff"], cfg["vocab_size"]
    swiglu = cfg["mlp"] == "swiglu"
    rope = cfg["positions"] == "rope"

    def norm():
        if cfg["norm"] == "layernorm":
            return nn.LayerNorm(d, eps=cfg["norm_eps"])
        return nn.RMSNorm(d, eps=cfg["norm_eps"])

    def rotate_half(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = norm()
            self.qkv = nn.Linear(d, (nh + 2 * nkv) * hd, bias=cfg["attention_bias"])  # fused q, k, v
            self.o = nn.Linear(nh * hd, d, bias=cfg["attention_bias"])
            self.ln2 = norm()
            self.fc = nn.Linear(d, 2 * d_ff if swiglu else d_ff, bias=cfg["mlp_bias"])  # [gate; up] if SwiGLU
            self.proj = nn.Linear(d_ff, d, bias=cfg["mlp_bias"])

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.view(B, T, nh, hd).transpose(1, 2)
            k = k.view(B, T, nkv, hd).transpose(1, 2)
            v = v.view(B, T, nkv, hd).transpose(1, 2)
            if cos is not None:
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
            x = x + self.o(a.transpose(1, 2).reshape(B, T, nh * hd))
            f = self.fc(self.ln2(x))
            if swiglu:
                g, u = f.chunk(2, dim=-1)
                f = F.silu(g) * u
            else:
                f = F.gelu(f, approximate="tanh")
            return x + self.proj(f)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = None if rope else nn.Embedding(cfg["max_seq_len"], d)
            self.h = nn.ModuleList(Block() for _ in range(cfg["n_layer"]))
            self.lnf = norm()
            self.lm_head = None if cfg["tied_embeddings"] else nn.Linear(d, vocab, bias=False)

        def set_rope_tables(self, seq_len: int) -> None:
            """cos/sin of positions x inverse frequencies (Llama-3 scaling included), float32."""
            self.cos = self.sin = None
            if not rope:
                return
            inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
            s = cfg.get("rope_scaling")
            if s:
                orig, lo, hi = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
                wavelen = 2 * math.pi / inv
                scaled = torch.where(wavelen > orig / lo, inv / s["factor"], inv)
                smooth = (orig / wavelen - lo) / (hi - lo)
                smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
                medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
                inv = torch.where(medium, smoothed, scaled)
            freqs = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()

        def forward(self, tokens, targets):
            T = tokens.shape[1]
            x = self.wte(tokens)
            if self.wpe is not None:
                x = x + self.wpe.weight[:T]
            cos = None if self.cos is None else self.cos[:T]
            sin = None if self.sin is None else self.sin[:T]
            for block in self.h:
                x = block(x, cos, sin)
            x = self.lnf(x)
            logits = F.linear(x, self.wte.weight if self.lm_head is None else self.lm_head.weight)
            return F.cross_entropy(logits.view(-1, vocab), targets.reshape(-1))

    return Decoder()


# zoo's parameter roles (zoo/layout.py) -> the module's parameters.
_GLOBAL_ROLES = {"wte": "wte.weight", "wpe": "wpe.weight", "lnf_w": "lnf.weight", "lnf_b": "lnf.bias",
                 "lm_head_w": "lm_head.weight"}
_LAYER_ROLES = {"ln1_w": "ln1.weight", "ln1_b": "ln1.bias", "qkv_w": "qkv.weight", "qkv_b": "qkv.bias",
                "attn_out_w": "o.weight", "attn_out_b": "o.bias", "ln2_w": "ln2.weight", "ln2_b": "ln2.bias",
                "fc_w": "fc.weight", "fc_b": "fc.bias", "proj_w": "proj.weight", "proj_b": "proj.bias"}


def load_weights(model, manifest: dict, weights_path: str) -> tuple[list, list]:
    """Reads weights.bin straight into the module's parameters (no intermediate copies) and
    returns (decayed, not decayed) parameter lists, following zoo's decay mask."""
    # A role's tensor plus the role-less tensors after it (fused neighbours) are one span.
    spans = []
    for p in manifest["params"]:
        n = math.prod(p["shape"])
        if p["role"]:
            spans.append({"role": p["role"], "layer": p["layer"], "offset": p["offset"], "numel": n,
                          "decay": p["decay"]})
        else:
            spans[-1]["numel"] += n
    named = dict(model.named_parameters())
    decay, no_decay, loaded = [], [], set()
    with open(weights_path, "rb", buffering=0) as f:
        for s in spans:
            name = _GLOBAL_ROLES[s["role"]] if s["layer"] < 0 else f"h.{s['layer']}.{_LAYER_ROLES[s['role']]}"
            t = named[name]
            if t.numel() != s["numel"]:
                raise ValueError(f"bench_torch: {name} has {t.numel()} elements, zoo's {s['role']} {s['numel']}")
            f.seek(4 * s["offset"])
            buf = memoryview(t.detach().numpy()).cast("B")
            got = 0
            while got < len(buf):
                got += f.readinto(buf[got:])
            loaded.add(name)
            (decay if s["decay"] else no_decay).append(t)
    missing = set(named) - loaded
    if missing:
        raise ValueError(f"bench_torch: parameters without weights: {sorted(missing)}")
    return decay, no_decay


def run(workdir: str, optimizer: str, steps: int, warmup: int, threads: int) -> dict:
    rss_start = _rss_now_mib()
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    rss_imported = _rss_now_mib()
    with open(os.path.join(workdir, "manifest.json")) as f:
        manifest = json.load(f)
    cfg, B, T = manifest["config"], manifest["batch"], manifest["seq_len"]
    opt_cfg = manifest["optimizer"]

    with torch.device("meta"):
        model = build_module(cfg)
    model = model.to_empty(device="cpu")
    model.set_rope_tables(T)
    decay, no_decay = load_weights(model, manifest, os.path.join(workdir, "weights.bin"))
    groups = [{"params": decay, "weight_decay": opt_cfg["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=opt_cfg["lr"], betas=(opt_cfg["beta1"], opt_cfg["beta2"]), eps=opt_cfg["eps"])
    opt = torch.optim.AdamW(groups, fused=True, **kw) if optimizer == "fused" else torch.optim.AdamW(groups, **kw)
    params = decay + no_decay

    data = torch.from_numpy(np.fromfile(os.path.join(workdir, "tokens.bin"), dtype=np.int32)
                            .reshape(B, T + 1).astype(np.int64))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    clip = opt_cfg["max_grad_norm"]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        return loss.item()

    for _ in range(warmup):
        step()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    return {
        "step_s": times, "losses": losses,
        "peak_rss_mib": _peak_rss_mib(), "rss_start_mib": rss_start, "rss_after_import_mib": rss_imported,
        "threads": torch.get_num_threads(),
        "implementation": f"PyTorch {torch.__version__} eager, AdamW("
                          + ("fused=True" if optimizer == "fused" else "defaults") + ")",
        "torch_version": torch.__version__,
        "median_s": statistics.median(times),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="zoo bench's PyTorch worker (run by zoo bench)")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--optimizer", choices=["fused", "default"], required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--out", required=True, help="where to write the result (JSON)")
    a = ap.parse_args(argv)
    result = run(a.workdir, a.optimizer, a.steps, a.warmup, a.threads)
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
