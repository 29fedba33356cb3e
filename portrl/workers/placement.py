"""The compute split of a placement: on which cores or devices the trainer's and the rollout's workers run.

The placement records themselves (``rollout.placement``: names, whether Ray is needed, the lookup) are
portrl/config/placement.py. Here: :func:`compute_split` (the backend's split for a run whose placement splits
compute, e.g. ``separated``) and :func:`group_pinning` (the cores of one worker group), which the Ray launcher
(portrl/workers/ray_launcher.py) and the preflight read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Tuple

from portrl.algo.spec import critic_enabled, implicit_prm_enabled
from portrl.config.placement import get_placement, placement_names
from portrl.device.backend import Backend
from portrl.device.split import ROLLOUT, TRAINER, ComputeSplit

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig


# ------------------------------------------------------------------------------------------ compute split
def compute_split(cfg: PortRLConfig, backend: Backend, trainer_workers: Optional[int] = None) -> Optional[ComputeSplit]:
    """``backend.split_compute`` for ``cfg``'s workers (``trainer_workers``, default ``trainer.num_workers``, where
    null, not yet resolved, counts 1 as on the CPU; ``rollout.num_rollout_workers``; ``rollout.cpu_cores``) when
    its placement splits compute and every worker runs on this node (a local Ray: no ``trainer.ray_address``,
    ``trainer.nnodes=1``); None otherwise (colocated; a cluster, where Ray chooses each worker's node). A
    ``rollout.cpu_cores`` that cannot be met is a one-line UserError (the preflight reports it before any model
    loads)."""
    name = str(cfg.rollout.placement)
    placement = get_placement(name) if name in placement_names() else None
    t = cfg.trainer
    if placement is None or not placement.splits_compute or t.ray_address or int(t.nnodes) > 1:
        return None
    cores = cfg.rollout.cpu_cores
    return backend.split_compute(int(trainer_workers if trainer_workers is not None else t.num_workers or 1),
                                 int(cfg.rollout.num_rollout_workers), None if cores is None else int(cores))


def trainer_groups(cfg: PortRLConfig) -> int:
    """The trainer-side worker groups of a run: the actor, plus the critic and PRIME's implicit PRM where the run
    has them. They share the trainer's compute (rank r of each on rank r's cores; they take turns in a step)."""
    return 1 + int(critic_enabled(cfg)) + int(implicit_prm_enabled(cfg))


@dataclass(frozen=True)
class GroupPinning:
    """Where a pinned worker group runs: ``cores[r]`` for rank r, and the CPUs each of its workers asks Ray for
    (its core count, divided among the trainer-side groups that share those cores, so that Ray counts each core
    once)."""

    side: str
    cores: Tuple[Tuple[int, ...], ...]
    ray_cpus: float
    why: str = ""  # how the split was decided (ComputeSplit.why), for the log


def group_pinning(cfg: PortRLConfig, backend: Backend, worker_cls: Any, num_workers: int) -> Optional[GroupPinning]:
    """The cores of a group of ``num_workers`` workers of ``worker_cls`` in the run of ``cfg``, on its side
    (``worker_cls.compute_side``: ``"rollout"`` for rollout workers, else the trainer's): None where nothing is
    pinned (:func:`compute_split` is None, the split is in devices, the node has too few cores, or the group has
    more workers than its side has core sets)."""
    split = compute_split(cfg, backend)
    if split is None or split.unit != "cores":
        return None
    side = ROLLOUT if getattr(worker_cls, "compute_side", TRAINER) == ROLLOUT else TRAINER
    sets = split.trainer if side == TRAINER else split.rollout
    if not sets:
        if side == ROLLOUT:  # once a run: its one rollout group
            logging.getLogger(__name__).warning("rollout.placement=separated on %s: %s", backend.name, split.why)
        return None
    if num_workers > len(sets):
        return None
    share = trainer_groups(cfg) if side == TRAINER else 1
    ray_cpus = int(len(sets[0]) / share * 10_000) / 10_000  # Ray's resolution is 1e-4; round down, never over
    return GroupPinning(side, tuple(sets[:num_workers]), ray_cpus, split.why)
