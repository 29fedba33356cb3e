"""PNG training curves from ``<run_dir>/metrics.jsonl`` (matplotlib, Agg backend: no display needed).

``plot_run(run_dir)`` writes one PNG per panel that has data, into ``<run_dir>/plots/``: accuracy (training and
validation), reward, KL divergence, entropy, response length and, in a run with a critic, the share of the returns'
variance the critic explains; plus ``curves.png`` with all panels. Each PNG carries the text chunk
``Software: portrl plot`` (:data:`MARKER`): a plot with it is rewritten; any other file at a plot's path is
refused (portrl.outputs.claim) unless ``on_existing="move_aside"``. Which curves are drawn is decided by
:func:`select_panels`, from the metrics alone:

* a curve is named in words (``training accuracy``), not by its metric key (``critic/acc/mean``, verl's name,
  which every run logs, with a critic or without); legends sit below their panel, off the curves;
* a metric absent from the file is left out, and so is a KL term that is 0 at every step (below ZERO, float
  noise: an on-policy run's PPO KL, a KL that is not in use); a panel left with no curve is not drawn;
* a curve equal at every step to another of its panel is not drawn again (it would hide under it): the first
  one's legend names both; a panel all of whose curves equal curves of an earlier panel (a 0/1 rule reward is
  the accuracy) is not drawn, and that panel's legends name them: ``training accuracy (= training reward)``;
* training curves are solid with round markers, validation curves dashed with square markers, a secondary
  training curve (the maximum length, the PPO KL) dotted with triangles, so that overlapping curves stay
  distinguishable;
* a panel that is not drawn is said in one line (:func:`left_out`: its metrics are absent, 0 throughout, or equal
  to curves drawn elsewhere), to ``say`` (the log; ``portrl plot`` prints them).

Axes read at a glance: tick labels are plain numbers, never an offset or a shared exponent (``1e-5+1.1751e1``);
a curve that barely moves (an entropy steady to the fifth digit) is drawn flat on an axis at least
:data:`MIN_SPAN` of its size tall, not magnified into noise; an axis of shares (accuracy) stays within
:data:`LIMITS`, [0, 1]. The overview (``curves.png``) is titled with the run's folder, as given (relative to the
working directory when inside it); each single plot carries it too, under its panel title.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from portrl.outputs import claim
from portrl.trainer.tracking import read_metrics
from portrl.user_files import temp_name

log = logging.getLogger(__name__)

TRAIN, VAL, EXTRA = "train", "val", "extra"

#: curve style -> matplotlib keywords (markers are drawn where a curve has at most MARKERS_UP_TO points)
STYLES = {TRAIN: {"linestyle": "-", "marker": "o"}, VAL: {"linestyle": "--", "marker": "s"},
          EXTRA: {"linestyle": ":", "marker": "^"}}
MARKERS_UP_TO = 40


#: the PNG text chunk (keyword, text) that marks a plot as written by portrl; matplotlib writes it before IDAT
MARKER = ("Software", "portrl plot")

#: a KL term whose absolute value stays below this at every step is not in use (or is float noise)
ZERO = 1e-6

#: a y axis spans at least this share of its largest value: a curve steady to the fifth digit is drawn flat
MIN_SPAN = 0.05

#: panel -> the (low, high) its y axis stays within (a share is never below 0 or above 1)
LIMITS: dict[str, Tuple[float, float]] = {"accuracy": (0.0, 1.0)}


@dataclass(frozen=True)
class Curve:
    """One metric a panel may draw: its key in metrics.jsonl, its legend in words, its style. ``zero_is_off``: a
    curve that is 0 (below ZERO) at every step is left out (a KL term; a zero accuracy is a result and is drawn).
    ``only_if_new``: a curve equal to another of its panel is dropped silently, its name not added to the other's
    legend (the reward after a KL penalty equals the score when there is no penalty: naming it would say there is
    one)."""

    key: str
    label: str
    style: str = TRAIN
    zero_is_off: bool = False
    only_if_new: bool = False


#: panel name (the PNG's name) -> (title, y label, curves), in drawing order
PANELS: dict[str, tuple[str, str, tuple[Curve, ...]]] = {
    "accuracy": ("Accuracy", "share correct", (
        Curve("critic/acc/mean", "training accuracy"),
        Curve("val/acc/mean", "validation accuracy", VAL))),
    "reward": ("Reward", "mean per response", (
        Curve("critic/score/mean", "training reward"),
        Curve("critic/rewards/mean", "training reward less the KL penalty", EXTRA, only_if_new=True),
        Curve("val/score/mean", "validation reward", VAL))),
    "kl": ("KL divergence", "nats per token", (
        Curve("actor/kl_loss", "policy to reference (KL loss)", zero_is_off=True),
        Curve("actor/reward_kl_penalty", "policy to reference (KL penalty in the reward)", zero_is_off=True),
        Curve("actor/ppo_kl", "rollout policy to updated policy (PPO)", EXTRA, zero_is_off=True))),
    "entropy": ("Entropy", "nats per token", (
        Curve("actor/entropy", "policy entropy on training responses"),)),
    "length": ("Response length", "tokens", (
        Curve("response_length/mean", "training mean"),
        Curve("response_length/max", "training maximum", EXTRA),
        Curve("val/response_length/mean", "validation mean", VAL))),
    "critic": ("Critic", "explained variance", (
        Curve("critic/vf_explained_var", "share of the returns' variance the critic explains"),)),
}


@dataclass
class Series:
    """A curve to draw: its points, and the labels of the curves it stands for (itself first)."""

    curve: Curve
    xs: List[int]
    ys: List[float]
    also: List[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.curve.label + (f" (= {', '.join(self.also)})" if self.also else "")


@dataclass
class Panel:
    name: str
    title: str
    ylabel: str
    series: List[Series]


def _points(rows: list[dict], key: str) -> Tuple[List[int], List[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _same(a: Series, xs: List[int], ys: List[float]) -> bool:
    return a.xs == xs and all(math.isclose(p, q, rel_tol=1e-9, abs_tol=1e-12) for p, q in zip(a.ys, ys))


def select_panels(rows: list[dict]) -> List[Panel]:
    """The panels and curves to draw for these metrics rows (each with a ``step``), by the rules of the module
    docstring."""
    panels: List[Panel] = []
    for name, (title, ylabel, curves) in PANELS.items():
        series: List[Series] = []
        for curve in curves:
            xs, ys = _points(rows, curve.key)
            if not xs or curve.zero_is_off and all(abs(y) < ZERO for y in ys):
                continue
            twin = next((s for s in series if _same(s, xs, ys)), None)
            if twin is None:
                series.append(Series(curve, xs, ys))
            elif not curve.only_if_new:
                twin.also.append(curve.label)
        earlier = [s for p in panels for s in p.series]
        twins = [next((e for e in earlier if _same(e, s.xs, s.ys)), None) for s in series]
        if series and all(twins):  # the whole panel repeats curves already drawn: name them there instead
            for s, twin in zip(series, twins):
                if twin is not None:  # all are (checked above)
                    twin.also.extend([s.curve.label, *s.also])
        elif series:
            panels.append(Panel(name, title, ylabel, series))
    return panels


def left_out(rows: list[dict], panels: List[Panel]) -> List[str]:
    """One line for each panel of :data:`PANELS` that ``panels`` (:func:`select_panels` of ``rows``) does not draw,
    saying why: its metrics are absent from the run's metrics, 0 at every step, or equal to curves drawn in
    another panel."""
    drawn = {p.name for p in panels}
    lines = []
    for name, (title, _ylabel, panel_curves) in PANELS.items():
        if name in drawn:
            continue
        keys = [c.key for c in panel_curves]
        logged = [c for c in panel_curves if _points(rows, c.key)[0]]
        if not logged:
            why = f"the run logged no {' or '.join(keys)}" + (" (it has no critic)" if name == "critic" else "")
        elif all(c.zero_is_off and all(abs(y) < ZERO for y in _points(rows, c.key)[1]) for c in logged):
            are = "is" if len(logged) == 1 else "are"
            why = f"{' and '.join(c.key for c in logged)} {are} 0 at every step (not in use, or the policy did not move)"
        else:
            where = sorted({p.title.lower() for p in panels for s in p.series
                            if any(c.label in s.also for c in logged)})
            why = f"its curves equal curves of the {' and '.join(where) or 'other'} plot (named in its legend)"
        words = title if title[:2].isupper() else title[0].lower() + title[1:]  # "KL divergence" keeps its capitals
        lines.append(f"no {words} plot: {why}")
    return lines


def run_title(run_dir: str | os.PathLike) -> str:
    """The run's folder as a title: relative to the working directory when inside it (``outputs/run``), else
    absolute with ``~`` for the home folder."""
    path = Path(run_dir).expanduser().absolute()
    try:
        return str(Path(os.path.normpath(path)).relative_to(Path.cwd()))
    except ValueError:
        text, home = os.path.normpath(path), os.path.expanduser("~")
        return "~" + text[len(home):] if home not in ("", "/") and text.startswith(home + os.sep) else text


def _save(fig, path: Path) -> None:
    tmp = temp_name(path, suffix=path.suffix)  # savefig picks the format from the extension
    fig.savefig(tmp, dpi=110, metadata={MARKER[0]: MARKER[1]})
    os.replace(tmp, path)  # claimed by plot_run: absent, or a plot of ours


def is_portrl_plot(path: Path) -> bool:
    """``path`` is a PNG with portrl's :data:`MARKER` text chunk (read from its first 64 KiB)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 16)
    except OSError:
        return False
    chunk = b"tEXt" + MARKER[0].encode() + b"\0" + MARKER[1].encode()
    return head.startswith(b"\x89PNG\r\n\x1a\n") and chunk in head


