"""The CPU backend's split of a node's cores between a separated run's trainer workers and rollout workers.

The rule (:func:`split_cores`), over the cores this process may use (``os.sched_getaffinity(0)``, sorted):

* by default in proportion to the workers: each of the ``T`` trainer and ``R`` rollout workers gets
  ``C // (T + R)`` of the ``C`` cores;
* with ``rollout.cpu_cores=K``: the rollout side gets ``K`` cores, each rollout worker ``K // R`` of them, and each
  trainer worker ``(C - K) // T`` of the rest; ``K`` must leave at least one core to every worker;
* in both, the trainer workers take the lowest cores in rank order, the rollout workers the next ones; the few
  cores left over (fewer than one more per worker) go to no worker (the driver process, which is not pinned, may
  use them);
* with fewer cores than workers (and no ``rollout.cpu_cores``) nothing is pinned: every worker uses every core, as
  before pinning existed, and the split says why.
"""

from __future__ import annotations

import os
from typing import Sequence

from portrl.device.split import ComputeSplit, CoreSets, describe_cores
from portrl.errors import UserError


def usable_cores() -> tuple[int, ...] | None:
    """The cores this process may run on (``os.sched_getaffinity(0)``, sorted), None where the platform cannot
    say (not Linux) and so cannot pin either."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return None
    return tuple(sorted(os.sched_getaffinity(0)))


def _blocks(cores: Sequence[int], workers: int, each: int) -> CoreSets:
    return tuple(tuple(cores[i * each:(i + 1) * each]) for i in range(workers))


def split_cores(cores: Sequence[int], trainer_workers: int, rollout_workers: int,
                rollout_cores: int | None = None) -> ComputeSplit:
    """Split ``cores`` between ``trainer_workers`` and ``rollout_workers`` by the module's rule; ``rollout_cores``
    is ``rollout.cpu_cores`` (None: in proportion). A ``rollout_cores`` that cannot be met (more than the cores
    there are, fewer than one per rollout worker, or fewer than one left per trainer worker) is a one-line
    :class:`UserError`."""
    cores = sorted(int(c) for c in cores)
    c, t, r = len(cores), int(trainer_workers), int(rollout_workers)
    if t < 1 or r < 1:
        raise ValueError(f"split_cores: needs at least one trainer and one rollout worker, got {t} and {r}")
    where = f"{c} cores this process may use ({describe_cores(cores)}, os.sched_getaffinity)"
    if rollout_cores is not None:
        k = int(rollout_cores)
        if k > c:
            raise UserError(f"rollout.cpu_cores={k} is more than the {where}; set rollout.cpu_cores<={c - t} "
                            "(one core left to each trainer worker), or null (in proportion to the workers)")
        if k < r:
            raise UserError(f"rollout.cpu_cores={k} gives no core to some of the rollout.num_rollout_workers={r} "
                            f"rollout workers; set rollout.cpu_cores>={r}, or null (in proportion to the workers)")
        if c - k < t:
            raise UserError(f"rollout.cpu_cores={k} leaves {c - k} of the {where} to the trainer.num_workers={t} "
                            f"trainer workers; set rollout.cpu_cores<={c - t}, or null (in proportion to the workers)")
        each_t, each_r, start_r = (c - k) // t, k // r, c - k
        why = f"rollout.cpu_cores={k} of the {where}"
    else:
        if c < t + r:
            return ComputeSplit("cores", why=f"not pinned: {t} trainer + {r} rollout workers need a core each, "
                                             f"this process may use {c} ({describe_cores(cores)})")
        each_t = each_r = c // (t + r)
        start_r = t * each_t
        why = f"{each_t} core(s) per worker, in proportion to {t} trainer + {r} rollout workers on the {where}"
    return ComputeSplit("cores", trainer=_blocks(cores, t, each_t), rollout=_blocks(cores[start_r:], r, each_r),
                        why=why)
