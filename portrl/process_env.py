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

:func:`keep_freed_memory` is the allocator setting that cannot be an environment variable of a running process:
glibc's ``mallopt`` so that freed memory stays with the process (see its docstring). ``setup_process`` applies it
to every process whose tensors live in host memory (the CPU backend).
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Dict, MutableMapping, Optional

#: variable -> value, applied where the user has not set the variable
DEFAULTS: Dict[str, str] = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "THP_MEM_ALLOC_ENABLE": "1",
}


def apply_defaults(environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Set each of :data:`DEFAULTS` that ``environ`` (default ``os.environ``) does not have yet."""
    env = os.environ if environ is None else environ
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)


def current(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """The values of :data:`DEFAULTS`' variables in effect here (the user's where set, else the default): what a
    worker process of this run must start with."""
    env = os.environ if environ is None else environ
    return {name: env.get(name, value) for name, value in DEFAULTS.items()}


#: opt-out of :func:`keep_freed_memory` (set to 0)
KEEP_FREED_MEMORY_VAR = "PORTRL_KEEP_FREED_MEMORY"
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h parameter numbers


def keep_freed_memory(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Keep memory that torch frees inside the process (glibc: ``mallopt(M_MMAP_MAX, 0)``, every allocation from
    the heap, and ``mallopt(M_TRIM_THRESHOLD, 2^31 - 1)``, the heap's top never given back), so that the next step's
    tensors reuse pages already faulted in instead of asking the kernel for fresh ones. True when applied; False
    off glibc (musl, macOS) or with ``PORTRL_KEEP_FREED_MEMORY=0``.

    Why: by default glibc maps each allocation over 32 MiB on its own and unmaps it on free, so every large tensor
    of a step (activations, gathered rows, gradients) is fresh memory whose pages the kernel must fault in and
    zero again; on huge pages on a VM that first touch cost 16-635 ms for the same 2 x 47 MB call (the fused
    SwiGLU backward of a 0.5B update, 17 ms in reused memory). Measured (benchmarks/RESULTS.md, huge pages on in
    both arms): a 0.5B GRPO run's updates of steps 2-4 29.2 / 27.8 / 27.9 s against 46.2 / 36.7 / 36.9 s without
    it, whole steps 65.7 / 57.9 / 54.6 s against 82.3 / 66.8 / 64.2 s, step peak 13.27 against 12.98 GiB. Cost: the
    process's resident size stays at its high-water mark between phases (+2 % at the step's peak there).
    """
    env = os.environ if environ is None else environ
    if env.get(KEEP_FREED_MEMORY_VAR, "1").strip() == "0" or platform.system() != "Linux" \
            or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1) == 1
