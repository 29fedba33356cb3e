"""The Huawei Ascend backend: torch_npu (device "npu" through PrivateUse1), HCCL collectives, Ray "NPU".

Facts (torch_npu, Ray and CANN documentation): torch_npu registers the device type "npu" and ``torch.npu`` when
imported; the process group is "hccl"; Ray's resource is "NPU" and Ray sets
``ASCEND_RT_VISIBLE_DEVICES`` per worker (opt-out ``RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES``).
CANN must be sourced (``set_env.sh``) before torch_npu can load. bf16 on 910B / A2 / A3; the first
generation 910 (910A) computes fp16 only. torch_npu declares a ``torch.backends`` entry point, so
``import torch`` imports torch_npu when it is installed, unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.

:meth:`probe` checks the ``/dev/davinci*`` device nodes (none: this host has no NPU, whatever is installed),
then package metadata, the torch/torch_npu pairing and the CANN environment before it imports torch_npu, then counts devices with
``torch.npu.device_count()``. That torch_npu's import and device count leave the device
uninitialised is the vendor's documented behaviour of a lazy init that only hardware confirms.
"""

from __future__ import annotations

import glob
import importlib
import os
import re
from types import ModuleType
from typing import TYPE_CHECKING

from portrl.backends.npu import env as env_tables
from portrl.backends.npu.peaks import DEVICE_MODELS
from portrl.backends.npu.versions import (
    CANN_SET_ENV,
    COMPAT_ROWS,
    cann_home,
    cann_version,
    torch_pair_mismatch,
)
from portrl.device.backend import (Backend, KernelRegistry, ProbeResult, module_available, torch_memory_available,
                                   torch_memory_stats)
from portrl.device.checks import FAIL, OK, WARN, Check
from portrl.device.versions import package_version

if TYPE_CHECKING:  # torch is imported where it is used
    import torch

# one compatibility row (torch 2.10.0, torch-npu 2.10.0.post4, CANN 9.1.0), as docs/backends/ascend.md installs it (in the
# portrl checkout); it ends the message, so that it can be copied as it stands
NPU_INSTALL = ('install one row (torch 2.10.0, torch-npu 2.10.0.post4, CANN 9.1.0) from the portrl checkout: '
               'pip install "torch==2.10.0" --index-url https://download.pytorch.org/whl/cpu && pip install -e ".[npu]"')
DAVINCI_NODES = "/dev/davinci[0-9]*"
# First-generation Ascend 910 SoC names (torch_npu's SoC table); later 910B1..4 / 910_93xx have bf16.
_FP16_ONLY_SOC = re.compile(r"^Ascend910(Pro|Premium)?[AB]$")


def bf16_supported_for_soc(soc_name: str) -> bool:
    """False for the first-generation Ascend 910 (fp16 only), True for 910B / A2 / A3 and later."""
    return not _FP16_ONLY_SOC.match(soc_name.strip())


def davinci_devices(pattern: str = DAVINCI_NODES) -> list[str]:
    """Ascend device nodes on this host (``/dev/davinci0`` ...; the manager node is excluded)."""
    return sorted(p for p in glob.glob(pattern) if p[len("/dev/davinci"):].isdigit())


