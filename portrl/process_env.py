"""Environment variables a portrl process sets for itself before torch loads.

torch and its OpenMP runtime read these once, when torch is imported or at its first allocation, so
``portrl``'s command line applies them (:func:`apply_defaults`) before any command imports torch, and every
Ray worker of a run gets the driver's values (``portrl.workers.ray_env.worker_env``). A value the user set
wins; ``VAR=0 portrl train ...`` opts out of either.

* ``GOMP_SPINCOUNT=1000``: an OpenMP thread (GNU libgomp, which torch's Linux wheels use) that waits at the end
  of a parallel region spins 1000 times, then sleeps. libgomp's own default spins 300,000 times (about a
  millisecond): alone on its cores that is fastest, but when another busy process shares them the spinning
  threads take the cores the working ones need. ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once) is the safe
  extreme, at a futex wake-up per parallel region; 1000 spins stay near the default alone and near passive on
  shared cores (the figures: docs/performance.md, "Measurements behind code comments and presets"). A wait policy
  the user sets (``OMP_WAIT_POLICY=PASSIVE`` or ``ACTIVE``) decides alone: the spin count is then not set.
* ``THP_MEM_ALLOC_ENABLE=1``: torch's CPU allocator asks Linux for transparent huge pages (2 MiB instead of
  4 KiB, ``madvise(MADV_HUGEPAGE)``) for every tensor of 2 MiB or more. A model's weights, a packed decode
  weight, a forward's activations then cost one page-table entry per 2 MiB: fewer TLB misses when a decode
  streams every weight, one page fault per 2 MiB instead of 512 when a large fresh tensor is first written.
  Memory reads, matmuls and a 0.5B GRPO step all gain (docs/performance.md). Works where
  ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise`` (``portrl doctor`` says which).
  On a VM whose hypervisor takes freed memory back (free-page reporting), the first touch of huge pages a
  process has not used yet is slow, which makes a run's first step slower; the steps after win it back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

#: variable -> value, applied where the user has not set the variable (nor one that overrides it: YIELDS_TO)
DEFAULTS: dict[str, str] = {
    "GOMP_SPINCOUNT": "1000",
    "THP_MEM_ALLOC_ENABLE": "1",
}

#: a default -> the user's variables that decide instead of it (libgomp takes GOMP_SPINCOUNT over the policy)
YIELDS_TO: dict[str, tuple[str, ...]] = {"GOMP_SPINCOUNT": ("OMP_WAIT_POLICY",)}

#: every variable this module's defaults concern, the user's overriding ones included
VARIABLES: tuple[str, ...] = (*DEFAULTS, *(v for names in YIELDS_TO.values() for v in names))


_applied: set[str] = set()  # the names apply_defaults set in os.environ: portrl's defaults, not the user's values


def missing(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The defaults ``environ`` (default ``os.environ``) lacks: neither the variable nor one it yields to is set."""
    env = os.environ if environ is None else environ
    return {name: value for name, value in DEFAULTS.items()
            if name not in env and not any(other in env for other in YIELDS_TO.get(name, ()))}


def apply_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """Set in ``environ`` (default ``os.environ``) each default it lacks (:func:`missing`)."""
    env = os.environ if environ is None else environ
    added = missing(env)
    env.update(added)
    if environ is None:
        _applied.update(added)


def current(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The values of :data:`VARIABLES` in effect here (the user's where set, else the defaults that apply): what a
    worker process of this run must start with. A default :func:`apply_defaults` put in ``os.environ`` counts as
    a default, so a wait policy added on top (a worker's ``device.env``) still drops the spin count."""
    env = os.environ if environ is None else environ
    user = {name: env[name] for name in VARIABLES
            if name in env and not (name in _applied and env[name] == DEFAULTS.get(name))}
    return {**user, **missing(user)}
