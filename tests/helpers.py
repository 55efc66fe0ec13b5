"""What the test modules share, written once: where the shared data is, skip markers that say
what a test needs (an optional package, the shared data, a Clad build, bf16 dot products), the
one relative error the numeric tests bound, the tiny configs, and zoo run in a subprocess
under a timeout and a memory cap (the fuzz suites' harness, and every test that runs the
command line as a user does). Helpers that need PyTorch and transformers are in hf_helpers.py."""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import zoo
from zoo import ModelConfig, RopeScaling

# --- where things are ---------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
# The workspace's shared data is always ../shared/data from the repository root; tests that
# need it skip, naming the path, where it is not there.
SHARED_DATA = REPO.parent / "shared" / "data"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
LLAMA2_TOKENIZER = SHARED_DATA / "llama2-tokenizer.model"
STORIES = SHARED_DATA / "stories260K-hf"  # a Llama that transformers wrote, with no tokenizer files


def _not_here(paths) -> list[Path]:
    return [p for p in paths if not Path(p).exists()]


def needs_shared(*paths: Path) -> pytest.MarkDecorator:
    """Skips the test, naming what is missing, unless every path of the shared data is here."""
    missing = _not_here(paths)
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(map(str, missing))} is not here "
                                                    "(the shared data lives in ../shared/data beside the repository)")


def shared(path: Path) -> Path:
    """`path` of the shared data, or a skip naming it (for fixtures, where a marker cannot go)."""
    if _not_here([path]):
        pytest.skip(f"{path} is not here (the shared data lives in ../shared/data beside the repository)")
    return path


# --- optional packages and builds -----------------------------------------------------------


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skips the test unless every module imports: the finest grain, one test at a time."""
    missing = [m for m in modules if not installed(m)]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (the test extras: "
                                                    "pip install -e '.[dev]'; make test installs them)")


CLAD = bool(zoo.build_info()["clad"])
_clad_skip = pytest.mark.skipif(
    not CLAD, reason="this zoo was built without the Clad backend (zoo.build_info()['clad'] is False); "
                     "`make test-clad` builds it and runs the suite on it (docs/clad.md)")


def needs_clad(test):
    """A test of what only a Clad build has: marked `clad` (`pytest -m clad` selects them) and
    skipped in a build without Clad."""
    return pytest.mark.clad(_clad_skip(test))


without_clad = pytest.mark.skipif(
    CLAD, reason="this zoo has the Clad backend; what a build without it does is tested in a default build")

BF16 = bool(zoo.gemm_info()["bf16_native"])
needs_bf16 = pytest.mark.skipif(not BF16, reason="no bf16 dot products on this CPU (AVX512_BF16 or AMX-BF16)")

# Tests whose outcome depends on how the CPU's GEMM library rounds (the order of its sums):
# they compare with a reference run on the same machine or check the property that matters,
# and carry this marker so a failure on a new CPU is read with that in mind (docs/testing.md).
gemm_rounding = pytest.mark.gemm_rounding

# --- numbers -----------------------------------------------------------------------------


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|, in float64: the error the numeric tests bound."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    scale = np.abs(ref).max() if ref.size else 0.0
    return float(np.abs(got - ref).max() / scale) if scale > 0 else float(np.abs(got).max(initial=0.0))


def bf16_round(a) -> np.ndarray:
    """float32 rounded to bf16 (to nearest, ties to even; finite values), back in float32: what a
    bf16 product's operands hold."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def randomize_norms(model: "zoo.Model", seed: int, scale: float = 0.1) -> None:
    """Every 1-D parameter (norm weights around 1, biases around 0) made non-trivial, so each
    gradient path carries signal; matrices keep their init."""
    rng = np.random.default_rng(seed)
    for name, v in model.parameters().items():
        if v.ndim == 1:
            v[...] = (1.0 if "norm" in name or "ln" in name else 0.0) + scale * rng.standard_normal(v.shape)


