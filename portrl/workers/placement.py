"""Rollout placements: where a run's rollout engine lives relative to the trainer's actor, as registered records.

``rollout.placement`` names one :class:`Placement`; everything that depends on it reads the record
(:func:`placement_of`) instead of comparing strings: the config checks (valid names, whether Ray is needed), the
device count (:func:`portrl.workers.setup.auto_num_workers`), the worker group (:func:`portrl.workers.group.use_ray`),
the actor (whether it builds an engine) and the trainer (how the rollout side is built).

Built in:

* ``colocated``: the actor worker holds the engine (the ``hf`` engine shares its module); no extra devices;
* ``separated``: ``rollout.num_rollout_workers`` RolloutWorkers as Ray actors with models of their own, which
  take that many devices from the trainer's count and get the policy by broadcast after each update
  (:func:`portrl.workers.rollout_worker.separated_rollout`). Its trainer and rollout workers run on disjoint
  compute (:func:`group_pinning`): devices on the accelerators, pinned cores on the CPU.

A new placement is one :func:`register_placement` call. This module imports nothing heavy: the separated
rollout side is imported when it is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from portrl.device.backend import Backend
from portrl.device.split import ROLLOUT, TRAINER, ComputeSplit
from portrl.errors import UserError

#: ``(cfg, backend, actor WorkerGroup) -> (rollout WorkerGroup, weight link)``: the rollout side of a placement
#: whose actor holds no engine; the link's ``sync()`` sends the policy to it
BuildRollout = Callable[[Any, Any, Any], Tuple[Any, Any]]


@dataclass(frozen=True)
class Placement:
    """One value of ``rollout.placement``.

    ``actor_holds_engine``: the actor worker builds and syncs its own rollout engine (else ``build_rollout``
    builds the rollout side). ``needs_ray``: the placement runs Ray actors even with one trainer worker.
    ``devices_taken(cfg)``: ``(devices the rollout side takes from the trainer's count, the config setting that
    says so)``, ``(0, "")`` when it takes none. ``splits_compute``: the trainer's and the rollout's Ray workers
    run on disjoint compute (:meth:`Backend.split_compute`, :func:`group_pinning`).
    """

    name: str
    summary: str
    actor_holds_engine: bool
    needs_ray: bool
    devices_taken: Callable[[Any], Tuple[int, str]]
    build_rollout: Optional[BuildRollout] = None
    splits_compute: bool = False

    def rollout_side(self, cfg: Any, backend: Backend, actor_group: Any) -> Tuple[Any, Any]:
        """``(rollout group, weight link)`` for a run, or ``(None, None)`` when the actor holds the engine."""
        if self.actor_holds_engine or self.build_rollout is None:
            return None, None
        return self.build_rollout(cfg, backend, actor_group)


_PLACEMENTS: Dict[str, Placement] = {}


def register_placement(placement: Placement) -> Placement:
    """Register ``placement`` under its name; registering an equal record again is a no-op, another record under
    a taken name is a ``ValueError``."""
    old = _PLACEMENTS.get(placement.name)
    if old is not None and old != placement:
        raise ValueError(f"rollout placement {placement.name!r} is already registered")
    if not placement.actor_holds_engine and placement.build_rollout is None:
        raise ValueError(f"rollout placement {placement.name!r}: an actor without an engine needs build_rollout")
    _PLACEMENTS[placement.name] = placement
    return placement


def placement_names() -> Tuple[str, ...]:
    """The registered placement names, in registration order (the built-ins first)."""
    return tuple(_PLACEMENTS)


def placement_needs_ray(cfg: Any) -> bool:
    """Whether ``cfg.rollout.placement`` runs Ray actors even with one trainer worker; False for a name that is
    not registered (the config checks report that name on their own)."""
    placement = _PLACEMENTS.get(str(cfg.rollout.placement))
    return placement is not None and placement.needs_ray


def get_placement(name: str) -> Placement:
    """The placement registered as ``name``; an unknown name is a one-line :class:`UserError` listing the valid
    ones."""
    try:
        return _PLACEMENTS[name]
    except KeyError:
        raise UserError(f"rollout.placement={name!r} is not a rollout placement; valid: "
                        f"{', '.join(placement_names())}") from None


def placement_of(cfg: Any) -> Placement:
    """The placement ``cfg.rollout.placement`` names (see :func:`get_placement`)."""
    return get_placement(str(cfg.rollout.placement))


def _separated_rollout(cfg: Any, backend: Backend, actor_group: Any) -> Tuple[Any, Any]:
    from portrl.workers.rollout_worker import separated_rollout  # Ray and the worker classes: only when built

    return separated_rollout(cfg, backend, actor_group)


COLOCATED = register_placement(Placement(
    "colocated", "actor and rollout engine in one process", actor_holds_engine=True, needs_ray=False,
    devices_taken=lambda cfg: (0, "")))
SEPARATED = register_placement(Placement(
    "separated", "rollout.num_rollout_workers rollout workers with models of their own, as Ray actors",
    actor_holds_engine=False, needs_ray=True,
    devices_taken=lambda cfg: (int(cfg.rollout.num_rollout_workers),
                               f"rollout.num_rollout_workers={int(cfg.rollout.num_rollout_workers)}"),
    build_rollout=_separated_rollout, splits_compute=True))


# ------------------------------------------------------------------------------------------ compute split
def compute_split(cfg: Any, backend: Backend, trainer_workers: Optional[int] = None) -> Optional[ComputeSplit]:
    """``backend.split_compute`` for ``cfg``'s workers (``trainer_workers``, default ``trainer.num_workers``, where
    null, not yet resolved, counts 1 as on the CPU; ``rollout.num_rollout_workers``; ``rollout.cpu_cores``) when
    its placement splits compute and every worker runs on this node (a local Ray: no ``trainer.ray_address``,
    ``trainer.nnodes=1``); None otherwise (colocated; a cluster, where Ray chooses each worker's node). A
    ``rollout.cpu_cores`` that cannot be met is a one-line UserError (the preflight reports it before any model
    loads)."""
    placement = _PLACEMENTS.get(str(cfg.rollout.placement))
    t = cfg.trainer
    if placement is None or not placement.splits_compute or t.ray_address or int(t.nnodes) > 1:
        return None
    cores = cfg.rollout.cpu_cores
    return backend.split_compute(int(trainer_workers if trainer_workers is not None else t.num_workers or 1),
                                 int(cfg.rollout.num_rollout_workers), None if cores is None else int(cores))


def trainer_groups(cfg: Any) -> int:
    """The trainer-side worker groups of a run: the actor, plus the critic and PRIME's implicit PRM where the run
    has them. They share the trainer's compute (rank r of each on rank r's cores; they take turns in a step)."""
    from portrl.algo.spec import critic_enabled, implicit_prm_enabled  # the algorithm registry: only when asked

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


def group_pinning(cfg: Any, backend: Backend, worker_cls: Any, num_workers: int) -> Optional[GroupPinning]:
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
