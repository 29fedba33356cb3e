"""Checks of the asynchronous modes (``trainer.mode``, ``async_training``; portrl/trainer/rollout_pipeline.py).

* ``trainer.mode`` is sync, one_step_off or async; ``async_training.stale_samples`` is wait or drop;
  ``async_training.max_staleness`` >= 0;
* a mode that overlaps rollout and training needs them on disjoint resources: a placement whose actor holds no
  engine (``rollout.placement=separated``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from portrl.config.schema_trainer import MODES, STALE_SAMPLES
from portrl.config.placement import get_placement, placement_names

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig


def check_async(cfg: PortRLConfig) -> List[str]:
    """Every problem of ``cfg``'s asynchronous settings, one line each."""
    problems: List[str] = []
    mode, a = cfg.trainer.mode, cfg.async_training
    if mode not in MODES:
        problems.append(f"trainer.mode={mode!r} is not one of {', '.join(map(repr, MODES))}")
    if a.stale_samples not in STALE_SAMPLES:
        problems.append(f"async_training.stale_samples={a.stale_samples!r} is not one of "
                        f"{', '.join(map(repr, STALE_SAMPLES))}")
    if a.max_staleness < 0:
        problems.append(f"async_training.max_staleness={a.max_staleness} must be >= 0 (policy versions a trained "
                        f"token may lag; 0 = synchronous)")
    if mode in MODES and mode != "sync" and cfg.rollout.placement in placement_names() \
            and get_placement(str(cfg.rollout.placement)).actor_holds_engine:
        problems.append(f"trainer.mode={mode} overlaps rollout and training, which needs them on disjoint resources: "
                        f"set rollout.placement=separated (rollout.placement={cfg.rollout.placement} runs both in "
                        f"one process)")
    return problems
