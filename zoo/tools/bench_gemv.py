"""`python -m zoo.tools.bench_gemv`: the decode products (native/kernels/gemv.hpp) alone, one
stored matrix of --rows x --cols in each --format, M rows of x for each --rows-of-x, on one
thread (or --parallel, over --threads), in a bf16 product (a narrow base's default precision).

Prints, per format and M, the fastest of --repeats calls (default: enough for about 2 GB of W),
then W's values a second (the bound where memory is: int8 reads 1 byte each, nf4 about 0.53,
bf16 2) and the multiply-adds a second (the bound where the arithmetic is). A matrix far larger
than the caches (the default, 16384 x 4096: 64 MB in int8) reads W from DRAM every call, as
generation does; one of a few MB (--rows 1024 --cols 2048) stays in L2 and shows the kernels'
arithmetic. Timings on a shared machine are noisy: compare builds in turn in one command."""

from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", nargs="+", default=["int8", "nf4", "bf16"], choices=["fp32", "bf16", "int8", "nf4"])
    ap.add_argument("--rows-of-x", nargs="+", type=int, default=[1, 8], metavar="M")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--isa", default=None, help="instruction set (default: the best built in and supported)")
    ap.add_argument("--parallel", action="store_true", help="split the rows over the threads, as generation does")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=0, help="calls timed (default: enough for about 2 GB of W)")
    a = ap.parse_args(argv)

    import numpy as np

    import zoo
    from zoo.core.native import _native

    zoo.set_threads(a.threads)
    isa = a.isa or _native.decode_isas()[-1]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((a.rows, a.cols), dtype=np.float32)
    values = a.rows * a.cols
    repeats = a.repeats or max(8, int(2e9 / values))
    print(f"W {a.rows} x {a.cols}, {isa}, {'parallel' if a.parallel else 'one thread'}, best of {repeats}; "
          f"load {os.getloadavg()[0]:.2f}")
    for fmt in a.format:
        for M in a.rows_of_x:
            x = rng.standard_normal((M, a.cols)).astype(np.float32)
            _, best, _ = _native.decode_product(x, w, fmt, "bf16", isa, repeats=repeats, parallel=a.parallel)
            per_s = 1 / best if best > 0 else float("inf")  # a tiny product can take under the clock's tick
            print(f"{fmt:5s} M={M}: {best * 1e3:8.3f} ms  {values * per_s / 1e9:6.1f} G values/s  "
                  f"{values * M * per_s / 1e9:6.1f} G multiply-adds/s")


if __name__ == "__main__":
    main()
