"""Per-step metrics: a console progress bar, ``<output_dir>/metrics.jsonl``, and optional loggers.

``Tracker.log(metrics, step)`` converts every value to a plain float (tensors, numpy scalars, bools;
non-finite values become ``null``; strings are kept), appends one JSON line
``{"step": step, **metrics}`` to ``metrics.jsonl`` (flushed at once, so a killed run keeps every
finished step) and forwards the floats to the selected loggers:

* ``console``: a tqdm progress bar showing a few key metrics (or one log line per step when
  ``progress_bar`` is False), and while a step or a validation runs, the phase it is in and for how long
  (portrl.progress: in the bar's description every few seconds, or a log line every 30 s);
* ``jsonl``: the file above;
* ``tensorboard`` / ``wandb`` / ``mlflow``: imported only when selected; a selected one that is not
  installed is an ImportError naming the package and ``pip install 'portrl[logging]'``.

Resuming: with ``resume_step > 0`` the lines of ``metrics.jsonl`` with ``step > resume_step`` (logged
after the checkpoint the run resumes from) are dropped first (the file is rewritten atomically), so
the file reads as if the run had never been interrupted. ``resume_step == 0`` starts a fresh file.
Either happens at the first :meth:`Tracker.log`, not when the Tracker is built: a launch that fails
before its run logs anything leaves an existing ``metrics.jsonl`` as it was.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

from omegaconf import OmegaConf
from tqdm import tqdm

from portrl.device import import_optional
from portrl.progress import BAR_EVERY_S, LOG_EVERY_S, Heartbeat
from portrl.user_files import temp_name

log = logging.getLogger(__name__)

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
METRICS_FILE = "metrics.jsonl"
INSTALL = "pip install 'portrl[logging]'"
#: shown in the progress bar when present (first match of each group)
CONSOLE_KEYS = (("reward", ("critic/rewards/mean", "critic/score/mean")), ("acc", ("critic/acc/mean",)),
                ("val_acc", ("val/acc/mean",)), ("kl", ("actor/kl_loss", "actor/ppo_kl")),
                ("ent", ("actor/entropy",)), ("len", ("response_length/mean",)))


def to_float(value: Any) -> Any:
    """A plain float (or None for NaN/inf) from a number, bool, 0-d tensor or numpy scalar; strings pass."""
    if isinstance(value, str) or value is None:
        return value
    if hasattr(value, "item") and callable(value.item):  # torch tensor / numpy scalar or 1-element array
        try:
            value = value.item()
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"metric value {value!r} is not a scalar ({exc})") from None
    if isinstance(value, (bool, numbers.Real)):
        f = float(value)
        return f if math.isfinite(f) else None
    raise ValueError(f"metric value {value!r} of type {type(value).__name__} is not a number")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl`` file (or of ``<run_dir>/metrics.jsonl``); a torn last line is ignored."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    rows = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                log.warning("%s: skipping a torn line: %.60s", path, line)
    return rows


def read_metrics_up_to(path: str | os.PathLike, step: int) -> list[dict]:
    """The records of :func:`read_metrics` with ``step <=`` the given step; [] when there is no such file."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return [r for r in read_metrics(path) if int(r.get("step", 0)) <= step] if path.exists() else []


def _truncate_after(path: Path, resume_step: int) -> None:
    """Keep only records with step <= resume_step (atomic rewrite)."""
    if not path.exists():
        return
    kept = read_metrics_up_to(path, resume_step)
    tmp = temp_name(path)
    with open(tmp, "w") as fh:
        for r in kept:
            fh.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


