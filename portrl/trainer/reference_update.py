"""SPIN's moving reference: ``trainer.ref_update_freq`` (verl's recipe/spin name and rule).

At the start of every step ``k`` (counted from 1) with ``k % ref_update_freq == 0``, before its rollout, the
reference policy becomes a copy of the current policy, i.e. of the policy the updates of steps ``1 .. k-1`` made
(``ActorRolloutWorker.update_reference`` in portrl/workers/actor.py). With ``ref_update_freq=1`` every step's
reference is the policy that generated its samples (self-play against the previous iterate). 0 keeps the
reference of the run's start (after any SFT warm start).

A reference that changes during the run is written into each checkpoint (portrl/trainer/run_checkpoints.py), so a
resumed run uses exactly the reference the uninterrupted run had at that step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from portrl.workers.actor import ActorRolloutWorker

if TYPE_CHECKING:  # annotations only
    from portrl.config.schema import PortRLConfig
    from portrl.workers.group import WorkerGroup


class ReferenceRun(Protocol):
    """What :func:`refresh_reference` reads of a run (an :class:`portrl.trainer.rl_trainer.RLTrainer` is one)."""

    cfg: PortRLConfig
    use_ref: bool  # the run has a reference policy
    actor: WorkerGroup[ActorRolloutWorker]


def reference_update_due(cfg: PortRLConfig, step: int) -> bool:
    """Whether step ``step`` starts by copying the policy into the reference."""
    freq = int(cfg.trainer.ref_update_freq)
    return freq > 0 and step % freq == 0


def refresh_reference(trainer: ReferenceRun, step: int, timer: Any) -> None:
    """Before step ``step`` of ``trainer``: the reference becomes
    the current policy on every actor worker when the step is due and the run has a reference (timed as
    ``timing_s/ref_update``)."""
    if trainer.use_ref and reference_update_due(trainer.cfg, step):
        with timer("ref_update"):
            trainer.actor.run(ActorRolloutWorker.update_reference)
