"""Generation, zoo against llama.cpp on the same weights, one process per measurement:
`python -m zoo.tools.bench_generate --preset smollm-135m tinyllama-1.1b --base bf16 int8 nf4 --threads 2`.

For each preset and base format, zoo builds the preset's shape with random weights (zoo's init,
seed 0) stored in that format, and writes those weights as a GGUF file of the type llama.cpp
runs fastest for it (fp32: F32, bf16: BF16, int8: Q8_0, nf4: Q4_0), which llama.cpp loads through
llama-cpp-python where it is installed (an optional side: `pip install llama-cpp-python`, which
builds llama.cpp from source). Then, zoo and llama.cpp in turn (A B A B, --repeats times), each
in a fresh process:
  decode   a prompt of --prompt-len random tokens, then --new-tokens greedy ones: new tokens per
           second after the first (the prompt's time apart)
  prompt   --prefill-len random tokens through the model once: tokens per second
  batched  (zoo) --batch prompts of --prompt-len tokens decoded together, --new-tokens each:
           new tokens per second of all of them, after the first token of each
Each figure is the best of its repeats (on a machine shared with other work the best is what the
code does when it runs; every repeat is in the JSON, with the machine's load average before and
after it). Prints a table with the ratios and issue 33's targets, met or not:
  decode    zoo / llama.cpp >= 1.0 in bf16 (BF16) and int8 (Q8_0), >= 0.9 in nf4 (Q4_0)
  prompt    zoo / llama.cpp >= 1.0 over --prefill-len tokens
  batched   --batch prompts >= 4x one prompt's new tokens per second, at the 1.1B shape
and writes JSON (--json, benchmarks/generate-vs-llama.cpp.json by default; --json '' for none).
Without llama-cpp-python (or with --no-llama-cpp) the zoo side runs alone."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .bench_torch import _peak_rss_mib
from .bench_worker import cpu_info

# Issue 33's targets: decode against llama.cpp by format, prompt processing, and the batch's
# tokens per second against one prompt's at the 1.1B shape.
DECODE_TARGETS = {"fp32": 1.0, "bf16": 1.0, "int8": 1.0, "nf4": 0.9}
PREFILL_TARGET = 1.0
BATCH_TARGET = 4.0
BATCH_TARGET_PRESETS = ("tinyllama-1.1b",)

# The GGUF type llama.cpp runs for each zoo base format.
GGUF_TYPES = {"fp32": "float32", "bf16": "bfloat16", "int8": "q8_0", "nf4": "q4_0"}
GGUF_NAMES = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "nf4": "Q4_0"}


def _config(preset: str, context: int):
    import zoo

    cfg = zoo.preset(preset)
    return cfg.model_copy(update={"max_seq_len": min(cfg.max_seq_len, context)})


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, (count, length)).tolist()


def _rate(stamps: list[float]) -> float:
    """Tokens per second between the first stamp and the last."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else 0.0


def zoo_worker(a, out: Path) -> dict:
    import zoo
    from zoo.arch.layout import num_parameters
    from zoo.arch.lora import default_precision
    from zoo.generate import generate, generate_batch

    zoo.set_threads(a.threads)
    cfg = _config(a.preset[0], a.context)
    t0 = time.perf_counter()
    model = zoo.Model(cfg, seed=0, base_dtype=a.base[0], precision=default_precision(a.base[0]))
    build_s = time.perf_counter() - t0
    if a.export:
        import warnings

        from zoo.io.gguf import save_gguf

        with warnings.catch_warnings():  # random weights have no tokenizer: llama.cpp runs token ids
            warnings.simplefilter("ignore", RuntimeWarning)
            save_gguf(model, a.export, dtype=GGUF_TYPES[a.base[0]])
    prompt = _prompts(cfg.vocab_size, 1, a.prompt_len, 1)[0]
    generate(model, prompt[:8], 4)  # warm: the first call of each product shape
    stamps: list[float] = []
    t0 = time.perf_counter()
    ids = generate(model, prompt, a.new_tokens, on_token=lambda _: stamps.append(time.perf_counter()))
    result = {"system": "zoo", "base": a.base[0], "precision": model.precision, "build_s": build_s,
              "prompt_s": stamps[0] - t0, "decode_tokens_per_s": _rate(stamps), "new_tokens": len(ids)}
    if a.prefill_len:
        long_prompt = _prompts(cfg.vocab_size, 1, a.prefill_len, 2)[0]
        model.reset_cache(1, a.prefill_len)
        model.forward_segments([0], [long_prompt[:64]], [0])  # warm
        t0 = time.perf_counter()
        model.forward_segments([0], [long_prompt], [0])
        result["prefill_tokens_per_s"] = a.prefill_len / (time.perf_counter() - t0)
    if a.batch > 1:
        prompts = _prompts(cfg.vocab_size, a.batch, a.prompt_len, 3)
        stamps = []
        generate_batch(model, prompts, a.new_tokens, batch_size=a.batch,
                       on_token=lambda i, _: stamps.append(time.perf_counter()))
        # The first a.batch stamps come from the call that ran the prompts: time from the last of them.
        decode = stamps[a.batch - 1:]
        result["batch"] = a.batch
        result["batch_tokens_per_s"] = (len(decode) - 1) / (decode[-1] - decode[0])
    result.update(peak_rss_mib=_peak_rss_mib(), arena_bytes=model.arena_bytes(), parameters=num_parameters(cfg))
    return result


