"""Peak memory per phase: the CPU backend reads this process's resident memory and its high-water mark from
/proc and restarts the mark per phase; the trainer's Timer folds each phase's peak into the phases around it."""

from __future__ import annotations

import numpy as np
import pytest

from portrl.device import get_backend
from portrl.trainer.metrics import Timer

MIB = 2**20


def _touch(mib: int) -> np.ndarray:
    a = np.empty(mib * MIB // 8)
    a[:] = 1.0  # resident only once written
    return a


def test_cpu_memory_stats_and_reset():
    cpu = get_backend("cpu")
    stats = cpu.memory_stats()
    if not stats:
        pytest.skip("no /proc/self/status here")
    assert 0 < stats["allocated"] <= stats["peak_allocated"]
    block = _touch(200)
    high = cpu.memory_stats()["peak_allocated"]
    del block
    cpu.reset_peak_memory()
    after = cpu.memory_stats()
    assert after["peak_allocated"] < high - 100 * MIB  # the mark restarted below the freed block


def test_cpu_memory_available_is_the_hosts_and_drops_when_memory_is_taken():
    cpu = get_backend("cpu")
    free = cpu.memory_available()
    if free is None:
        pytest.skip("no /proc/meminfo here")
    total = int(open("/proc/meminfo").readline().split()[1]) * 1024  # MemTotal, the first line
    assert 0 < free <= total
    block = _touch(512)
    assert cpu.memory_available() < free - 256 * MIB  # other processes move it too: half the block is the margin
    del block


def test_timer_peaks_per_phase_fold_into_the_enclosing_phase():
    cpu = get_backend("cpu")
    if not cpu.memory_stats():
        pytest.skip("no /proc/self/status here")
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
    assert set(Timer().metrics()) == set()  # without a backend: no memory keys, and no phases yet