class NPUBackend(Backend):
    name = "npu"
    device_models = DEVICE_MODELS  # the peak table (models without published peaks): backends/npu/peaks.py
    device_type = "npu"
    dist_backend = "hccl"
    ray_resource = "NPU"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_noset_env = ("RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",)
    detect_priority = 30
    version_packages = ("torch", "torch-npu", "transformers", "vllm", "vllm-ascend", "triton-ascend")
    compat_rows = COMPAT_ROWS
    declared_env = env_tables.DECLARED  # device.env: backends/npu/env.py
    refused_env = env_tables.REFUSED_HERE

    def installed_versions(self) -> dict[str, str]:
        versions = super().installed_versions()
        cann = cann_version()
        if cann:
            versions["CANN"] = cann
        return versions

    # --- probe ----------------------------------------------------------------------------------
    def host_shows_device(self) -> tuple[bool | None, str]:
        """An Ascend host has its device nodes, ``/dev/davinci<N>`` (in a container: passed with ``--device``)."""
        if davinci_devices():
            return True, ""
        return False, ("no /dev/davinci<N> device nodes: no Ascend driver on this host, or a container started without "
                       "--device /dev/davinciN /dev/davinci_manager /dev/devmm_svm /dev/hisi_hdc")

    def probe(self) -> ProbeResult:
        absent = self.no_device_here()  # no device: say so, not how to install torch_npu
        if absent is not None:
            return absent
        versions = self.installed_versions()
        reason = self._static_reason(versions)
        if reason:
            return ProbeResult(False, reason, versions=versions)
        try:
            count = int(self._module().device_count())
        except Exception as exc:  # a broken CANN / driver surfaces here; report it verbatim
            return ProbeResult(False, f"import torch_npu failed: {type(exc).__name__}: {exc}", versions=versions)
        if count == 0:
            env = os.environ.get(self.visible_devices_env)
            return ProbeResult(False, f"torch_npu sees no NPU ({self.visible_devices_env}={env!r}); check npu-smi info",
                               versions=versions)
        return ProbeResult(True, device_count=count, versions=versions)

    def _static_reason(self, versions: dict[str, str]) -> str:
        """Why not usable on a host with device nodes, from metadata and environment only (no import); "" when those
        pass."""
        if not module_available("torch"):
            return "torch is not installed; " + NPU_INSTALL
        npu = versions.get("torch-npu")
        if npu is None or not module_available("torch_npu"):
            return "torch_npu is not installed; " + NPU_INSTALL
        mismatch = torch_pair_mismatch(versions.get("torch", ""), npu)
        if mismatch:
            return mismatch
        if not cann_home():
            return f"CANN environment not loaded (ASCEND_TOOLKIT_HOME / ASCEND_HOME_PATH unset); run: {CANN_SET_ENV}"
        return ""

    # --- device and memory ----------------------------------------------------------------------
    @staticmethod
    def _import_plugin() -> ModuleType:
        """Import torch_npu, which registers the "npu" device type and ``torch.npu``."""
        return importlib.import_module("torch_npu")

    def _module(self) -> ModuleType:
        self._import_plugin()
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        return torch.npu  # type: ignore[attr-defined]  # torch.npu exists once torch_npu is imported

    def device(self, index: int | None = None) -> torch.device:
        self._import_plugin()
        return super().device(index)

    def memory_stats(self) -> dict[str, int]:
        """``torch.npu``'s allocator counts, as torch.cuda's (torch_npu mirrors its memory API)."""
        return torch_memory_stats(self._module())

    def reset_peak_memory(self) -> None:
        self._module().reset_peak_memory_stats()

    def memory_available(self) -> int | None:
        """``torch.npu.mem_get_info()``'s free bytes on the current device."""
        return torch_memory_available(self._module())

    # --- dtypes ---------------------------------------------------------------------------------
    def supports_bf16(self) -> bool:
        """From the SoC name of the current device (reads device properties at run time)."""
        mod = self._module()
        return bf16_supported_for_soc(mod.get_device_name(mod.current_device()))

    def fp8_dtype(self) -> str | None:
        """None: 910B / A2 / A3 have no fp8 matrix compute."""
        return None

    # --- kernels and engines --------------------------------------------------------------------
    def register_kernels(self, registry: KernelRegistry) -> None:
        from portrl.backends.npu.kernels import register  # noqa: PLC0415  (torch: the doctor runs without it)

        register(registry)

    def kernel_preferences(self) -> dict[str, tuple[str, ...]]:
        return {
            "attention_varlen": ("npu_fusion", "native"),
            "logprobs_entropy": ("native",),
            "rms_norm": ("npu_rms_norm", "native"),
            "rotary": ("npu_rotary_mul", "native"),
            "swiglu": ("npu_swiglu", "native"),
        }

    def rollout_engines(self) -> tuple[str, ...]:
        """vLLM runs on Ascend through the vllm-ascend platform plugin, so both must be installed."""
        return ("vllm", "hf") if package_version("vllm-ascend") and package_version("vllm") else ("hf",)

    # --- profiling ------------------------------------------------------------------------------
    range_api = "mstx"

    def step_profiler(self, trace_dir, name: str):
        """torch_npu's own profiler (CPU and NPU activities): backends/npu/profiling.py."""
        from portrl.backends.npu.profiling import NPUStepProfiler  # noqa: PLC0415  (the NPU profiler's stack: only on the NPU)

        return NPUStepProfiler(trace_dir, name)

    def range_push(self, name: str) -> None:
        """``torch_npu.npu.mstx.range_start(name)`` (host-side range; its id is kept for :meth:`range_pop`): the
        range shows in msprof / the Ascend profiler's timeline. Only an Ascend machine can confirm it."""
        from portrl.backends.npu.profiling import mstx_range_start  # noqa: PLC0415  (the NPU profiler's stack: only on the NPU)

        mstx_range_start(name)

    def range_pop(self) -> None:
        from portrl.backends.npu.profiling import mstx_range_end  # noqa: PLC0415  (the NPU profiler's stack: only on the NPU)

        mstx_range_end()

    # --- environment ----------------------------------------------------------------------------
    def env_presets(self, deterministic: bool = False) -> dict[str, str]:
        """Allocator: expandable segments. Deterministic: HCCL reductions in a fixed order
        (``HCCL_DETERMINISTIC=true``) and matmuls without K shifting / shuffling
        (``CLOSE_MATMUL_K_SHIFT=1``, ``ATB_MATMUL_SHUFFLE_K_ENABLE=0``)."""
        env = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
        if deterministic:
            env.update({"HCCL_DETERMINISTIC": "true", "CLOSE_MATMUL_K_SHIFT": "1", "ATB_MATMUL_SHUFFLE_K_ENABLE": "0"})
        return env

    # --- doctor ---------------------------------------------------------------------------------
    def doctor_checks(self) -> list[Check]:
        versions = self.installed_versions()
        npu = versions.get("torch-npu")
        if npu is None:
            return []  # the probe line already says torch_npu is missing and how to install it
        mismatch = torch_pair_mismatch(versions.get("torch", ""), npu)
        checks = [Check("torch / torch_npu pair", FAIL, mismatch, "install the torch that torch_npu names")
                  if mismatch else Check("torch / torch_npu pair", OK, f"torch {versions.get('torch')}, torch_npu {npu}")]
        home = cann_home()
        if home:
            checks.append(Check("CANN environment", OK, f"{home} (CANN {versions.get('CANN', 'version unknown')})"))
        else:
            checks.append(Check("CANN environment", FAIL,
                                "torch_npu is installed but CANN is not sourced (ASCEND_TOOLKIT_HOME / ASCEND_HOME_PATH unset)",
                                CANN_SET_ENV + "  (and nnal/atb/set_env.sh for ATB kernels)"))
        return checks

    def host_checks(self) -> list[Check]:
        """An installed torch_npu is imported by ``import torch``; without a device that import fails."""
        if package_version("torch-npu") is None:
            return []
        autoload = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
        if autoload == "0" or davinci_devices():
            return [Check("torch backend autoload", OK, f"TORCH_DEVICE_BACKEND_AUTOLOAD={autoload!r}")]
        return [Check("torch backend autoload", WARN,
                      f"torch_npu is installed, no Ascend device is present and TORCH_DEVICE_BACKEND_AUTOLOAD={autoload!r}: "
                      "`import torch` will try to load torch_npu and can fail",
                      "export TORCH_DEVICE_BACKEND_AUTOLOAD=0")]
