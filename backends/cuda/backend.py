"""The NVIDIA CUDA backend: ``torch.cuda``, NCCL collectives, Ray resource "GPU".

Facts (PyTorch and Ray documentation): device type "cuda"; process group "nccl"; Ray sets
``CUDA_VISIBLE_DEVICES`` for each worker unless ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``
is set. A ROCm build of torch also answers to ``torch.cuda``; the two are told apart by
``torch.version.hip`` (set on ROCm builds, None on CUDA builds) — see backends/rocm.

:meth:`probe` never initialises CUDA: it reads package metadata and ``torch.version`` and
counts devices with ``torch.cuda.device_count()``, which asks NVML first and does not create
a CUDA context. What only hardware confirms: the device name, bf16 and fp8 support (these read
the device properties, which initialises CUDA, so they are called at run time, not by probe).
"""

from __future__ import annotations

import glob
import os
import warnings
from types import ModuleType
from typing import ClassVar, Sequence

from portrl.backends.cuda import env as env_tables
from portrl.backends.cuda.peaks import DEVICE_MODELS
from portrl.device.backend import (Backend, KernelRegistry, ProbeResult, module_available, torch_memory_available,
                                   torch_memory_stats)
from portrl.device.versions import CompatRow, package_version

# the command of the first compatibility row (torch 2.8.0, vLLM 0.11.0, flash-attn 2.8.3), as docs/backends/nvidia.md spells it;
# it ends the message, so that it can be copied as it stands (tests/test_cli_errors.py checks the pin)
NVIDIA_NODES = "/dev/nvidia[0-9]*"  # one per GPU (nvidiactl, nvidia-uvm are not GPUs)
WSL_GPU_NODE = "/dev/dxg"  # WSL 2's GPU paravirtualisation: CUDA (and ROCm) without vendor device nodes


def nvidia_devices(pattern: str = NVIDIA_NODES) -> list[str]:
    """NVIDIA GPU device nodes on this host (``/dev/nvidia0`` ...; ``nvidiactl``, ``nvidia-uvm`` are not GPUs)."""
    return sorted(p for p in glob.glob(pattern) if p[len("/dev/nvidia"):].isdigit())


TORCH_CUDA_INSTALL = ('of one compatibility row (torch 2.8.0, vLLM 0.11.0, flash-attn 2.8.3): '
                      'pip install "torch==2.8.0" --index-url https://download.pytorch.org/whl/cu128')
VLLM_INSTALL = 'pip install -e ".[cuda]"'  # in the portrl checkout: flash-attn, vLLM


def fp8_dtype_for_capability(capability: tuple[int, int]) -> str | None:
    """fp8 e4m3 dtype for an NVIDIA compute capability: OCP ``float8_e4m3fn`` from sm_89 (Ada) and sm_90 (Hopper) on."""
    return "float8_e4m3fn" if tuple(capability) >= (8, 9) else None


