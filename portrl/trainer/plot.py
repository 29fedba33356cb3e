"""PNG training curves from ``<run_dir>/metrics.jsonl`` (matplotlib, Agg backend: no display needed).

``plot_run(run_dir)`` writes one PNG per panel that has data, into ``<run_dir>/plots/``:
reward (train reward / score), accuracy (train and validation), KL (KL loss, PPO KL, KL in the
reward), entropy, and response length (mean, max); plus ``curves.png`` with all panels. A metric
absent from the file is left out; a panel without any of its metrics is not written.
"""

from __future__ import annotations

import os
from pathlib import Path

from portrl.trainer.tracking import read_metrics
from portrl.user_files import temp_name

#: panel name -> (title, y label, metric keys to draw when present)
PANELS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "reward": ("Reward", "mean per response", ("critic/rewards/mean", "critic/score/mean", "val/score/mean")),
    "accuracy": ("Accuracy", "share correct", ("critic/acc/mean", "val/acc/mean")),
    "kl": ("KL", "nats per token", ("actor/kl_loss", "actor/ppo_kl", "critic/kl")),
    "entropy": ("Entropy", "nats per token", ("actor/entropy",)),
    "length": ("Response length", "tokens", ("response_length/mean", "response_length/max", "val/response_length/mean")),
}


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _save(fig, path: Path) -> None:
    tmp = temp_name(path, suffix=path.suffix)  # savefig picks the format from the extension
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Write the curves of a run; returns the PNG paths written (``curves.png`` last)."""
    # matplotlib here, not at the top: its file-only Agg backend must be chosen before pyplot loads, and
    # importing this module (the trainer does) must not switch the backend of a notebook that imports portrl
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist; is {run_dir} a portrl run directory?")
    rows = [r for r in read_metrics(metrics) if "step" in r]
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    panels = {}
    for name, (title, ylabel, keys) in PANELS.items():
        series = {k: _series(rows, k) for k in keys}
        series = {k: s for k, s in series.items() if s[0]}
        if series:
            panels[name] = (title, ylabel, series)
    written: list[Path] = []
    for name, (title, ylabel, series) in panels.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        _draw(ax, title, ylabel, series)
        path = out_dir / f"{name}.png"
        _save(fig, path)
        plt.close(fig)
        written.append(path)
    if panels:
        cols = min(3, len(panels))
        nrows = (len(panels) + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
        flat = [ax for row in axes for ax in row]
        for ax, (title, ylabel, series) in zip(flat, panels.values()):
            _draw(ax, title, ylabel, series)
        for ax in flat[len(panels):]:
            ax.axis("off")
        fig.suptitle(run_dir.name)
        path = out_dir / "curves.png"
        _save(fig, path)
        plt.close(fig)
        written.append(path)
    return written


def _draw(ax, title: str, ylabel: str, series: dict) -> None:
    for key, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
