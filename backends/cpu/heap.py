"""The CPU device's memory: this process's tensors counted, and its glibc heap kept instead of given back.

By default glibc maps every allocation over 32 MiB on its own and unmaps it on free, so each large tensor of a
step (activations, gathered rows, gradients) is fresh memory whose pages the kernel must fault in and zero
again, which with huge pages on a VM costs far more than reusing memory (docs/performance.md).
:func:`keep_freed` makes the heap hold freed memory instead (``mallopt(M_MMAP_MAX, 0)``: every allocation from the
heap; ``mallopt(M_TRIM_THRESHOLD, -1)``: its top is never given back, however large; a threshold of 2^31 - 1 still
gave back a top over 2 GiB, as a 0.5B step's freed recording is, for the next rollout to fault in again), the CPU
counterpart of a GPU's caching allocator; :func:`release_kept` is that cache's ``empty_cache`` (``malloc_trim(0)``:
every whole free page of every arena back to the kernel), and :func:`kept_free_bytes` is what it holds free
(glibc's ``mallinfo2().fordblks``), counted as available memory.

The process's resident size cannot tell one phase's peak from another's (its high-water mark can only be reset
through /proc/self/clear_refs, which also resets the ``ru_maxrss`` that ``time -v`` and the benchmarks read; and
with memory kept it stays at its high-water mark), so :func:`count_tensors` installs a CPU allocator with a count of
live tensor bytes (backends/cpu/counting_allocator.cpp, built by the host's C++ compiler once; one ``malloc`` a
tensor, so that a freed tensor's chunk fits the next one of its size, its pages already faulted in):
:func:`tensor_bytes` is then what a GPU's ``memory_allocated`` / ``max_memory_allocated`` are. Without a
compiler there is no count; off glibc (musl, macOS) or with ``PORTRL_KEEP_FREED_MEMORY=0`` nothing is kept.
(What keeping freed memory saved a 0.5B GRPO step: docs/performance.md.)
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from collections.abc import Mapping

#: set to 0 to opt out of :func:`keep_freed`
KEEP_FREED_MEMORY_VAR = "PORTRL_KEEP_FREED_MEMORY"
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h parameter numbers
_NEVER = -1  # M_TRIM_THRESHOLD's "never trim" (mallopt(3)): glibc reads the int as a size_t, SIZE_MAX
_kept = False
log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)  # platform.libc_ver() reads the interpreter's binary: once per process
def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


_counting = False


def count_tensors() -> bool:
    """Install the counting CPU allocator (idempotent); False when its library cannot be built here (no compiler:
    quietly, as the CPU kernels do; a failed build: native_build's one warning)."""
    global _counting
    if _counting:
        return True
    import torch  # noqa: PLC0415  (torch: the doctor runs without it)

    from . import native_build  # noqa: PLC0415  (native_build imports torch: the doctor runs without it)

    if native_build.compiler() is None:
        log.info("no per-phase tensor memory: no C++ compiler to build backends/cpu/counting_allocator.cpp")
        return False
    _counting = native_build.try_load("counting_allocator") and bool(torch.ops.portrl_cpu_memory.install())
    return _counting


def keep_freed(environ: Mapping[str, str] | None = None) -> bool:
    """Keep freed memory in this process's heap from now on; True when in effect, False (nothing changed) off
    glibc or with ``PORTRL_KEEP_FREED_MEMORY=0``. Idempotent."""
    global _kept
    env = os.environ if environ is None else environ
    libc = _glibc()
    if _kept or env.get(KEEP_FREED_MEMORY_VAR, "1").strip() == "0" or libc is None:
        return _kept
    _kept = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER) == 1
    return _kept


def keeping() -> bool:
    """Whether :func:`keep_freed` is in effect in this process."""
    return _kept


def tensor_bytes() -> tuple[int, int] | None:
    """(live, peak) bytes of the tensors allocated since :func:`count_tensors`; None without the count."""
    if not _counting:
        return None
    import torch  # noqa: PLC0415  (torch: the doctor runs without it)

    live, peak = torch.ops.portrl_cpu_memory.stats()
    return int(live), int(peak)


def reset_tensor_peak() -> None:
    """Restart the peak of :func:`tensor_bytes` from the live bytes now."""
    if _counting:
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        torch.ops.portrl_cpu_memory.reset_peak()


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc >= 2.33): ten ``size_t`` counters over every arena."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_free_bytes() -> int:
    """``mallinfo2().fordblks``: the heap's free bytes over every arena, resident or given back (0 before glibc
    2.33 or off glibc)."""
    libc = _glibc()
    mallinfo2 = getattr(libc, "mallinfo2", None) if libc is not None else None
    if mallinfo2 is None:
        return 0
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


_given_back = 0  # the heap's free bytes right after the last release_kept: no longer resident


def kept_free_bytes() -> int:
    """Resident bytes the heap holds free for the next allocations, 0 unless :func:`keep_freed` is in effect:
    its free bytes less those :func:`release_kept` gave back (their chunks stay in the heap's free lists, their
    pages with the kernel; counted again only as the heap's free bytes grow past that, so an underestimate once
    those chunks are reused). Some of it is fragments smaller than a large tensor: an upper bound on what a large
    allocation finds without new pages."""
    return max(0, _heap_free_bytes() - _given_back) if _kept else 0


#: the fewest free bytes the heap must hold for :func:`release_kept` to trim it. Below this the pages handed back
#: are faulted in again by the next step at more cost than they free (the small and medium benchmark configurations
#: hold ~30 and 150-270 MiB free at a rollout: docs/performance.md). No step of a run calls it any more (the hf
#: engine stopped emptying the cache before each rollout, portrl/rollout/hf_engine.py): it serves an explicit
#: ``Backend.empty_cache``.
RELEASE_MIN_BYTES = 512 << 20


def release_kept() -> bool:
    """Give the free memory the heap kept back to the kernel (``malloc_trim(0)``) once the heap holds at least
    :data:`RELEASE_MIN_BYTES` free; True when some was released. Does nothing unless :func:`keep_freed` is in
    effect (glibc's own trimming handles the rest)."""
    global _given_back
    libc = _glibc() if _kept else None
    if libc is None or _heap_free_bytes() < RELEASE_MIN_BYTES:
        return False
    released = bool(libc.malloc_trim(0))
    _given_back = _heap_free_bytes()
    return released