def llama_worker(a, gguf_path: str) -> dict:
    import numpy as np
    from llama_cpp import Llama

    cfg = _config(a.preset[0], a.context)
    t0 = time.perf_counter()
    llm = Llama(model_path=gguf_path, n_ctx=max(a.context, a.prefill_len), n_batch=max(512, a.prefill_len),
                n_ubatch=max(512, a.prefill_len), n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    build_s = time.perf_counter() - t0

    def generate(prompt: list[int], new: int, stamps: list[float]) -> list[int]:
        llm.reset()
        llm.eval(prompt)
        out = []
        while len(out) < new:
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # greedy, as zoo's side
            stamps.append(time.perf_counter())
            out.append(tok)
            if len(out) < new:
                llm.eval([tok])
        return out

    prompt = _prompts(cfg.vocab_size, 1, a.prompt_len, 1)[0]
    generate(prompt[:8], 4, [])  # warm
    stamps: list[float] = []
    t0 = time.perf_counter()
    ids = generate(prompt, a.new_tokens, stamps)
    result = {"system": "llama.cpp", "base": a.base[0], "gguf_type": GGUF_NAMES[a.base[0]], "build_s": build_s,
              "prompt_s": stamps[0] - t0, "decode_tokens_per_s": _rate(stamps), "new_tokens": len(ids)}
    if a.prefill_len:
        long_prompt = _prompts(cfg.vocab_size, 1, a.prefill_len, 2)[0]
        llm.reset()
        llm.eval(long_prompt[:64])  # warm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(long_prompt)
        result["prefill_tokens_per_s"] = a.prefill_len / (time.perf_counter() - t0)
    result["peak_rss_mib"] = _peak_rss_mib()
    return result


def _run_worker(a, system: str, base: str, preset: str, gguf: Path, export: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "zoo.tools.bench_generate", "--preset", preset, "--base", base,
               "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens), "--prefill-len",
               str(a.prefill_len), "--batch", str(a.batch), "--context", str(a.context), "--threads", str(a.threads),
               "--worker", system, "--result", str(out), "--gguf", str(gguf)]
        if export:
            cmd += ["--export", str(gguf)]
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        load_before = _load()
        r = subprocess.run(cmd, env=env, check=False)
        if r.returncode:
            raise RuntimeError(f"bench_generate: the {system} worker ({preset}, {base}) failed (status {r.returncode})")
        result = json.loads(out.read_text())
        result.update(load_before=load_before, load_after=_load())
        return result


def _load() -> float | None:
    """The machine's 1-minute load average (None where the system has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _best(runs: list[dict], key: str):
    values = [r[key] for r in runs if r.get(key)]
    return max(values) if values else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", nargs="+", default=["smollm-135m", "tinyllama-1.1b"])
    ap.add_argument("--base", nargs="+", default=["bf16", "int8", "nf4"], choices=list(GGUF_TYPES),
                    help="formats of the weights (fp32: a plain model)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512, help="the prompt-processing test (0: none)")
    ap.add_argument("--batch", type=int, default=8, help="prompts of the batched test (zoo; 1: none)")
    ap.add_argument("--context", type=int, default=1024, help="max_seq_len the models are built with")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="zoo and llama.cpp runs in turn, each this many times")
    ap.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false",
                    help="zoo alone, even where llama-cpp-python is installed")
    ap.add_argument("--json", default="benchmarks/generate-vs-llama.cpp.json", metavar="FILE",
                    help="where the JSON goes ('' for nowhere)")
    ap.add_argument("--worker", choices=["zoo", "llama.cpp"], help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--export", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        result = zoo_worker(a, Path(a.result)) if a.worker == "zoo" else llama_worker(a, a.gguf)
        Path(a.result).write_text(json.dumps(result))
        return 0
    have_llama = False
    if a.llama_cpp:
        try:
            import llama_cpp  # noqa: F401

            have_llama = True
        except ImportError:
            print("bench_generate: llama-cpp-python is not installed: zoo alone (pip install llama-cpp-python)",
                  file=sys.stderr)
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in a.preset:
            for base in a.base:
                gguf = Path(tmp) / f"{preset}-{base}.gguf"
                runs: dict[str, list[dict]] = {"zoo": [], "llama.cpp": []}
                for rep in range(a.repeats):
                    for system in ["zoo"] + (["llama.cpp"] if have_llama else []):
                        print(f"bench_generate: {preset}, {base}, {system} ({rep + 1}/{a.repeats}) ...",
                              file=sys.stderr)
                        try:
                            runs[system].append(_run_worker(a, system, base, preset, gguf,
                                                            system == "zoo" and rep == 0))
                        except RuntimeError as e:  # the others still run; the table says what is missing
                            print(e, file=sys.stderr)
                            failed.append({"preset": preset, "base": base, "system": system, "repeat": rep + 1})
                gguf.unlink(missing_ok=True)
                rows.append({"preset": preset, "base": base, "runs": runs})
    _print_table(a, rows, have_llama)
    targets = _targets(a, rows, have_llama)
    _print_targets(targets)
    for f in failed:
        print(f"failed: {f['preset']} {f['base']}, {f['system']} run {f['repeat']}")
    if a.json:
        from zoo.core.atomic import write_json

        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(Path(a.json), {"schema": "zoo-bench-generate/3", "presets": a.preset, "prompt_len": a.prompt_len,
                                  "new_tokens": a.new_tokens, "prefill_len": a.prefill_len, "batch": a.batch,
                                  "threads": a.threads, "repeats": a.repeats, "cpu": cpu_info(),
                                  "cpus": os.cpu_count(), "llama_cpp": _llama_cpp_version() if have_llama else None,
                                  "results": rows, "targets": targets, "failed": failed})
        print(f"\nwrote {a.json}")
    return 0


def _llama_cpp_version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "unknown")


def _num(v) -> str:
    return f"{v:.1f}" if v else "-"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _loads(row: dict) -> str:
    """The load averages around a row's runs: lowest-highest."""
    values = [v for runs in row["runs"].values() for r in runs for v in (r.get("load_before"), r.get("load_after"))
              if v is not None]
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def _targets(a, rows: list[dict], have_llama: bool) -> list[dict]:
    """Issue 33's targets over the rows: what was measured against what was asked."""
    out = []
    for row in rows:
        z, l = row["runs"]["zoo"], row["runs"]["llama.cpp"]
        zd = _best(z, "decode_tokens_per_s")
        where = f"{row['preset']} {row['base']}"
        if have_llama and row["base"] in DECODE_TARGETS:
            ld = _best(l, "decode_tokens_per_s")
            out.append({"target": f"decode {where} vs {GGUF_NAMES[row['base']]}", "value": zd / ld if zd and ld else None,
                        "goal": DECODE_TARGETS[row["base"]]})
        if have_llama and a.prefill_len:
            zp, lp = _best(z, "prefill_tokens_per_s"), _best(l, "prefill_tokens_per_s")
            out.append({"target": f"prompt {a.prefill_len} {where}", "value": zp / lp if zp and lp else None,
                        "goal": PREFILL_TARGET})
        if a.batch > 1 and row["preset"] in BATCH_TARGET_PRESETS:
            zb = _best(z, "batch_tokens_per_s")
            out.append({"target": f"batch {a.batch} vs one {where}", "value": zb / zd if zb and zd else None,
                        "goal": BATCH_TARGET})
    for t in out:
        t["met"] = t["value"] is not None and t["value"] >= t["goal"]
    return out


def _print_targets(targets: list[dict]) -> None:
    if not targets:
        return
    met = sum(t["met"] for t in targets)
    print(f"\ntargets (issue 33): {met} of {len(targets)} met")
    for t in targets:
        value = f"{t['value']:.2f}x" if t["value"] is not None else "-"
        print(f"  {'met ' if t['met'] else 'MISS'}  {t['target']}: {value} (goal {t['goal']:.1f}x)")


def _print_table(a, rows: list[dict], have_llama: bool) -> None:
    print(f"## bench_generate: prompt {a.prompt_len} tokens then {a.new_tokens} new (greedy), prompt processing "
          f"{a.prefill_len} tokens, batch {a.batch}; {a.threads} threads; best of {a.repeats}\n")
    print("| model | zoo weights (products) | llama.cpp | decode tok/s zoo | llama.cpp | ratio | "
          f"prompt {a.prefill_len} tok/s zoo | llama.cpp | ratio | batch {a.batch} tok/s | vs one | peak RSS GiB | load |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        z, l = row["runs"]["zoo"], row["runs"]["llama.cpp"]
        if not z:
            print(f"| {row['preset']} | {row['base']} | - | (zoo failed) |")
            continue
        zd, ld = _best(z, "decode_tokens_per_s"), _best(l, "decode_tokens_per_s")
        zp, lp = _best(z, "prefill_tokens_per_s"), _best(l, "prefill_tokens_per_s")
        zb = _best(z, "batch_tokens_per_s")
        print(f"| {row['preset']} | {row['base']} ({z[0]['precision']}) | "
              f"{GGUF_NAMES[row['base']] if have_llama else '-'} | {_num(zd)} | {_num(ld)} | {_ratio(zd, ld)} | "
              f"{_num(zp)} | {_num(lp)} | {_ratio(zp, lp)} | {_num(zb)} | {_ratio(zb, zd)} | "
              f"{max(r['peak_rss_mib'] for r in z) / 1024:.2f} | {_loads(row)} |")


if __name__ == "__main__":
    sys.exit(main())