def plot_run(run_dir: str | os.PathLike, on_existing: str = "refuse",
             say: Optional[Callable[[str], None]] = None) -> list[Path]:
    """Write the curves of a run; returns the PNG paths written (``curves.png`` last). Each path is claimed
    before anything is drawn: absent or a portrl plot, else refused or (``move_aside``) renamed aside. ``say``
    gets one line per panel not drawn (:func:`left_out`; default: an INFO log line)."""
    # matplotlib here, not at the top: its file-only Agg backend must be chosen before pyplot loads, and
    # importing this module (the trainer does) must not switch the backend of a notebook that imports portrl
    import matplotlib  # noqa: PLC0415  (matplotlib: only when a plot is drawn)

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # noqa: PLC0415  (matplotlib: only when a plot is drawn)

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist; is {run_dir} a portrl run directory?")
    rows = [r for r in read_metrics(metrics) if "step" in r]
    panels = select_panels(rows)
    title = run_title(run_dir)
    out_dir = run_dir / "plots"
    names = [p.name for p in panels] + (["curves"] if panels else [])
    for name in names:
        claim(out_dir / f"{name}.png", "the plot", on_existing, ours=is_portrl_plot)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    figures = [(panel.name, panel_figure(plt, panel, title)) for panel in panels]
    if panels:
        figures.append(("curves", overview_figure(plt, panels, title)))
    for name, fig in figures:
        path = out_dir / f"{name}.png"
        _save(fig, path)
        plt.close(fig)
        written.append(path)
    for line in left_out(rows, panels):
        (say or log.info)(line)
    return written


