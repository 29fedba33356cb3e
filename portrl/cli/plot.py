"""``portrl plot RUN_DIR``: PNG curves (accuracy, reward, KL, entropy, response length, the critic's explained
variance) from ``RUN_DIR/metrics.jsonl``, written to ``RUN_DIR/plots/`` (which curves: portrl.trainer.plot); it
prints each PNG's path, then one line for each plot it did not draw and why. A file there that is not a portrl
plot is refused, or renamed aside with ``--on-existing move_aside``.

The plotting module is imported when the command runs, so that ``portrl --help`` and ``portrl plot --help`` stay fast.
"""

from __future__ import annotations

from pathlib import Path

from portrl.errors import UserError
from portrl.outputs import add_on_existing_argument


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", help="a run's output directory (holds metrics.jsonl)")
    add_on_existing_argument(parser)


def run(args) -> int:
    from portrl.trainer.plot import plot_run  # noqa: PLC0415  (CLI start-up: loaded by the command)

    metrics = Path(args.run_dir) / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{metrics} does not exist; give a run's output directory (trainer.output_dir, "
                        "which holds metrics.jsonl)")
    notes: list[str] = []
    paths = plot_run(args.run_dir, on_existing=args.on_existing, say=notes.append)
    if not paths:
        raise UserError(f"{metrics} has none of the plotted metrics (accuracy, reward, KL, entropy, response length, "
                        "critic) with a value; was the run logged with the jsonl logger (trainer.loggers)?")
    for p in paths:
        print(p)
    for line in notes:  # each panel not drawn, and why (its metrics absent, 0 throughout, drawn elsewhere)
        print(line)
    return 0

