"""The CPU backend's allocator (backends/cpu/heap.py, counting_allocator.cpp): once the backend is configured,
freed memory stays in the process, ``empty_cache`` gives it back, tensor bytes are counted exactly and the
per-phase peaks stay per phase; the variable opts out. Each case runs in a fresh interpreter: the allocator
lasts for the life of a process."""

import platform
import subprocess
import sys

import pytest

from portrl.backends.cpu import heap

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt and malloc_trim")

_PRELUDE = """
import torch
from portrl.device import get_backend
cpu = get_backend("cpu")
cpu.configure_allocator()

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) >> 10
"""

_KEPT_THEN_RELEASED = _PRELUDE + """
before = rss_mib()
x = torch.ones(160 << 20)  # 640 MiB, written: more than heap.RELEASE_MIN_BYTES
del x
kept = rss_mib() - before
cpu.empty_cache()
print(kept, rss_mib() - before)
"""

_KEPT_IS_AVAILABLE = _PRELUDE + """
from portrl.backends.cpu import heap
x = torch.ones(160 << 20)  # 640 MiB, written: more than heap.RELEASE_MIN_BYTES
taken = cpu.memory_available()
del x
kept_mib, avail_rise_mib = heap.kept_free_bytes() >> 20, (cpu.memory_available() - taken) >> 20
cpu.empty_cache()
print(kept_mib, avail_rise_mib, heap.kept_free_bytes() >> 20)
"""

_SMALL_KEPT = _PRELUDE + """
from portrl.backends.cpu import heap
x = torch.ones(64 << 20)  # 256 MiB, written: what the medium benchmark model's heap keeps at a rollout
del x
kept = rss_mib()
cpu.empty_cache()
print(heap.RELEASE_MIN_BYTES >> 20, kept - rss_mib())
"""

# A freed block at the heap's top over 2 GiB (a 0.5B step's recording): glibc's own trim gave it back, and the next
# rollout faulted it in again, while the threshold was 2^31 - 1. malloc directly: nothing is allocated above it.
_LARGE_TOP_KEPT = """
import ctypes
from portrl.backends.cpu import heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
assert heap.keep_freed()
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) >> 10
n = 2304 << 20
before = rss_mib()
p = libc.malloc(n)
ctypes.memset(p, 1, n)
written = rss_mib() - before
libc.free(p)
print(written, rss_mib() - before)
"""

_COUNTED = _PRELUDE + """
base = cpu.memory_stats()["allocated"]
x, y = torch.ones(1000), torch.empty(3 << 20)  # 4000 B and 12 MiB
during = cpu.memory_stats()
del x, y
after = cpu.memory_stats()
print(during["allocated"] - base, during["peak_allocated"] - base, after["allocated"] - base,
      after["peak_allocated"] - base)
"""

_PHASE_PEAKS = _PRELUDE + """
from portrl.trainer.metrics import Timer
before = rss_mib()
timer = Timer(memory=cpu)
with timer("step"):
    with timer("big"):
        x = torch.ones(96 << 20)  # 384 MiB
        del x
    with timer("small"):
        x = torch.ones(8 << 20)  # 32 MiB
        del x
m = timer.metrics()
print(*(round(m[f"memory/peak_gib/{k}"] * 1024) for k in ("big", "small", "step")),
      round(m["memory/peak_resident_gib"] * 1024) - before)
"""

# A step's tensors again: a large one (huge pages advised) among small allocations, freed, then the same sizes.
_SAME_SIZES_AGAIN = _PRELUDE + """
import resource
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ptrs = []
for step in range(3):
    small = [torch.ones(1000 + i) for i in range(50)]
    big = torch.empty(6 << 20)  # 24 MiB
    before = faults()
    big.fill_(1)
    touched = faults() - before
    aligned = big.data_ptr() % (2 << 20) == 0
    ptrs.append(big.data_ptr())
    del small, big
print(touched, int(aligned), int(ptrs[2] == ptrs[1]))
"""

_TOO_LARGE = _PRELUDE + """
try:
    torch.empty(1 << 60, dtype=torch.uint8)
except torch.OutOfMemoryError as e:
    print(int("not enough memory" in str(e)))
"""


def _run(code: str, keep: str = "1", huge_pages: str = "0") -> list[int]:
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin", "THP_MEM_ALLOC_ENABLE": huge_pages,
           heap.KEEP_FREED_MEMORY_VAR: keep}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [int(v) for v in out.stdout.splitlines()[-1].split()]