def panel_figure(plt, panel: Panel, title: str):
    """One panel's figure (``plt``: matplotlib.pyplot), the run's folder ``title`` under the panel's title."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")  # constrained: no label over a title
    _draw(ax, panel)
    ax.set_title(f"{panel.title}\n{title}", fontsize=11)
    return fig


def overview_figure(plt, panels: List[Panel], title: str):
    """Every panel in one figure, titled with the run's folder once."""
    cols = 2 if len(panels) == 4 else min(3, len(panels))  # 2 x 2 rather than 3 + 1
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.6 * cols, 4.2 * nrows), squeeze=False, layout="constrained")
    flat = [ax for row in axes for ax in row]
    for ax, panel in zip(flat, panels):
        _draw(ax, panel)
    for ax in flat[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    return fig


def _draw(ax, panel: Panel) -> None:
    from matplotlib.ticker import MaxNLocator, ScalarFormatter  # noqa: PLC0415  (matplotlib: only when a plot is drawn)

    for s in panel.series:
        style: dict[str, object] = dict(STYLES[s.curve.style])
        if len(s.xs) > MARKERS_UP_TO:
            style["marker"] = None
        ax.plot(s.xs, s.ys, markersize=4, linewidth=1.6, label=s.label, clip_on=False, **style)  # a 0 on the axis shows
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers: no offset (1e-5+1.1751e1), no shared exponent
        plain = ScalarFormatter(useOffset=False)
        plain.set_scientific(False)
        axis.set_major_formatter(plain)
    ax.set_ylim(*y_limits(panel, ax.get_ylim()))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)  # below: off the curves


def y_limits(panel: Panel, auto: Tuple[float, float]) -> Tuple[float, float]:
    """The y range of ``panel`` from matplotlib's ``auto`` one: at least :data:`MIN_SPAN` of the largest value
    tall (centred on the curves), then kept within the panel's :data:`LIMITS`."""
    lo, hi = auto
    ys = [y for s in panel.series for y in s.ys]
    span = MIN_SPAN * max((abs(y) for y in ys), default=0.0)
    if ys and hi - lo < span:
        mid = (max(ys) + min(ys)) / 2
        lo, hi = mid - span / 2, mid + span / 2
    floor, ceiling = LIMITS.get(panel.name, (-math.inf, math.inf))
    lo, hi = max(lo, floor), min(hi, ceiling)
    return (lo, hi) if hi > lo else (floor, ceiling)
