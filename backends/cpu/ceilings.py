"""What this CPU allows, measured on this process's torch threads: memory read bandwidth and dense matmul FLOP/s.

:func:`memory_read_bandwidth`: ``nbytes / seconds`` of the fastest of a few ``torch.sum`` over a float32 tensor
several times the last-level cache (so it streams from memory); :func:`matmul_flops`: ``2 n^3 / seconds`` of the
fastest of a few ``n x n @ n x n`` products. benchmarks/_ceilings.py runs them at full size (a 1-4 GiB tensor,
n = 4096); :func:`measured_peak` runs small ones (under a second in all) once per process and dtype, for the
cpu backend's ``peak_throughput`` (portrl/device/peaks.py).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Callable

import torch

from portrl.device.peaks import PeakThroughput

#: the memory-read tensor: this many times the last-level cache, and at least / at most these sizes
READ_CACHE_MULTIPLE = 4
READ_MIN_BYTES = 1 << 30
READ_MAX_BYTES = 4 << 30
#: :func:`measured_peak`'s sizes: a read tensor of 4x the last-level cache within these bounds; matmuls from
#: n = 256 up, 1.5x larger each time, until one product takes QUICK_MATMUL_SECONDS (small products reach half the
#: FLOP/s of large ones; an emulated bf16 one takes that long at once) or n reaches QUICK_MATMUL_MAX_N
QUICK_READ_BYTES = (64 << 20, 512 << 20)
QUICK_MATMUL_SECONDS = 0.04
QUICK_MATMUL_MAX_N = 2048


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache Linux reports (/sys/devices/system/cpu/cpu0/cache), 0 when unknown."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=0)


def read_tensor_bytes(low: int = READ_MIN_BYTES, high: int = READ_MAX_BYTES) -> int:
    """Bytes of the memory-read benchmark's tensor: READ_CACHE_MULTIPLE x the last-level cache, within [low, high]."""
    return min(max(READ_CACHE_MULTIPLE * last_level_cache_bytes(), low), high)


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, after one untimed warm-up call (first touch of pages,
    kernel selection)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_read_bandwidth(nbytes: int | None = None, repeats: int = 5) -> dict:
    """Plain memory-read bandwidth: ``nbytes / seconds`` of the fastest of ``repeats`` ``torch.sum`` over a
    float32 tensor of ``nbytes`` (default :func:`read_tensor_bytes`). Returns ``{"bytes", "seconds",
    "bytes_per_s"}``."""
    nbytes = int(nbytes or read_tensor_bytes())
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    seconds = best_seconds(x.sum, repeats)
    return {"bytes": nbytes, "seconds": seconds, "bytes_per_s": nbytes / seconds}


def matmul_flops(n: int = 4096, repeats: int = 3, dtype: torch.dtype = torch.float32) -> dict:
    """Dense matmul throughput in ``dtype``: ``2 n^3 / seconds`` of the fastest of ``repeats`` ``n x n @ n x n``
    products (``torch.matmul`` into a preallocated output). Returns ``{"n", "seconds", "flops_per_s"}``."""
    a = torch.randn(n, n, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, dtype=torch.float32).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    seconds = best_seconds(lambda: torch.matmul(a, b, out=out), repeats)
    return {"n": n, "seconds": seconds, "flops_per_s": 2.0 * n ** 3 / seconds}


def measured_peak(dtype: str) -> PeakThroughput:
    """This process's matmul FLOP/s in ``dtype`` (a torch dtype name) and memory read bandwidth on its current
    torch threads, measured once per process, dtype and thread count, with the small sizes of ``QUICK_*``."""
    return _measure(dtype, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _measure(dtype: str, threads: int) -> PeakThroughput:
    n = 256
    while True:
        mm = matmul_flops(n, repeats=2, dtype=getattr(torch, dtype))
        if mm["seconds"] >= QUICK_MATMUL_SECONDS or n >= QUICK_MATMUL_MAX_N:
            break
        n = n * 3 // 2
    read = memory_read_bandwidth(read_tensor_bytes(*QUICK_READ_BYTES), repeats=3)
    return PeakThroughput(mm["flops_per_s"], read["bytes_per_s"],
                          f"measured on {threads} threads: {mm['n']}^3 {dtype} matmul, sum over "
                          f"{read['bytes'] >> 20} MiB")
