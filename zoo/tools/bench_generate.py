"""Generation from a preset's shape with its weights in each format, one process each:
`python -m zoo.tools.bench_generate --preset llama-3.2-3b --base fp32 bf16 int8 nf4`.

Random weights (zoo's init), a prompt of --prompt-len random tokens, then --new-tokens greedy
tokens through the KV cache. Per format: the time of the prompt and of each new token, and the
process's peak RSS (what generation on a machine of that much memory needs: weights, KV cache,
no training state). Prints a table, writes JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .bench_torch import _peak_rss_mib
from .bench_worker import cpu_info
from ..arch.layout import num_parameters


def worker(preset: str, base: str, prompt_len: int, new_tokens: int, threads: int) -> dict:
    import numpy as np

    import zoo
    from zoo.generate import generate
    from zoo.arch.lora import default_precision

    zoo.set_threads(threads)
    cfg = zoo.preset(preset)
    cfg = cfg.model_copy(update={"max_seq_len": min(cfg.max_seq_len, prompt_len + new_tokens)})
    t0 = time.perf_counter()
    model = zoo.Model(cfg, seed=0, base_dtype=base, precision=default_precision(base))
    build_s = time.perf_counter() - t0
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len).tolist()
    stamps: list[float] = []
    t0 = time.perf_counter()
    ids = generate(model, prompt, new_tokens, temperature=0.0, on_token=lambda _: stamps.append(time.perf_counter()))
    first, per_token = stamps[0] - t0, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return {"base": base, "precision": model.precision, "build_s": build_s, "prompt_s": first,
            "per_token_s": per_token, "tokens_per_s": 1.0 / per_token if per_token else None, "new_tokens": len(ids),
            "peak_rss_mib": _peak_rss_mib(), "arena_bytes": model.arena_bytes(), "parameters": num_parameters(cfg)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.2-3b")
    ap.add_argument("--base", nargs="+", default=["bf16"], choices=["fp32", "bf16", "int8", "nf4"],
                    help="formats of the weights, one process each (fp32: a plain model)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    import zoo

    threads = a.threads or zoo.get_threads()
    if a.worker:
        result = worker(a.preset, a.base[0], a.prompt_len, a.new_tokens, threads)
        Path(a.worker).write_text(json.dumps(result))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for base in a.base:
            out = Path(tmp) / f"{base}.json"
            print(f"bench_generate: {a.preset}, {base} ...", file=sys.stderr)
            r = subprocess.run([sys.executable, "-m", "zoo.tools.bench_generate", "--preset", a.preset, "--base", base,
                                "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens), "--threads",
                                str(threads), "--worker", str(out)])
            if r.returncode:
                print(f"bench_generate: the {base} worker failed (status {r.returncode})", file=sys.stderr)
                return r.returncode
            rows.append(json.loads(out.read_text()))
    print(f"## bench_generate: {a.preset} ({rows[0]['parameters']:,} parameters), prompt {a.prompt_len} tokens, "
          f"{a.new_tokens} new tokens, {threads} threads\n")
    print("| weights | products | prompt s | s / new token | tokens/s | peak RSS GiB | build s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['base']} | {r['precision']} | {r['prompt_s']:.2f} | {r['per_token_s']:.3f} | "
              f"{r['tokens_per_s']:.2f} | {r['peak_rss_mib'] / 1024:.2f} | {r['build_s']:.1f} |")
    if a.json:
        from zoo.core.atomic import write_json

        write_json(Path(a.json), {"schema": "zoo-bench-generate/1", "preset": a.preset, "prompt_len": a.prompt_len,
                                  "new_tokens": a.new_tokens, "threads": threads, "cpu": cpu_info(), "results": rows})
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