def test_a_freed_tensor_stays_resident_until_empty_cache():
    kept, after_release = _run(_KEPT_THEN_RELEASED)
    assert kept == pytest.approx(640, abs=32)  # the next tensor reuses these pages
    assert after_release < 32


def test_a_freed_top_over_2_gib_stays_resident():
    written, kept = _run(_LARGE_TOP_KEPT)
    assert written == pytest.approx(2304, abs=32)
    assert kept == pytest.approx(written, abs=32)


def test_a_heap_keeping_little_is_not_trimmed():
    """Handing back a few hundred MiB only makes the next step fault them in again: below RELEASE_MIN_BYTES
    free, ``empty_cache`` leaves the heap's pages where they are (a freed 256 MiB tensor stays resident)."""
    threshold_mib, given_back = _run(_SMALL_KEPT)
    assert threshold_mib > 256
    assert given_back < 4


def test_opting_out_leaves_glibc_to_unmap_large_frees_and_still_counts():
    kept, _ = _run(_KEPT_THEN_RELEASED, keep="0")
    assert kept < 32  # a 640 MiB tensor was its own mapping, unmapped on free
    during, peak, after, _ = _run(_COUNTED, keep="0")
    assert during == peak == 4000 + (12 << 20) and after == 0


def test_memory_the_heap_keeps_is_counted_as_available_until_given_back():
    """The rollout's recording is sized by ``memory_available``: a freed block the heap keeps (and the next
    tensors reuse without the kernel) counts, as it did when the rollout trimmed the heap first."""
    kept, rise, after_release = _run(_KEPT_IS_AVAILABLE)
    assert kept >= 640
    assert rise > 320  # other processes move MemAvailable too: half the block is the margin
    assert after_release < 32
    assert _run(_KEPT_IS_AVAILABLE, keep="0")[0] < 32  # nothing kept: the kernel has it, MemAvailable counts it


@pytest.mark.parametrize("huge_pages", ["0", "1"])
def test_the_same_sizes_again_reuse_pages_already_faulted_in(huge_pages):
    # each tensor asks glibc for one chunk of its size plus its alignment, and the count allocates nothing: the
    # chunk a freed tensor left fits the next one of its size (c10's posix_memalign for huge pages did not)
    touched, aligned, same_chunk = _run(_SAME_SIZES_AGAIN, huge_pages=huge_pages)
    assert same_chunk and touched < 64  # a fresh 24 MiB: 6144 faults (4 KiB pages) or 12 or more (2 MiB)
    assert aligned == (huge_pages == "1")


def test_an_allocation_larger_than_memory_is_torchs_out_of_memory_error():
    assert _run(_TOO_LARGE) == [1]


def test_tensor_bytes_are_counted_exactly_with_their_peak():
    during, peak, after, peak_after = _run(_COUNTED)
    assert during == peak == peak_after == 4000 + (12 << 20)
    assert after == 0


def test_phase_peaks_leave_out_what_earlier_phases_freed():
    big, small, step, resident_rise = _run(_PHASE_PEAKS)
    assert big - small > 300  # the small phase's tensors: not the big one's 384 MiB
    assert step >= big
    assert resident_rise > 300  # the process's own peak still has them


def test_setup_process_configures_the_backends_allocator(monkeypatch):
    from portrl.config.options_schema import default_config
    from portrl.device import get_backend
    from portrl.workers import setup

    cpu = get_backend("cpu")
    calls = []
    monkeypatch.setattr(type(cpu), "configure_allocator", lambda self: calls.append(self.name))
    setup.setup_process(default_config(), cpu)
    assert calls == ["cpu"]


def test_without_a_compiler_there_is_no_count_and_resident_memory_is_still_reported(monkeypatch, caplog):
    from portrl.backends.cpu import native_build
    from portrl.device import get_backend

    monkeypatch.setattr(heap, "_counting", False)
    monkeypatch.setattr(native_build, "compiler", lambda: None)
    with caplog.at_level("WARNING"):
        assert heap.count_tensors() is False
    assert not caplog.records  # quiet: the CPU kernels fall back the same way
    stats = get_backend("cpu").memory_stats()
    assert "allocated" not in stats and "peak_allocated" not in stats  # no phase peaks rather than wrong ones
    assert 0 < stats["resident"] <= stats["peak_resident"]
