"""The harness of the fuzz suites (tests/test_fuzz_*.py): every corrupted input runs in a
subprocess of its own, under a timeout and a memory cap, and must end in one clear error (or be
handled correctly), never in a crash, a traceback, a hang or a silently wrong result."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Generous for a tiny model on a busy 2-core CI runner; a hang is what exceeds it.
TIMEOUT_S = 60
# Address space per case: a tiny model needs a few hundred MB; an input that makes zoo reach for
# more (a vocabulary of 2e9) must be refused before it allocates, not die of MemoryError here.
MEMORY_CAP_BYTES = 6 << 30


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


def run(args: list[str], cwd: str | os.PathLike | None = None, env: dict | None = None,
        timeout: float = TIMEOUT_S, stdin: str | None = None) -> Result:
    """A command in its own process under the timeout and the memory cap; a hang fails the test."""
    try:
        p = subprocess.run(args, cwd=cwd, env=dict(os.environ, **(env or {})), input=stdin, capture_output=True,
                           text=True, timeout=timeout, preexec_fn=_cap_memory)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{' '.join(map(str, args))}: no answer within {timeout} s (a hang)") from None
    return Result(p.returncode, p.stdout, p.stderr)


def zoo(*args: str, **kw) -> Result:
    """`zoo ARGS...` (the command line's own entry point) in a subprocess."""
    return run([sys.executable, "-c", "import sys; from zoo.cli import main; sys.exit(main())", *map(str, args)],
               **kw)


def python(code: str, **kw) -> Result:
    """A Python snippet in a subprocess (for the library API)."""
    return run([sys.executable, "-c", code], **kw)


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
