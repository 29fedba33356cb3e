"""``portrl parity rollout``: each rollout engine's log-probs against the trainer's forward on the same tokens.

For each engine (default: every one the backend offers, :meth:`Backend.rollout_engines`) and dtype, one GRPO step
of the built-in tiny model on arith (16 prompts x 16 samples of up to 32 tokens, fixed seed, no warm start) with
the trainer's own forward (``model.reuse_rollout_forward=false``: the trainer does not replay the rollout's
matmuls) and one mini-batch, so the gap the actor logs before its only optimizer step is the trainer's forward on
the engine's sampled tokens against the engine's own log-probs: verl's ``training/rollout_probs_diff_{mean,max}``
(``|p_trainer - p_rollout|``) and ``training/rollout_log_probs_diff_{mean,max}`` (the same in log space). The
engine's token budget per step holds every prompt of the batch at once (``rollout.max_num_batched_tokens=16384``): an
engine's CPU build may not split a seeded request's prompt over steps (backends/cpu/backend.py says which). The
verdict compares the log-space gap with ``ROLLOUT_GAP`` (portrl/parity/tolerances.py, by dtype, a backend's own
row where it has one); the report carries the CPU goldens beside each measurement: the CPU backend's data file
``backends/cpu/rollout_gap_golden.json``, measured with ``--rebuild-golden`` on the CPU.
"""

from __future__ import annotations

import json
import tempfile
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from portrl.config.composition import compose
from portrl.parity.report import environment
from portrl.parity.tolerances import BACKEND_ROLLOUT_GAP, ROLLOUT_GAP, ROLLOUT_GAP_WARN_FACTOR, worst
from portrl.trainer.rl_trainer import run_training
from portrl.trainer.tracking import read_metrics_up_to

if TYPE_CHECKING:
    from portrl.device.backend import Backend

GAP_KEYS = ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max",
            "training/rollout_log_probs_diff_mean", "training/rollout_log_probs_diff_max")
RUN_OVERRIDES = (
    "model.sft_warm_start=false", "model.reuse_rollout_forward=false", "trainer.total_steps=1",
    "data.train_batch_size=16", "rollout.n=16", "actor.ppo_mini_batch_size=16", "actor.ppo_epochs=1",
    "data.max_response_length=32", "rollout.max_num_batched_tokens=16384", "trainer.num_workers=1", "trainer.test_freq=0", "trainer.val_before_train=false",
    "trainer.save_final=false", "trainer.export_hf=false", "trainer.plot=false", "trainer.progress_bar=false",
    "trainer.resume='off'", "trainer.loggers=[jsonl]", "trainer.seed=0",
)


def golden_path() -> Path:
    """The CPU goldens, a data file of the cpu backend package."""
    return Path(str(files("portrl.backends.cpu").joinpath("rollout_gap_golden.json")))


def measure(backend: Backend, engine: str, dtype: str, work_dir) -> dict[str, float]:
    """The four gap metrics of one engine and dtype (module docstring)."""
    out = Path(work_dir) / f"{engine}-{dtype}"
    cfg = compose(device=backend.name, algorithm="grpo", data="arith", model="tiny",
                  overrides=(*RUN_OVERRIDES, f"rollout.engine={engine}", f"device.dtype={dtype}",
                             f"trainer.output_dir={out}"))
    run_training(cfg)
    row = next((r for r in read_metrics_up_to(out, 1) if r.get("step") == 1 and GAP_KEYS[0] in r), None)
    if row is None:
        raise RuntimeError(f"the run in {out} logged no {GAP_KEYS[0]}")
    return {k: float(row[k]) for k in GAP_KEYS}


def gap_verdict(backend_name: str, dtype: str, gap: dict[str, float]) -> str:
    """pass within ROLLOUT_GAP's bound, warn within ROLLOUT_GAP_WARN_FACTOR times it, else fail (NaN fails)."""
    bounds = BACKEND_ROLLOUT_GAP.get(backend_name, {}).get(dtype) or ROLLOUT_GAP[dtype]
    verdicts = []
    for key, bound in bounds.items():
        value = gap[key]
        verdicts.append("pass" if value <= bound else "warn" if value <= ROLLOUT_GAP_WARN_FACTOR * bound else "fail")
        if value != value:
            verdicts.append("fail")
    return worst(verdicts)


def run_rollout_gap(backend: Backend, engines: Sequence[str] | None = None,
                    dtypes: Sequence[str] = ("float32", "bfloat16"), work_dir=None) -> dict[str, Any]:
    """The report: one case per engine and dtype with its gap, bounds, CPU golden and verdict."""
    goldens = json.loads(golden_path().read_text()) if golden_path().is_file() else {}
    cases = []
    with tempfile.TemporaryDirectory(prefix="portrl-rollout-gap-", dir=work_dir) as tmp:
        for engine in engines or backend.rollout_engines():
            for dtype in dtypes:
                gap = measure(backend, engine, dtype, tmp)
                cases.append({"engine": engine, "dtype": dtype, **gap,
                              "bounds": BACKEND_ROLLOUT_GAP.get(backend.name, {}).get(dtype) or ROLLOUT_GAP[dtype],
                              "cpu_golden": goldens.get(f"{engine}-{dtype}"),
                              "verdict": gap_verdict(backend.name, dtype, gap)})
    return {"kind": "rollout", **environment(backend), "overrides": list(RUN_OVERRIDES), "cases": cases,
            "verdict": worst(c["verdict"] for c in cases)}


def golden_of(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The goldens file's content from a CPU report: each case's gap by ``<engine>-<dtype>``."""
    return {f"{c['engine']}-{c['dtype']}": {k: c[k] for k in GAP_KEYS} for c in report["cases"]}
