"""The mutation check of the test suite (docs/testing.md): put one deliberate fault at a time into
zoo (a pullback's sign, a bf16 product run in fp32, an off-by-one in the attention mask, a wrong
memory term, a dropped bias on save, a skipped fsync, ...), run the tests expected to catch it,
and report which test failed first. A fault no test catches is a hole in the suite: the script
exits with status 1 and names it.

    .venv/bin/python tools/mutation_check.py                 # every fault
    .venv/bin/python tools/mutation_check.py --list          # what they are
    .venv/bin/python tools/mutation_check.py --only P3 N1    # some of them
    .venv/bin/python tools/mutation_check.py --json benchmarks/mutation_check.json

Faults are edits of the working tree, each undone before the next (and on any exit); a fault
in native/ rebuilds the native core (`pip install --no-build-isolation -e .`, incremental), and
the last one is followed by a rebuild of the clean tree. Run it on a tree with no uncommitted
changes to the files it edits (it refuses otherwise), and run nothing else from that tree
meanwhile. A fault whose text no longer appears where it is expected is reported as stale:
update its entry here. For each fault only the tests listed with it run (-x: to the first
failure); the whole suite per fault is not needed to show the catching test."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@dataclass(frozen=True)
class Fault:
    id: str
    what: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[tuple[str, ...], ...]  # pytest runs (their arguments), in turn until one fails

    @property
    def native(self) -> bool:
        return self.file.startswith("native/")


FAULTS = [
    # --- Python ---------------------------------------------------------------------------
    Fault("P1", "memory estimate: a LoRA run's AdamW keeps one moment, not two", "zoo/arch/memory.py",
          "gradients=FLOAT_BYTES * n, optimizer=2 * FLOAT_BYTES * moments,\n                          activations=",
          "gradients=FLOAT_BYTES * n, optimizer=FLOAT_BYTES * moments,\n                          activations=",
          (("tests/test_memory_estimate.py",),)),
    Fault("P2", "memory estimate: a frozen base counted in fp32 whatever its format", "zoo/arch/memory.py",
          "    rows, _ = frozen_table(parameter_layout(cfg), base_dtype)",
          "    rows, _ = frozen_table(parameter_layout(cfg), \"fp32\")",
          (("tests/test_memory_estimate.py",),)),
    Fault("P3", "atomic write: the file's bytes not fsynced before the rename", "zoo/core/atomic.py",
          "        f.flush()\n        os.fsync(f.fileno())\n        f.close()\n        os.replace(tmp, path)",
          "        f.flush()\n        f.close()\n        os.replace(tmp, path)",
          (("tests/test_atomic.py",),)),
    Fault("P4", "atomic write: the folder not fsynced after the rename", "zoo/core/atomic.py",
          "        raise\n    fsync_dir(path.parent)\n\n\n@contextmanager\ndef atomic_path",
          "        raise\n\n\n@contextmanager\ndef atomic_path",
          (("tests/test_atomic.py",),)),
    Fault("P5", "save_pretrained drops the biases", "zoo/io/checkpoints.py",
          "        for spec in parameter_layout(cfg)]",
          "        for spec in parameter_layout(cfg) if not spec.name.endswith(\".bias\")]",
          (("tests/test_checkpoints.py", "-k", "round_trips or identical_tensors"),)),
    Fault("P6", "pruning deletes a checkpoint where it stands (no rename aside first)", "zoo/train/run_folder.py",
          "    os.rename(folder, trash)\n    shutil.rmtree(trash, ignore_errors=True)",
          "    shutil.rmtree(folder, ignore_errors=True)",
          (("tests/test_kill9.py", "tests/test_fuzz_runs.py"),)),
    Fault("P7", "publishing the final model puts config.json first, not last", "zoo/train/run_folder.py",
          "        for name in sorted(names, key=lambda n: n in _LAST_FILES):",
          "        for name in sorted(names, key=lambda n: n not in _LAST_FILES):",
          (("tests/test_fuzz_runs.py", "-k", "publishing"), ("tests/test_kill9.py",))),
    Fault("P8", "learning-rate warmup one step behind", "zoo/train/config.py",
          "        return cfg.lr * (step + 1) / cfg.warmup_steps",
          "        return cfg.lr * step / cfg.warmup_steps",
          (("tests/test_trainer.py", "-k", "schedule"),)),
    Fault("P9", "top-k sampling keeps one token more", "zoo/generate.py",
          "        kth = np.partition(z, -top_k)[-top_k]",
          "        kth = np.partition(z, -top_k - 1)[-top_k - 1]",
          (("tests/test_generate.py",),)),
    Fault("P10", "packed examples' positions do not restart (an example sees the one before it)",
          "zoo/train/data.py",
          "                positions[r, at:at + n] = np.arange(n)",
          "                positions[r, at:at + n] = np.arange(at, at + n)",
          (("tests/test_instruct.py", "-k", "packed"), ("tests/test_packing.py",),)),
    Fault("P11", "prompt/completion records train on the prompt too", "zoo/train/data.py",
          "        ids, trained = self._encode_pieces([(prompt, False), (completion, True)])",
          "        ids, trained = self._encode_pieces([(prompt, True), (completion, True)])",
          (("tests/test_instruct.py", "-k", "completion"),)),
    Fault("P12", "LoRA scaling alpha instead of alpha / r", "zoo/arch/lora.py",
          "        return self.alpha / self.r", "        return self.alpha",
          (("tests/test_lora.py", "-k", "merged_model"), ("tests/test_lora_peft.py",),)),
    Fault("P13", "config.json's rope_theta ignored (10000 always)", "zoo/families/llama.py",
          "    theta = params.get(\"rope_theta\", hf.get(\"rope_theta\", 10000.0))",
          "    theta = 10000.0",
          (("tests/test_checkpoints.py", "-k", "parity"),)),
    Fault("P14", "GGUF import leaves llama.cpp's q/k row permutation in place", "zoo/io/gguf.py",
          "    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)",
          "    return w",
          (("tests/test_gguf.py", "-k", "permutation or round_trip"),)),
    Fault("P15", "data parallelism: each rank's share of a micro-batch weighted as all of it",
          "zoo/train/data.py",
          "        return BatchShare((rank * part, (rank + 1) * part), range(grad_accum), 1.0 / (grad_accum * ranks))",
          "        return BatchShare((rank * part, (rank + 1) * part), range(grad_accum), 1.0 / grad_accum)",
          (("tests/test_distributed.py", "-k", "batch_share"),)),
    Fault("P16", "a run too big for memory exits with status 1, not 3", "zoo/core/errors.py",
          "EXIT_RESOURCES = 3", "EXIT_RESOURCES = 1",
          (("tests/test_fuzz_cli.py", "-k", "documented"), ("tests/test_fuzz_bounds.py", "-k", "too_big"))),
    Fault("P17", "the memory check ignores $ZOO_MEMORY_AVAILABLE", "zoo/arch/memory.py",
          "    override = os.environ.get(AVAILABLE_ENV)", "    override = None",
          (("tests/test_fuzz_bounds.py", "-k", "memory or too_big"),)),
    Fault("P18", "Llama-named layout: k and v projections swapped in the arena", "zoo/families/llama.py",
          'qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")',
          'qkv=("self_attn.q_proj", "self_attn.v_proj", "self_attn.k_proj")',
          (("tests/test_model_parity.py", "-k", "zoo_only"),)),
    Fault("P19", "a resumed run keeps the metrics its killed run wrote past the checkpoint",
          "zoo/train/run_folder.py",
          "read_records(path, on_bad_line=dropped) if rec.step <= step]",
          "read_records(path, on_bad_line=dropped) if rec.step <= step + 1]",
          (("tests/test_trainer.py", "-k", "resume_is_exact"),)),
    Fault("P20", "safetensors: two tensors sharing bytes are accepted", "zoo/io/safetensors.py",
          "        if info.begin < at:\n            raise CheckpointError(path, f\"data_offsets",
          "        if False:\n            raise CheckpointError(path, f\"data_offsets",
          (("tests/test_fuzz_files.py", "-k", "overlapping"),)),
    # --- native (each rebuilds the native core) ---------------------------------------------
    Fault("N1", "LayerNorm pullback: the sign of the x-hat term", "native/blocks/layernorm.hpp",
          "dx[i] += rstd * (dy[i] * w[i] - mean_g - xhat * mean_gx);",
          "dx[i] += rstd * (dy[i] * w[i] - mean_g + xhat * mean_gx);",
          (("tests/test_blocks.py", "-k", "layernorm"),)),
    Fault("N2", "attention mask off by one: a packed row sees the last key of the example before it",
          "native/blocks/block.hpp",
          "    if (!pos) return {0, 0, 0};\n    const int first = t - pos[t];",
          "    if (!pos) return {0, 0, 0};\n    const int first = t - pos[t] > 0 ? t - pos[t] - 1 : 0;",
          (("tests/test_packing.py",),)),
    Fault("N3", "bf16 products run in fp32", "native/kernels/gemm.cpp",
          "    if (p == Precision::bf16) {\n#ifdef ZOO_GEMM_ONEDNN\n        onednn_gemm(",
          "    if (false) {\n#ifdef ZOO_GEMM_ONEDNN\n        onednn_gemm(",
          (("tests/test_bf16.py", "tests/test_lora.py", "-k", "bf16"),)),
    Fault("N4", "RoPE rotates the other way (forward and pullback alike)", "native/blocks/rope.hpp",
          "    out_a = a * c - b * s;\n    out_b = b * c + a * s;",
          "    out_a = a * c + b * s;\n    out_b = b * c - a * s;",
          (("tests/test_model_parity.py", "-k", "llama"),)),
    Fault("N5", "AdamW bias correction one step ahead", "native/blocks/adamw.hpp",
          "        const float c1 = 1.0f / (1.0f - std::pow(beta1, (float)step));",
          "        const float c1 = 1.0f / (1.0f - std::pow(beta1, (float)(step + 1)));",
          (("tests/test_blocks.py", "-k", "adamw"),)),
    Fault("N6", "cross-entropy: ignored targets counted in the mean", "native/blocks/cross_entropy.hpp",
          "            if (targets[n] != ignore_index) {", "            if (true) {",
          (("tests/test_blocks.py", "-k", "cross_entropy"),)),
    Fault("N7", "activation plan: the final norm's statistics dead in the pullback (their memory reused)",
          "native/executor/executor.cpp",
          "    take(&p.lnf_stats, \"lnf_stats\", stats * N, kAllPhases);",
          "    take(&p.lnf_stats, \"lnf_stats\", stats * N, kForward | kHead);",
          (("tests/test_plan.py",),)),
    Fault("N8", "GELU's forward with a wrong cubic coefficient (its pullback keeps the right one)",
          "native/blocks/gelu.hpp",
          "    return x * sigmoid(2.0f * (k * (x + 0.044715f * x * x * x)));",
          "    return x * sigmoid(2.0f * (k * (x + 0.04715f * x * x * x)));",
          (("tests/test_blocks.py", "-k", "gelu"),)),
]


def git_clean(path: Path) -> bool:
    r = subprocess.run(["git", "status", "--porcelain", "--", str(path)], cwd=ROOT, capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip() == ""


def rebuild() -> tuple[bool, str]:
    r = subprocess.run([PYTHON, "-m", "pip", "install", "-q", "--no-build-isolation", "-e", "."], cwd=ROOT,
                       capture_output=True, text=True)
    return r.returncode == 0, r.stdout + r.stderr


def run_tests(fault: Fault, timeout: float) -> tuple[str, str]:
    """(verdict, detail): "caught" and the first failing test, "survived", or "timeout"."""
    ran = 0
    for args in fault.tests:
        cmd = [PYTHON, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", *args]
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", f"pytest {' '.join(args)}: no result within {timeout:.0f} s"
        if r.returncode not in (0, 5):
            failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", r.stdout, re.M)
            return "caught", failed[0] if failed else r.stdout.strip().splitlines()[-1]
        ran += r.returncode == 0
    return "survived", "every listed test passed" if ran else "no test collected"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="ID", help="the faults to check (default: all)")
    p.add_argument("--list", action="store_true", help="list the faults and exit")
    p.add_argument("--timeout", type=float, default=1200, help="seconds for one fault's tests (default 1200)")
    p.add_argument("--json", metavar="FILE", help="write the results there as well")
    args = p.parse_args(argv)
    faults = [f for f in FAULTS if not args.only or f.id in args.only]
    if args.list:
        for f in faults:
            print(f"{f.id:4} {f.file:34} {f.what}")
        return 0
    dirty = sorted({f.file for f in faults if not git_clean(ROOT / f.file)})
    if dirty:
        print(f"mutation_check: uncommitted changes in {', '.join(dirty)}: commit or stash them first", file=sys.stderr)
        return 2
    results, needs_rebuild = [], False
    try:
        for f in faults:
            path = ROOT / f.file
            original = path.read_text()
            start = time.monotonic()
            if original.count(f.old) != 1:
                results.append({"id": f.id, "what": f.what, "file": f.file, "verdict": "stale",
                                "detail": f"its text occurs {original.count(f.old)} times in {f.file}", "seconds": 0})
                print(f"{f.id}: stale ({results[-1]['detail']})", flush=True)
                continue
            path.write_text(original.replace(f.old, f.new))
            try:
                if f.native:
                    needs_rebuild = True
                    built, log = rebuild()
                    verdict, detail = (run_tests(f, args.timeout) if built
                                       else ("invalid", "it does not build: " + log[-300:]))
                else:
                    verdict, detail = run_tests(f, args.timeout)
            finally:
                path.write_text(original)
            results.append({"id": f.id, "what": f.what, "file": f.file, "verdict": verdict, "detail": detail,
                            "seconds": round(time.monotonic() - start, 1)})
            print(f"{f.id}: {verdict}: {detail} ({results[-1]['seconds']} s)", flush=True)
    finally:
        if needs_rebuild:
            built, log = rebuild()
            if not built:
                print("mutation_check: the rebuild of the clean tree failed:\n" + log, file=sys.stderr)
    print("\n| fault | what | file | caught by |\n| --- | --- | --- | --- |")
    for r in results:
        by = r["detail"] if r["verdict"] == "caught" else f"**{r['verdict'].upper()}**: {r['detail']}"
        print(f"| {r['id']} | {r['what']} | `{r['file']}` | {by} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results}, indent=2) + "\n")
    missed = [r["id"] for r in results if r["verdict"] != "caught"]
    if missed:
        print(f"\nnot caught: {', '.join(missed)}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