class CUDABackend(Backend):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    ray_resource = "GPU"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_noset_env = ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",)
    detect_priority = 10
    declared_env = env_tables.DECLARED  # device.env: backends/cuda/env.py
    refused_env = env_tables.REFUSED_HERE
    device_models = DEVICE_MODELS  # the peak table: backends/cuda/peaks.py
    version_packages: ClassVar[tuple[str, ...]] = ("torch", "transformers", "triton", "vllm", "flash-attn")
    compat_rows: ClassVar[tuple[CompatRow, ...]] = (
        CompatRow({"torch": "2.8.0", "vllm": "0.11.0", "flash-attn": "2.8.3"},
                  "vLLM 0.11.0 pins torch==2.8.0; flash-attn 2.8.3 publishes wheels up to torch 2.8",
                  'pip install "torch==2.8.0" --index-url https://download.pytorch.org/whl/cu128 && '
                  'pip install "vllm==0.11.0" && pip install "flash-attn==2.8.3" --no-build-isolation'),
        CompatRow({"torch": "2.7.1", "vllm": "0.10.0", "flash-attn": "2.8.3"},
                  "vLLM 0.10.0 pins torch==2.7.1",
                  'pip install "torch==2.7.1" --index-url https://download.pytorch.org/whl/cu128 && '
                  'pip install "vllm==0.10.0" && pip install "flash-attn==2.8.3" --no-build-isolation'),
    )

    # --- probe ----------------------------------------------------------------------------------
    def host_shows_device(self) -> tuple[bool | None, str]:
        """A host with an NVIDIA GPU has its device nodes, ``/dev/nvidia<N>`` (in a container: passed by the NVIDIA
        container runtime); WSL 2 reaches the GPU through ``/dev/dxg`` instead, where nodes tell nothing."""
        if nvidia_devices():
            return True, ""
        if os.path.exists(WSL_GPU_NODE) or not os.path.isdir("/dev"):
            return None, ""
        return False, ("no /dev/nvidia<N> device nodes: no NVIDIA driver on this host, or a container started "
                       "without its GPUs (docker run --gpus all)")

    def probe(self) -> ProbeResult:
        absent = self.no_device_here()  # no device: say so, not how to install a CUDA build of torch
        if absent is not None:
            return absent
        versions = self.installed_versions()
        if not module_available("torch"):
            return ProbeResult(False, f"torch is not installed; install a CUDA build {TORCH_CUDA_INSTALL}", versions=versions)
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        wrong_build = self._wrong_build_reason(torch)
        if wrong_build:
            return ProbeResult(False, wrong_build, versions=versions)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            count = int(torch.cuda.device_count())
        if count == 0:
            return ProbeResult(False, self._no_device_reason(torch, caught), versions=versions)
        return ProbeResult(True, device_count=count, device_name=self._device_name_without_init(), versions=versions)

    def _wrong_build_reason(self, torch: ModuleType) -> str:
        if torch.version.hip:
            return f"torch {torch.__version__} is a ROCm (HIP {torch.version.hip}) build; use --device rocm"
        if not torch.version.cuda:
            return f"torch {torch.__version__} was built without CUDA; install a CUDA build {TORCH_CUDA_INSTALL}"
        return ""

    def _no_device_reason(self, torch: ModuleType, caught: Sequence[warnings.WarningMessage]) -> str:
        env = os.environ.get(self.visible_devices_env)
        hint = f"{self.visible_devices_env}={env!r}" if env is not None else f"{self.visible_devices_env} unset"
        detail = "; ".join(str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip())
        reason = f"no CUDA device visible to torch {torch.__version__} (CUDA {torch.version.cuda}; {hint})"
        if detail:
            return f"{reason}: {detail}"  # e.g. "The NVIDIA driver on your system is too old" = version mismatch
        return f"{reason}; check the driver with nvidia-smi"

    def _device_name_without_init(self) -> str:
        """GPU 0's name from NVML (nvidia-ml-py) when installed; empty otherwise. Never creates a CUDA context."""
        if not module_available("pynvml"):
            return ""
        try:
            import pynvml  # noqa: PLC0415  (optional dependency: pynvml)

            pynvml.nvmlInit()
            try:
                name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            finally:
                pynvml.nvmlShutdown()
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # NVML missing or refusing: the name is cosmetic
            return ""

    def device_name(self) -> str:
        """GPU 0's name from NVML (no CUDA context), else torch's where this process has already initialised CUDA:
        the trainer's process of a Ray run holds no device, and a context there would take memory on one."""
        name = self._device_name_without_init()
        if name:
            return name
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        return super().device_name() if torch.cuda.is_initialized() else ""

    # --- memory (torch.cuda's caching allocator counts it) ------------------------------------
    def memory_stats(self) -> dict[str, int]:
        return torch_memory_stats(self._module())

    def reset_peak_memory(self) -> None:
        self._module().reset_peak_memory_stats()

    def memory_available(self) -> int | None:
        """``torch.cuda.mem_get_info()``'s free bytes on the current device."""
        return torch_memory_available(self._module())

    # --- dtypes (run time: these read device properties) ---------------------------------------
    def supports_bf16(self) -> bool:
        """bf16 needs compute capability >= 8.0 (Ampere); asks torch, which initialises CUDA."""
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        return bool(torch.cuda.is_bf16_supported())

    def fp8_dtype(self) -> str | None:
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        return fp8_dtype_for_capability(torch.cuda.get_device_capability())

    # --- kernels and engines --------------------------------------------------------------------
    def register_kernels(self, registry: KernelRegistry) -> None:
        from portrl.backends.cuda.kernels import register  # noqa: PLC0415  (torch: the doctor runs without it)

        register(registry)

    def kernel_preferences(self) -> dict[str, tuple[str, ...]]:
        return {
            "attention_varlen": ("flash_attn3", "flash_attn", "sdpa", "native"),
            "logprobs_entropy": ("triton", "native"),
            "rms_norm": ("triton", "native"),
            "rotary": ("triton", "native"),
            "swiglu": ("triton", "native"),
        }

    def rollout_engines(self) -> tuple[str, ...]:
        """vLLM, then SGLang (backends/sglang/), where installed; hf always."""
        return tuple(e for e, dist in (("vllm", "vllm"), ("sglang", "sglang")) if package_version(dist)) + ("hf",)

    # --- profiling ------------------------------------------------------------------------------
    profiler_activities = ("CUDA",)  # kernels and memcpys through CUPTI
    range_api = "NVTX"

    def range_push(self, name: str) -> None:
        """``torch.cuda.nvtx.range_push``: the range shows in Nsight Systems (``nsys profile``)."""
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        torch.cuda.nvtx.range_push(name)

    def range_pop(self) -> None:
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        torch.cuda.nvtx.range_pop()

    # --- environment ----------------------------------------------------------------------------
    def env_presets(self, deterministic: bool = False) -> dict[str, str]:
        """Allocator: expandable segments (less fragmentation with rollout/train switching).

        Deterministic: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (torch requires it for deterministic
        cuBLAS) and ``NCCL_ALGO=Ring`` (a ring reduces in a fixed order; NCCL has no
        "deterministic" switch — Megatron-LM's deterministic mode uses the same setting).
        """
        env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        if deterministic:
            env.update({"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"})
        return env
