"""``portrl parity e2e``: a short fixed-seed GRPO run on the arith task must stay inside an envelope.

The envelope is measured on the reference backend over several seeds (``trainer.seed`` = 1..N): per
step and metric, ``mean +- max(k * max(std, pooled_std), floor)`` with ``k = 3``, ``pooled_std`` the
root-mean-square of the metric's per-step stds (a std from a handful of seeds is noisy, and a rare
event such as the first correct answer can be absent from every seed at one step and present at the
next), and ``floor = rel_floor * |mean| + abs_floor`` (a step where every seed agrees does not demand
bitwise equality from other hardware).
The checked run uses seed 0, which is not one of the envelope's seeds. Bitwise determinism of
``trainer.deterministic=true`` is tests/test_trainer_resume.py::test_deterministic_runs_are_bitwise_identical. The envelope file is committed
(``envelope_cpu.json`` next to this module) and rebuilt with ``portrl parity e2e --rebuild-envelope``.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from portrl.config.composition import compose
from portrl.parity.report import environment
from portrl.trainer.rl_trainer import run_training

if TYPE_CHECKING:
    from portrl.device.backend import Backend

METRICS = ("critic/score/mean", "actor/entropy", "response_length/mean", "actor/grad_norm")
K_STD = 3.0
REL_FLOOR, ABS_FLOOR = 0.05, 1e-3
CHECK_SEED = 0
#: the short run: tiny model with a brief SFT warm start (so rewards are not all zero), 10 GRPO steps
#: (the recipe is pinned here, not taken from the tiny preset, so tuning the preset does not move the envelope)
RUN_OVERRIDES = (
    "trainer.total_steps=10", "model.sft_warm_start=true", "model.sft_steps=60", "model.sft_lr=3.0e-3",
    "model.sft_batch_size=32", "actor.optim.lr=2.0e-4", "model.tiny.hidden_size=128", "model.tiny.num_layers=2",
    "model.tiny.intermediate_size=384", "trainer.test_freq=0",
    "trainer.val_before_train=false", "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false",
    "trainer.progress_bar=false", "trainer.resume='off'", "trainer.loggers=[jsonl]", "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=8", "trainer.deterministic=true",
)


def default_envelope_path(backend_name: str = "cpu") -> Path:
    return Path(__file__).with_name(f"envelope_{backend_name}.json")


def run_curve(backend: Backend, seed: int, work_dir, preset: str | None = None) -> dict[str, list[float]]:
    """Train with ``seed``; the per-step values of ``METRICS`` from the run's metrics.jsonl."""
    out = Path(work_dir) / f"seed{seed}"
    cfg = compose(device=backend.name, preset=preset or backend.name, algorithm="grpo", data="arith", model="tiny",
                  overrides=(*RUN_OVERRIDES, f"trainer.seed={seed}", f"trainer.output_dir={out}"))
    run_training(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if "step" in r and METRICS[0] in r), key=lambda r: r["step"])
    missing = [m for m in METRICS if any(m not in r for r in rows)]
    if missing or not rows:
        raise RuntimeError(f"the run in {out} logged no {missing or list(METRICS)}")
    return {m: [float(r[m]) for r in rows] for m in METRICS}


def band(means: list[float], stds: list[float]) -> dict[str, list[float]]:
    """``{"mean", "std", "half_width"}`` of one metric (see the module docstring)."""
    pooled = math.sqrt(statistics.fmean(s * s for s in stds))
    return {"mean": means, "std": stds,
            "half_width": [max(K_STD * max(s, pooled), REL_FLOOR * abs(mu) + ABS_FLOOR) for mu, s in zip(means, stds)]}


def envelope_from_curves(curves: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Per metric and step: mean, std and the band half-width."""
    if len(curves) < 2:
        raise ValueError("an envelope needs at least 2 seeds")
    steps = min(len(c[METRICS[0]]) for c in curves)
    env: dict[str, Any] = {}
    for m in METRICS:
        cols = [[c[m][i] for c in curves] for i in range(steps)]
        env[m] = band([statistics.fmean(col) for col in cols], [statistics.stdev(col) for col in cols])
    return env


def violations(curve: dict[str, list[float]], env: dict[str, Any]) -> list[str]:
    """Points of ``curve`` outside ``env`` (one line each); a missing metric or a short curve counts too."""
    out = []
    for m, band in env.items():
        values = curve.get(m)
        if values is None or len(values) < len(band["mean"]):
            out.append(f"{m}: {0 if values is None else len(values)} steps, the envelope has {len(band['mean'])}")
            continue
        for i, (v, mu, w) in enumerate(zip(values, band["mean"], band["half_width"])):
            if not abs(v - mu) <= w:
                out.append(f"{m} step {i + 1}: {v:.4g} outside {mu:.4g} +- {w:.3g}")
    return out


def build_envelope(backend: Backend, seeds: int = 4, work_dir=None, preset: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        curves = [run_curve(backend, s, tmp, preset) for s in range(1, seeds + 1)]
    return {"kind": "envelope", "seeds": list(range(1, seeds + 1)), "k_std": K_STD, "rel_floor": REL_FLOOR,
            "abs_floor": ABS_FLOOR, "overrides": list(RUN_OVERRIDES), "measured_on": environment(backend),
            "metrics": envelope_from_curves(curves)}


def check_run(backend: Backend, envelope_path, work_dir=None, preset: str | None = None) -> dict[str, Any]:
    p = Path(envelope_path)
    if not p.is_file():
        raise FileNotFoundError(f"no envelope at {str(p)!r}: build one with `portrl parity e2e --rebuild-envelope`")
    env = json.loads(p.read_text())
    if env.get("overrides") != list(RUN_OVERRIDES):
        raise ValueError(f"envelope {str(p)!r} was measured with other run settings; rebuild it")
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        curve = run_curve(backend, CHECK_SEED, tmp, preset)
    bad = violations(curve, env["metrics"])
    return {"kind": "e2e", **environment(backend), "seed": CHECK_SEED, "envelope": str(p), "curve": curve,
            "violations": bad, "verdict": "fail" if bad else "pass"}
