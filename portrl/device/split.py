"""How a node's compute is divided between a separated run's trainer workers and its rollout workers.

:meth:`portrl.device.backend.Backend.split_compute` answers with a :class:`ComputeSplit`; the Ray layer
(:mod:`portrl.workers.ray_launcher`) sizes each worker's Ray bundle by it and pins each worker to the cores it
lists (:func:`portrl.workers.setup.pin_process`). Two units:

* ``devices`` (the accelerators): every worker's Ray bundle holds devices of the backend's ``ray_resource`` of its
  own, so the trainer's pool and the rollout pool never share a device; nothing is pinned;
* ``cores`` (the CPU): each worker gets a set of cores no other worker of the run has, and runs on those alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

#: the two sides of a separated run: the trainer's workers (actor, critic, PRM) and the rollout workers
TRAINER, ROLLOUT = "trainer", "rollout"

CoreSets = Tuple[Tuple[int, ...], ...]


@dataclass(frozen=True)
class ComputeSplit:
    """``unit``: ``"devices"`` or ``"cores"`` (module docstring). ``trainer`` / ``rollout``: per rank, the cores
    (sorted ids) of that trainer / rollout worker; empty for ``devices``, and empty for ``cores`` when the node has
    too few to give every worker one of its own (then every worker uses every core, as a colocated run's process
    does). ``why``: how the split was decided, one clause for the log."""

    unit: str
    trainer: CoreSets = ()
    rollout: CoreSets = ()
    why: str = ""

    @property
    def disjoint(self) -> bool:
        """Whether the two sides run on compute of their own: devices (Ray's bundles), or cores pinned."""
        return self.unit == "devices" or bool(self.trainer and self.rollout)

    def cores(self, side: str, rank: int) -> Optional[Tuple[int, ...]]:
        """The cores worker ``rank`` of ``side`` (:data:`TRAINER` or :data:`ROLLOUT`) is pinned to; None when it
        is not pinned (devices, too few cores, or a rank beyond the split)."""
        sets = self.trainer if side == TRAINER else self.rollout if side == ROLLOUT else None
        if sets is None:
            raise ValueError(f"compute side {side!r} is neither {TRAINER!r} nor {ROLLOUT!r}")
        return sets[rank] if rank < len(sets) else None


def describe_cores(cores: Iterable[int]) -> str:
    """Core ids as ranges, as ``taskset -c`` writes them: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    ids = sorted(set(int(c) for c in cores))
    parts = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)