class Tracker:
    """Metrics sink of a run (see the module docstring)."""

    def __init__(self, output_dir: str | os.PathLike, loggers=("console", "jsonl"), config: Any = None,
                 total_steps: Optional[int] = None, progress_bar: bool = True, resume_step: int = 0):
        unknown = [x for x in loggers if x not in LOGGERS]
        if unknown:
            raise ValueError(f"unknown logger(s) {unknown}; valid: {', '.join(LOGGERS)}")
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = tuple(loggers)
        self.config = config
        self.total_steps = total_steps
        self.resume_step = int(resume_step)
        self._jsonl = None
        self._bar = None
        self._tb = None
        self._wandb = None
        self._mlflow = None
        self._last_step = self.resume_step
        self._jsonl_pending = "jsonl" in self.loggers  # opened (fresh or cut at resume_step) at the first log
        self._heartbeat: Optional[Heartbeat] = None
        if "console" in self.loggers and progress_bar:
            self._bar = tqdm(total=total_steps, initial=self.resume_step, desc="train", unit="step", dynamic_ncols=True)
        if "console" in self.loggers:  # the phase that runs, while it runs (portrl.progress)
            self._heartbeat = Heartbeat(self._show_activity, lambda: self._last_step + 1,
                                        BAR_EVERY_S if self._bar is not None else LOG_EVERY_S)
        if "tensorboard" in self.loggers:
            self._tb = self._open_tensorboard()
        if "wandb" in self.loggers:
            self._wandb = self._open_wandb()
        if "mlflow" in self.loggers:
            self._mlflow = self._open_mlflow()

    def _open_jsonl(self):
        path = self.output_dir / METRICS_FILE
        if self.resume_step > 0:
            _truncate_after(path, self.resume_step)
            return open(path, "a")
        return open(path, "w")

    # --------------------------------------------------------------------------- optional loggers
    def _names(self) -> tuple[str, str]:
        t = getattr(self.config, "trainer", None) if self.config is not None else None
        project = str(getattr(t, "project_name", "portrl")) if t is not None else "portrl"
        name = str(getattr(t, "experiment_name", self.output_dir.name)) if t is not None else self.output_dir.name
        return project, name

    def _config_dict(self) -> dict:
        if self.config is None:
            return {}
        if OmegaConf.is_config(self.config):
            container = OmegaConf.to_container(self.config, resolve=True)
            return container if isinstance(container, dict) else {}
        return dict(self.config) if isinstance(self.config, Mapping) else {}

    def _open_tensorboard(self):
        import_optional("tensorboard", INSTALL)  # the optional loggers (the `logging` extra) load only when chosen
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  (optional dependency: tensorboard)

        return SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=self.resume_step + 1
                             if self.resume_step else None)

    def _open_wandb(self):
        wandb = import_optional("wandb", INSTALL)
        project, name = self._names()
        wandb.init(project=project, name=name, dir=str(self.output_dir), config=self._config_dict(), resume="allow")
        return wandb

    def _open_mlflow(self):
        mlflow = import_optional("mlflow", INSTALL)
        project, name = self._names()
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=name)
        flat = _flatten(self._config_dict())
        if flat:
            mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})
        return mlflow

    # ------------------------------------------------------------------------------------ logging
    def log(self, metrics: Mapping[str, Any], step: int) -> dict:
        """Record ``metrics`` for ``step``; returns the converted record."""
        record: dict[str, Any] = {"step": int(step)}
        for k, v in metrics.items():
            if k == "step":
                continue
            record[str(k)] = to_float(v)
        numeric = {k: v for k, v in record.items() if k != "step" and isinstance(v, float)}
        if self._jsonl_pending:
            self._jsonl_pending = False
            self._jsonl = self._open_jsonl()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, global_step=int(step))
        if self._wandb is not None:
            self._wandb.log(numeric, step=int(step))
        if self._mlflow is not None:
            self._mlflow.log_metrics({_mlflow_key(k): v for k, v in numeric.items()}, step=int(step))
        if "console" in self.loggers:
            self._console(numeric, int(step))
        self._last_step = int(step)
        return record

    def _show_activity(self, text: str) -> None:
        bar = self._bar
        if bar is not None:
            bar.set_description_str(f"train [{text}]")
        else:
            total = f"/{self.total_steps}" if self.total_steps else ""
            log.info("running (of %s%s steps): %s", self._last_step, total, text)

    def _console(self, numeric: dict, step: int) -> None:
        shown = {}
        for label, keys in CONSOLE_KEYS:
            for k in keys:
                if k in numeric:
                    shown[label] = f"{numeric[k]:.3g}"
                    break
        if self._bar is not None:
            self._bar.set_description_str("train", refresh=False)
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(max(0, step - self._bar.n))
        else:
            total = f"/{self.total_steps}" if self.total_steps else ""
            log.info("step %d%s %s", step, total, " ".join(f"{k}={v}" for k, v in shown.items()))

    def close(self) -> None:
        """Close every logger. Called while an error ends the run (a ``finally``), a close that fails for the same
        cause (a full disk: the last buffered line cannot be written) is a warning, so that the run's own one-line
        error is what the user sees."""
        self._jsonl_pending = False
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._jsonl is not None:
            jsonl, self._jsonl = self._jsonl, None
            try:
                jsonl.close()
            except OSError as exc:
                if sys.exc_info()[0] is None:
                    raise
                log.warning("metrics.jsonl could not be closed: %s", exc)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._mlflow is not None:
            self._mlflow.end_run()
            self._mlflow = None

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _flatten(d: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _mlflow_key(key: str) -> str:
    """MLflow allows alphanumerics, ``_ - . space / :``; anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-. /:" else "_" for c in key)
