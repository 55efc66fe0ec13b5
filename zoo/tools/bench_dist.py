"""Data-parallel scaling on this machine: one process with all the threads against N ranks
(mpirun) sharing them, on the same global batch, side by side in each round.

    python -m zoo.tools.bench_dist --preset gpt2 --batch-size 8 --seq-len 64 --ranks 2 \\
        --steps 5 --warmup 2 --rounds 3 --json benchmarks/dist-gpt2-b8-t64.json

Systems, each a fresh process group, in turn in every round:
  single   1 process x (ranks x threads-per-rank) threads: zero_grads, forward_backward over the
           whole batch, adamw_step (clipping 1.0): zoo bench's step.
  dp       `ranks` ranks x threads-per-rank threads (started as zoo launch starts them): each the
           forward_backward of its rows, the all-reduce of the gradient block in buckets, the
           squared norm of its shard summed across ranks, adamw_step by that norm: the trainer's step.
  zero1    the same with ZeRO-1: a reduce to each shard's owner, AdamW over the own shard of the
           moments, an all-gather of the weights.
Reported per system: median step time (rank 0's; the ranks wait for each other every step),
tokens/s, the time of each phase, the peak resident memory (VmHWM) of every rank and the bytes
of its AdamW moments. For dp, an overlap probe: the all-reduce of a copy of the gradient block
run in a second thread while forward_backward runs, against the two one after the other, which
is the most that overlapping the reduction with the backward could save here. Finally a cost
model: bytes each rank moves per step for every preset, and the scaling efficiency expected on
10, 25 and 100 Gb/s links (docs/distributed.md).

The table goes to stdout, progress to stderr, the numbers as JSON to --json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional

SYSTEMS = ("single", "dp", "zero1")


# --- the worker (one process, or each rank) ----------------------------------------------


def _peak_rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _worker(args) -> None:
    import numpy as np

    import zoo
    from zoo.train import distributed

    group = distributed.world() if args.mode != "single" else None
    zoo.set_threads(args.threads)
    rank, ranks = (0, 1) if group is None else (group.rank, group.size)
    cfg = zoo.preset(args.preset)
    model = zoo.Model(cfg, seed=0)
    n = model.n_params
    data = np.random.default_rng(1).integers(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1)).astype(np.int32)
    rows = args.batch_size // ranks
    x = np.ascontiguousarray(data[rank * rows:(rank + 1) * rows, :-1])
    y = np.ascontiguousarray(data[rank * rows:(rank + 1) * rows, 1:])
    bounds = distributed.shard_bounds(0, n, ranks)
    shard = (bounds[rank], bounds[rank + 1])
    if args.mode == "zero1":
        model.set_moment_range(*shard)
    phases = {"forward_backward": [], "reduce": [], "update": [], "gather": []}

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        model.zero_grads()
        loss = model.forward_backward(x, y, 1.0 / ranks) / ranks  # the ranks' parts add up to the batch's mean
        t1 = time.perf_counter()
        norm = None
        if group is not None:
            if args.mode == "zero1":
                model.reduce_gradients(lambda b: group.reduce_to_owners("the gradient exchange", b, bounds))
            else:
                model.reduce_gradients(lambda b: group.all_reduce("the gradient exchange", b))
        t2 = time.perf_counter()
        if group is not None:
            loss, sumsq = group.sum("the loss", [loss, model.grad_sum_squares(*shard)])
            norm = float(np.sqrt(sumsq))
        model.adamw_step(1e-4, 0.9, 0.95, 1e-8, 0.1, 1.0, grad_norm=norm)
        t3 = time.perf_counter()
        if args.mode == "zero1":
            group.all_gather("the weights", model.parameter_block(), bounds)
        t4 = time.perf_counter()
        for name, t in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[name].append(t)
        return float(loss), t4 - t0

    for _ in range(args.warmup):
        step()
    for p in phases.values():
        p.clear()
    losses, times = zip(*(step() for _ in range(args.steps)))
    result = {"step_s": list(times), "losses": list(losses), "phases_s": phases, "threads": zoo.get_threads(),
              "ranks": ranks}
    me = {"rank": rank, "peak_rss_mib": _peak_rss_mib(),  # before the probe's extra block
          "moment_bytes": 8 * (model.moment_range[1] - model.moment_range[0])}
    if args.mode == "dp" and args.overlap_probe:
        result["overlap_probe"] = _overlap_probe(model, group, x, y, ranks, args.steps)
    everyone = group.gather("the statistics", me) if group is not None else [me]
    if rank == 0:
        result["per_rank"] = everyone
        print(json.dumps(result), flush=True)
    if group is not None:
        group.barrier("the end")


def _overlap_probe(model, group, x, y, ranks: int, steps: int) -> dict:
    """forward_backward, and the all-reduce of a block as large as the gradients: one after the
    other, and at once (the reduction in a second thread, as an overlapped step would run it)."""
    import numpy as np

    block = np.ones(model.n_params, np.float32)
    sequential, concurrent = [], []
    for _ in range(steps):
        group.barrier("the probe")
        t0 = time.perf_counter()
        model.zero_grads()
        model.forward_backward(x, y, 1.0 / ranks)
        group.all_reduce("the probe's all-reduce", block)
        sequential.append(time.perf_counter() - t0)
        group.barrier("the probe")
        t0 = time.perf_counter()
        reduce = threading.Thread(target=group.all_reduce, args=("the probe's all-reduce", block))
        reduce.start()
        model.zero_grads()
        model.forward_backward(x, y, 1.0 / ranks)
        reduce.join()
        concurrent.append(time.perf_counter() - t0)
    return {"sequential_s": sequential, "concurrent_s": concurrent}


# --- the driver -------------------------------------------------------------------------


def _run(mode: str, args) -> dict:
    from zoo.train import launch

    worker = ["--worker", mode, "--preset", args.preset, "--batch-size", str(args.batch_size),
              "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if mode == "single":
        cmd = [sys.executable, "-m", "zoo.tools.bench_dist", *worker, "--threads",
               str(args.ranks * args.threads_per_rank)]
        env = dict(os.environ)
    else:
        mpirun = launch.find_mpirun(args.mpirun)
        cmd, env = launch.launch_command(mpirun, args.ranks, [], launch.is_open_mpi(mpirun))
        probe = ["--overlap-probe"] if mode == "dp" else []
        cmd = cmd[:cmd.index(sys.executable)] + [sys.executable, "-m", "zoo.tools.bench_dist", *worker, "--threads",
                                                 str(args.threads_per_rank), *probe]
    print(f"bench_dist: {mode}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"bench_dist: {mode} failed with status {p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def summarize(runs: dict[str, list[dict]], args) -> dict:
    tokens = args.batch_size * args.seq_len
    systems = {}
    for mode, rounds in runs.items():
        steps = [t for r in rounds for t in r["step_s"]]
        s = {"ranks": rounds[0]["ranks"], "threads_per_rank": rounds[0]["threads"],
             "median_ms": _median_ms(steps), "min_ms": 1e3 * min(steps), "max_ms": 1e3 * max(steps),
             "tokens_per_s": tokens / statistics.median(steps),
             "phases_median_ms": {k: _median_ms([t for r in rounds for t in r["phases_s"][k]])
                                  for k in rounds[0]["phases_s"] if rounds[0]["phases_s"][k]},
             "per_rank": [{"rank": x["rank"], "peak_rss_mib": max(r["per_rank"][i]["peak_rss_mib"] for r in rounds),
                           "moment_mib": x["moment_bytes"] / 2**20} for i, x in enumerate(rounds[0]["per_rank"])],
             "loss_first": rounds[0]["losses"][0]}
        if "overlap_probe" in rounds[0]:
            s["overlap_probe_median_ms"] = {k: _median_ms([t for r in rounds for t in r["overlap_probe"][k]])
                                            for k in ("sequential_s", "concurrent_s")}
        systems[mode] = s
    by_round = [{m: tokens / statistics.median(runs[m][i]["step_s"]) for m in runs} for i in range(args.rounds)]
    ratios = {m: systems[m]["tokens_per_s"] / systems["single"]["tokens_per_s"] for m in systems if m != "single"}
    return {"systems": systems, "ratios_vs_single": ratios,
            "ratios_by_round": [{m: r[m] / r["single"] for m in r if m != "single"} for r in by_round]}


def cost_model(n_params_of: dict[str, int], ranks: int, step_s_per_param: float, links_gbps: list[float]) -> list[dict]:
    """Per preset: bytes each rank sends (and receives) per step for a ring all-reduce of the
    float32 gradients (ZeRO-1's reduce-scatter and all-gather move the same), and the scaling
    efficiency compute / (compute + communication) with no overlap: compute, this machine's
    measured step time per parameter (same tokens per rank); communication, those bytes at the
    link's rate (one rank per host: the link carries them all)."""
    rows = []
    for name, n in n_params_of.items():
        sent = 2 * (ranks - 1) / ranks * 4 * n
        compute = step_s_per_param * n
        row = {"preset": name, "parameters": n, "gradient_mib": 4 * n / 2**20, "sent_per_rank_mib": sent / 2**20,
               "compute_s": compute}
        for link in links_gbps:
            comm = sent / (link * 1e9 / 8)
            row[f"comm_{link:g}gbps_s"] = comm
            row[f"efficiency_{link:g}gbps"] = compute / (compute + comm)
        rows.append(row)
    return rows


def render(r: dict) -> str:
    s = r["systems"]
    lines = [f"Data parallelism: {r['model']}, global batch {r['batch']} x {r['seq_len']}, {r['steps']} steps x "
             f"{r['rounds']} rounds, medians",
             "", "| system | ranks x threads | step ms | tokens/s | vs single | forward+backward ms | reduce ms | "
                 "update ms | gather ms | peak RSS per rank MiB | moments per rank MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in SYSTEMS:
        x = s[m]
        ph = x["phases_median_ms"]
        ratio = "1" if m == "single" else f"{r['ratios_vs_single'][m]:.3f}"
        lines.append(f"| {m} | {x['ranks']} x {x['threads_per_rank']} | {x['median_ms']:.0f} | "
                     f"{x['tokens_per_s']:.0f} | {ratio} | {ph['forward_backward']:.0f} | {ph.get('reduce', 0):.0f} | "
                     f"{ph['update']:.0f} | {ph.get('gather', 0):.0f} | "
                     f"{', '.join(format(p['peak_rss_mib'], '.0f') for p in x['per_rank'])} | "
                     f"{', '.join(format(p['moment_mib'], '.0f') for p in x['per_rank'])} |")
    lines.append("")
    lines.append("Ratios by round (dp, zero1 vs single): " + "; ".join(
        f"{x['dp']:.3f}, {x['zero1']:.3f}" for x in r["ratios_by_round"]))
    # On a machine others use too, each system's fastest step is the one least disturbed.
    lines.append("Ratios of the fastest steps (dp, zero1 vs single): " + ", ".join(
        f"{s['single']['min_ms'] / s[m]['min_ms']:.3f}" for m in ("dp", "zero1")))
    probe = s["dp"].get("overlap_probe_median_ms")
    if probe:
        lines.append(f"Overlap probe (dp, per rank): forward+backward then the all-reduce "
                     f"{probe['sequential_s']:.0f} ms; both at once {probe['concurrent_s']:.0f} ms")
    lines.append(f"All-reduce of {r['gradient_mib']:.0f} MiB on this host: "
                 f"{s['dp']['phases_median_ms']['reduce']:.0f} ms, {r['allreduce_gbps']:.1f} Gb/s per rank "
                 "(bus rate: bytes a rank sends / time)")
    lines += ["", f"Cost model, {r['cost_ranks']} ranks on {r['cost_ranks']} hosts: per step each rank sends and "
                  "receives the bytes below (ring all-reduce) over its host's link; efficiency = compute / (compute + "
                  "communication), no overlap, compute from this machine's step time per parameter at "
                  f"{r['batch'] // r['systems']['dp']['ranks']} x {r['seq_len']} tokens per rank",
              "", "| preset | parameters | sent per rank MiB | compute s | " +
              " | ".join(f"{g:g} Gb/s" for g in r["links_gbps"]) + " |",
              "|---|---|---|---|" + "---|" * len(r["links_gbps"])]
    for row in r["cost_model"]:
        lines.append(f"| {row['preset']} | {row['parameters']:,} | {row['sent_per_rank_mib']:.0f} | "
                     f"{row['compute_s']:.2f} | " +
                     " | ".join(f"{row[f'efficiency_{g:g}gbps']:.2f}" for g in r["links_gbps"]) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    from ..arch.layout import num_parameters

    p = argparse.ArgumentParser(prog="python -m zoo.tools.bench_dist", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (split across the ranks)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads-per-rank", type=int, default=1, help="single runs ranks x this many threads")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--links", default="10,25,100", help="link rates for the cost model, Gb/s")
    p.add_argument("--cost-ranks", type=int, default=8, help="ranks (one per host) the cost model assumes")
    p.add_argument("--mpirun", default=None)
    p.add_argument("--json", metavar="FILE", default=None)
    p.add_argument("--worker", choices=SYSTEMS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--overlap-probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.mode = args.worker
        _worker(args)
        return 0
    if args.batch_size % args.ranks:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --ranks {args.ranks}")

    import zoo
    from zoo.arch.presets import PRESETS

    runs: dict[str, list[dict]] = {m: [] for m in SYSTEMS}
    for i in range(args.rounds):
        print(f"bench_dist: round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for mode in SYSTEMS:
            runs[mode].append(_run(mode, args))
    command = "python -m zoo.tools.bench_dist " + " ".join(argv if argv is not None else sys.argv[1:])
    r = {"schema": "zoo-bench-dist/1", "command": command,  # not zoo-bench/: zoo cards skips it
         "date": datetime.date.today().isoformat(), "model": args.preset, "batch": args.batch_size,
         "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
         "cpus": os.cpu_count(), **summarize(runs, args)}
    n = num_parameters(zoo.preset(args.preset))
    dp = r["systems"]["dp"]
    reduce_s = dp["phases_median_ms"]["reduce"] / 1e3
    sent = 2 * (args.ranks - 1) / args.ranks * 4 * n
    r["gradient_mib"] = 4 * n / 2**20
    r["allreduce_gbps"] = sent * 8 / reduce_s / 1e9
    # Compute per parameter: the dp step without its communication (same tokens per rank).
    compute_s = (dp["median_ms"] - dp["phases_median_ms"]["reduce"]) / 1e3
    r["links_gbps"] = [float(x) for x in args.links.split(",")]
    r["cost_ranks"] = args.cost_ranks
    r["cost_model"] = cost_model({p.name: num_parameters(p.config) for p in PRESETS if not p.name.startswith("tiny-")},
                                 args.cost_ranks, compute_s / n, r["links_gbps"])
    print(render(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