def random_batch(cfg: ModelConfig, B: int = 3, T: int = 20, seed: int = 3, ignored: int = 3):
    """Random tokens and targets; the first `ignored` targets of row 0 are -100 (ignored)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    targets[0, :ignored] = -100
    return tokens, targets


def greedy_agrees(logits, chosen, tie: float = 1e-4) -> int:
    """Asserts that each chosen token is the top logit of its row, or within `tie` of it (a tie
    that a GEMM library's rounding may break either way). Returns the first row whose top two
    logits are within `tie` (len(chosen) if none): up to there, two greedy decoders of these
    logits must give the same tokens."""
    logits, chosen = np.asarray(logits), np.asarray(chosen)
    top = logits.max(axis=1)
    picked = logits[np.arange(len(chosen)), chosen]
    assert (picked >= top - tie).all(), f"not the top choice at positions {np.flatnonzero(picked < top - tie)}"
    ties = np.sort(logits, axis=1)[:, -2] >= top - tie
    return int(np.argmax(ties)) if ties.any() else len(chosen)


# The tiny configs the model-level tests share: GPT-2's blocks, and Llama's with GQA, a
# head_dim that is no power of two and Llama 3's RoPE scaling.
GPT2_TINY = ModelConfig(vocab_size=97, max_seq_len=32, d_model=48, n_layer=2, n_head=4, d_ff=96)
LLAMA_TINY = ModelConfig(
    vocab_size=101, max_seq_len=80, d_model=48, n_layer=2, n_head=6, n_kv_head=2, head_dim=12, d_ff=80,
    norm="rmsnorm", mlp="swiglu", positions="rope", rope_theta=500000.0, attention_bias=False,
    mlp_bias=False, tied_embeddings=False,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16))
RELU2_TINY = ModelConfig(vocab_size=64, max_seq_len=32, d_model=32, n_layer=2, n_head=4, d_ff=72, mlp="relu2")

# --- zoo in a process of its own -----------------------------------------------------------

# Generous for a tiny model on a busy 2-core machine; a hang is what exceeds it.
TIMEOUT_S = 60
# Address space per process: a tiny model needs a few hundred MB; an input that makes zoo reach
# for more (a vocabulary of 2e9) must be refused before it allocates, not die of MemoryError here.
MEMORY_CAP_BYTES = 6 << 30
CLI_MAIN = "import sys; from zoo.cli import main; sys.exit(main())"


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP_BYTES, MEMORY_CAP_BYTES))


def zoo_command(*args) -> list[str]:
    """The argv of `zoo ARGS...` run by this Python (the console script's own entry point)."""
    return [sys.executable, "-m", "zoo.cli", *map(str, args)]


def run(args: list, cwd: str | os.PathLike | None = None, env: dict | None = None, timeout: float = TIMEOUT_S,
        stdin: str | None = None) -> Result:
    """A command in a fresh process under the timeout and the memory cap; a hang fails the test."""
    try:
        p = subprocess.run(list(map(str, args)), cwd=cwd, env=dict(os.environ, **(env or {})), input=stdin,
                           capture_output=True, text=True, timeout=timeout, preexec_fn=_cap_memory)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{' '.join(map(str, args))}: no answer within {timeout} s (a hang)") from None
    return Result(p.returncode, p.stdout, p.stderr)


def python(code: str, *args, cwd: str | os.PathLike | None = None, env: dict | None = None,
           timeout: float = TIMEOUT_S, stdin: str | None = None, fresh: bool = False) -> Result:
    """`python -c CODE ARGS...` in a process of its own, under the timeout and the memory cap:
    forked from a process that has imported zoo already (_ForkServer: a fork costs a tenth of
    an interpreter's start), or a fresh interpreter where `fresh` or where `env` sets what an
    interpreter or a library reads as it starts (PYTHON*, OpenMP, BLAS, allocator variables)."""
    if fresh or any(k.startswith(_READ_AT_START) for k in env or {}):
        return run([sys.executable, "-c", code, *args], cwd=cwd, env=env, timeout=timeout, stdin=stdin)
    return _ForkServer.get().run(code, [str(a) for a in args], cwd, env, timeout, stdin)


def cli(*args, **kw) -> Result:
    """`zoo ARGS...` in a process of its own (python's keywords: cwd, env, timeout, stdin, fresh)."""
    return python(CLI_MAIN, *args, **kw)


_READ_AT_START = ("PYTHON", "OMP_", "GOMP_", "KMP_", "OPENBLAS_", "MKL_", "DNNL_", "ONEDNN_", "LD_", "MALLOC_")

# The fork server: a Python that has imported zoo.cli (and so zoo, numpy, pydantic, the native
# core) reads one request per line, forks, and the child becomes what `python -c CODE ARGS...`
# would be: its working folder, environment, standard streams, argv and memory cap, the code run
# as __main__, SystemExit and an uncaught exception ending it as they end an interpreter (exit
# functions run, streams flushed, 120 if that fails). It never runs zoo itself, so no OpenMP
# thread exists at a fork. Modules zoo.cli imports lazily (zoo.io.*, the trainer) are imported by
# each child, so a case's patch of them is in place before they are used, as in a fresh process.
_SERVER = r'''
import atexit, builtins, io, json, os, random, resource, sys, tempfile
import zoo.cli

def child(req):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None
    random.seed()
    resource.setrlimit(resource.RLIMIT_AS, (req["memory_cap"], req["memory_cap"]))
    fd = os.open(req["stdin"] or os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for n, path in ((1, req["stdout"]), (2, req["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, n)
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8")
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = ["-c", *req["args"]]
    try:
        exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            status = 120
    os._exit(status)

requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
for line in requests:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        requests.close()
        replies.close()
        child(req)
    replies.write(json.dumps({"pid": pid}) + "\n")
    replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
    replies.flush()
'''


class _ForkServer:
    """The one fork server of this test process, started at its first use, ended with it."""

    _instance: "_ForkServer | None" = None

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="zoo-fork-"))
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=REPO)

    @classmethod
    def get(cls) -> "_ForkServer":
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = cls()
            atexit.register(cls._instance.close)
        return cls._instance

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=TIMEOUT_S)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _reply(self, timeout: float) -> dict:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError
        line = self.proc.stdout.readline()
        assert line, f"the fork server ended (exit {self.proc.poll()})"
        return json.loads(line)

    def run(self, code, args, cwd, env, timeout, stdin) -> Result:
        stdin_file = None
        if stdin is not None:
            stdin_file = self.folder / "stdin"
            stdin_file.write_text(stdin)
        request = {"code": code, "args": args, "cwd": str(cwd or os.getcwd()), "env": dict(os.environ, **(env or {})),
                   "stdin": stdin_file and str(stdin_file), "stdout": str(self.folder / "stdout"),
                   "stderr": str(self.folder / "stderr"), "memory_cap": MEMORY_CAP_BYTES}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = self._reply(TIMEOUT_S)["pid"]
        try:
            status = self._reply(timeout)["status"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._reply(TIMEOUT_S)
            raise AssertionError(f"python -c {code[:200]!r} {' '.join(args)}: no answer within {timeout} s "
                                 "(a hang)") from None
        read = lambda name: (self.folder / name).read_text(errors="replace")  # noqa: E731
        return Result(status, read("stdout"), read("stderr"))


def assert_error(r: Result, *needles: str, status: int | None = None) -> str:
    """One `zoo: error: ...` line that names every needle (case-sensitive), exit status `status`
    (any failure if None), no traceback, no crash by signal. Returns the error line."""
    assert r.returncode > 0, f"expected a failure, got exit {r.returncode}\nstderr:\n{r.stderr}"
    assert "Traceback" not in r.stderr, f"a traceback:\n{r.stderr}"
    errors = [line for line in r.lines if line.startswith("zoo: error:")]
    assert len(errors) == 1, f"expected one 'zoo: error:' line:\n{r.stderr}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not named in: {errors[0]}"
    if status is not None:
        assert r.returncode == status, f"exit {r.returncode}, expected {status}: {errors[0]}"
    return errors[0]


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path
