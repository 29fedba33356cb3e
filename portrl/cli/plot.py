"""``portrl plot RUN_DIR``: PNG curves (reward, accuracy, KL, entropy, length) from ``RUN_DIR/metrics.jsonl``."""

from __future__ import annotations

import sys


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", help="a run's output directory (holds metrics.jsonl)")


def run(args) -> int:
    from portrl.trainer.plot import plot_run

    try:
        paths = plot_run(args.run_dir)
    except FileNotFoundError as exc:
        print(f"portrl plot: {exc}", file=sys.stderr)
        return 2
    if not paths:
        print(f"portrl plot: {args.run_dir}/metrics.jsonl has none of the plotted metrics", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0
