"""Environment variables a portrl process sets for itself before torch loads.

torch and its OpenMP runtime read these once, when torch is imported or at its first allocation, so
``portrl``'s command line applies them (:func:`apply_defaults`) before any command imports torch, and every
Ray worker of a run gets the driver's values (``portrl.workers.ray_env.worker_env``). A value the user set
wins; ``VAR=0 portrl train ...`` (or ``ACTIVE`` for the wait policy) opts out.

* ``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads sleep instead of spinning while they wait. Spinning threads made
  CPU training up to 10x slower whenever another process shares the cores (one forward/backward 0.29 s vs
  0.03 s).
* ``THP_MEM_ALLOC_ENABLE=1``: torch's CPU allocator asks Linux for transparent huge pages (2 MiB instead of
  4 KiB, ``madvise(MADV_HUGEPAGE)``) for every tensor of 2 MiB or more. A model's weights, a packed decode
  weight, a forward's activations then cost one page-table entry per 2 MiB: fewer TLB misses when a decode
  streams every weight, one page fault per 2 MiB instead of 512 when a large fresh tensor is first written.
  Measured on a 2-core Sapphire Rapids VM (benchmarks/RESULTS.md, run O): a 1-4 GiB ``torch.sum`` 15-18 ->
  24-29 GB/s, a 4096^3 matmul 216-223 -> 271-302 GFLOP/s, gathering 94 MB of rows into a fresh tensor 49 -> 20
  ms; Qwen2.5-0.5B GRPO steps 2-4 of a run 67-79 -> 64-75 s (decode 25.7-26.7 -> 24.3-24.7 s). Works where
  ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise`` (``portrl doctor`` says which).
  On a VM whose hypervisor takes freed memory back (free-page reporting), the first touch of huge pages a
  process has not used yet is slow: on that VM ~7-15 s per 2 GiB, and the first 0.5B step took 152 s against
  111 s (the steps after it win that back in about eight steps).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: variable -> value, applied where the user has not set the variable
DEFAULTS: dict[str, str] = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "THP_MEM_ALLOC_ENABLE": "1",
}


def apply_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """Set each of :data:`DEFAULTS` that ``environ`` (default ``os.environ``) does not have yet."""
    env = os.environ if environ is None else environ
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)


def current(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The values of :data:`DEFAULTS`' variables in effect here (the user's where set, else the default): what a
    worker process of this run must start with."""
    env = os.environ if environ is None else environ
    return {name: env.get(name, value) for name, value in DEFAULTS.items()}
