"""Peak memory per phase: the CPU backend counts tensor bytes (backends/cpu/heap.py, tests/test_cpu_heap.py) and
reads the process's resident memory and its lifetime high-water mark from /proc; the trainer's Timer folds
each phase's peak into the phases around it."""

from __future__ import annotations

import resource

import numpy as np
import pytest
import torch

from portrl.device import get_backend
from portrl.trainer.metrics import Timer

MIB = 2**20


def _touch(mib: int) -> torch.Tensor:
    return torch.ones(mib * MIB // 4)  # resident only once written


def test_cpu_memory_stats_never_reset_the_processes_own_peak():
    """Resetting the phase peak leaves the resident high-water mark and ``ru_maxrss`` alone (writing
    /proc/self/clear_refs resets both: the benchmarks' peak RSS once read the last phase's peak only)."""
    cpu = get_backend("cpu")
    stats = cpu.memory_stats()
    if not stats:
        pytest.skip("no /proc/self/status here")
    assert 0 < stats["resident"] <= stats["peak_resident"]
    block = _touch(200)
    high = cpu.memory_stats()["peak_resident"]
    del block
    cpu.empty_cache()
    cpu.reset_peak_memory()
    assert cpu.memory_stats()["peak_resident"] >= high - 8 * MIB  # the kernel syncs per-thread RSS counts lazily
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 >= high - 8 * MIB


def test_cpu_memory_available_is_the_hosts_and_drops_when_memory_is_taken():
    cpu = get_backend("cpu")
    cpu.empty_cache()  # memory this process kept (backends/cpu/heap.py) would serve the block without the kernel
    free = cpu.memory_available()
    if free is None:
        pytest.skip("no /proc/meminfo here")
    total = int(open("/proc/meminfo").readline().split()[1]) * 1024  # MemTotal, the first line
    assert 0 < free <= total
    block = np.ones(512 * MIB // 8)  # written, so resident
    assert cpu.memory_available() < free - 256 * MIB  # other processes move it too: half the block is the margin
    del block


def test_timer_peaks_per_phase_fold_into_the_enclosing_phase():
    cpu = get_backend("cpu")
    cpu.configure_allocator()  # the tensor count (what the trainer's setup_process installs)
    if "peak_allocated" not in cpu.memory_stats():
        pytest.skip("no tensor count here (no C++ compiler)")
    timer = Timer(memory=cpu)
    with timer("step"):
        with timer("big"):
            block = _touch(300)
            del block
        with timer("small"):
            block = _touch(20)
            del block
    m = timer.metrics()
    big, small, step = (m[f"memory/peak_gib/{k}"] * 2**30 for k in ("big", "small", "step"))
    assert big - small > 200 * MIB  # the small phase does not inherit the big one's peak
    assert step >= big  # the step includes its phases
    assert m["memory/peak_resident_gib"] * 2**30 > big  # the process's own peak, over the whole time
    assert set(Timer().metrics()) == set()  # without a backend: no memory keys, and no phases yet
