"""zoo plot: a run's loss curves to RUN_DIR/loss.png."""

from __future__ import annotations

from ..train.plot import plot_run


def add_plot(sub) -> None:
    p = sub.add_parser("plot", help="plot a run's train and validation loss to RUN_DIR/loss.png")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(run=_cmd_plot)


def _cmd_plot(args) -> int:
    print(plot_run(args.run_dir))
    return 0
