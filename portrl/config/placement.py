"""Rollout placements: where a run's rollout engine lives relative to the trainer's actor, as registered records.

``rollout.placement`` names one :class:`Placement`; everything that depends on it reads the record
(:func:`placement_of`) instead of comparing strings: the config checks (valid names, whether Ray is needed), the
device count (:func:`portrl.workers.setup.auto_num_workers`), the worker group (:func:`portrl.workers.group.use_ray`),
the actor (whether it builds an engine), the compute split (portrl/workers/placement.py) and the trainer (how the
rollout side is built).

Built in:

* ``colocated``: the actor worker holds the engine (the ``hf`` engine shares its module); no extra devices;
* ``separated``: ``rollout.num_rollout_workers`` RolloutWorkers as Ray actors with models of their own, which
  take that many devices from the trainer's count and get the policy by broadcast after each update
  (:func:`portrl.workers.rollout_worker.separated_rollout`). Its trainer and rollout workers run on disjoint
  compute (:func:`portrl.workers.placement.group_pinning`): devices on the accelerators, pinned cores on the CPU.

A new placement is one :func:`register_placement` call. The records live on the config's floor, below the
workers that build them: a built-in placement's rollout side is provided by the workers' floor when it is
imported (:func:`provide_rollout_side`; ``separated``'s by portrl/workers/rollout_worker.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from portrl.errors import UserError

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig
    from portrl.device.backend import Backend

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
    run on disjoint compute (:meth:`Backend.split_compute`, :func:`portrl.workers.placement.group_pinning`).
    """

    name: str
    summary: str
    actor_holds_engine: bool
    needs_ray: bool
    devices_taken: Callable[[Any], Tuple[int, str]]
    build_rollout: Optional[BuildRollout] = None
    splits_compute: bool = False

    def rollout_side(self, cfg: PortRLConfig, backend: Backend, actor_group: Any) -> Tuple[Any, Any]:
        """``(rollout group, weight link)`` for a run, or ``(None, None)`` when the actor holds the engine."""
        if self.actor_holds_engine or self.build_rollout is None:
            return None, None
        return self.build_rollout(cfg, backend, actor_group)


_PLACEMENTS: Dict[str, Placement] = {}
_PROVIDED: Dict[str, BuildRollout] = {}


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


def placement_needs_ray(cfg: PortRLConfig) -> bool:
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


def placement_of(cfg: PortRLConfig) -> Placement:
    """The placement ``cfg.rollout.placement`` names (see :func:`get_placement`)."""
    return get_placement(str(cfg.rollout.placement))


def provide_rollout_side(name: str, build: BuildRollout) -> None:
    """Give built-in placement ``name`` the function that builds its rollout side (called by the module that
    defines it, when imported)."""
    _PROVIDED[name] = build


def _provided(name: str) -> BuildRollout:
    """A ``build_rollout`` that calls what :func:`provide_rollout_side` gave placement ``name``."""
    def build(cfg: PortRLConfig, backend: Backend, actor_group: Any) -> Tuple[Any, Any]:
        if name not in _PROVIDED:
            raise RuntimeError(f"rollout.placement={name}: nothing provided its rollout side (import "
                               "portrl.workers.rollout_worker first)")
        return _PROVIDED[name](cfg, backend, actor_group)

    return build


def _rollout_devices(cfg: Any) -> Tuple[int, str]:
    """The devices separated rollout workers take: each worker's engine spreads over
    ``rollout.tensor_model_parallel_size`` of them (portrl.workers.rollout_worker.RolloutWorker.devices_needed)."""
    n, tp = int(cfg.rollout.num_rollout_workers), int(cfg.rollout.tensor_model_parallel_size)
    setting = f"rollout.num_rollout_workers={n}" + (f" x rollout.tensor_model_parallel_size={tp}" if tp > 1 else "")
    return n * tp, setting


COLOCATED = register_placement(Placement(
    "colocated", "actor and rollout engine in one process", actor_holds_engine=True, needs_ray=False,
    devices_taken=lambda cfg: (0, "")))
SEPARATED = register_placement(Placement(
    "separated", "rollout.num_rollout_workers rollout workers with models of their own, as Ray actors",
    actor_holds_engine=False, needs_ray=True,
    devices_taken=lambda cfg: _rollout_devices(cfg),
    build_rollout=_provided("separated"), splits_compute=True))
