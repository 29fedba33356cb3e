"""What a config's ``device.env`` may set on the CPU backend, and what it may not, with why: the shared runtime
tables (backends/runtime_env.py), vLLM's CPU settings (``vllm/envs.py``), the choice of the native kernels' variant
(``PORTRL_CPU_ISA``, backends/cpu/isa.py; its value is checked with the config), and the folder the CPU's compiled
kernels are loaded from (backends/cpu/native_build.py)."""

from __future__ import annotations

from portrl.backends.runtime_env import ACCEPTED, NO_CODE, REFUSED

DECLARED: tuple[str, ...] = ACCEPTED + (
    "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
    "PORTRL_CPU_ISA",  # which variant of the native kernels runs (backends/cpu/isa.py); read when one first runs
)

REFUSED_HERE: dict[str, str] = {
    **REFUSED,
    "PORTRL_KERNEL_CACHE": f"it names the folder the CPU backend loads its compiled kernels from; {NO_CODE}",
    "PORTRL_CACHE": f"it moves portrl's cache, the folder the CPU backend loads its compiled kernels from "
                    f"among it; {NO_CODE}",
}
