"""The AMD ROCm backend (Instinct MI300 and later): HIP through ``torch.cuda``, RCCL collectives.

Facts (PyTorch ROCm and Ray documentation): a ROCm build of torch reuses ``torch.cuda`` and the device
string "cuda"; it is told apart from a CUDA build by ``torch.version.hip``. The process group is
"nccl", served by RCCL. Ray (>= 2.50) gives AMD GPUs the resource "GPU", sets
``HIP_VISIBLE_DEVICES`` per worker (opt-out ``RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES``) and
raises when ``ROCR_VISIBLE_DEVICES`` is also set; both set can hide every GPU. The chip comes from
``gcnArchName`` (gfx942 on MI300X/MI300A, gfx950 on MI350); fp8 is FNUZ (``float8_e4m3fnuz``) on
gfx94x and OCP (``float8_e4m3fn``) on gfx950.

:meth:`probe` never initialises HIP: ``torch.cuda.device_count()`` asks amdsmi first, and the
chip name is read from the KFD topology in sysfs. Only hardware confirms the presets' effect.
"""

from __future__ import annotations

import glob
import os

from portrl.backends.cuda.backend import WSL_GPU_NODE, CUDABackend
from portrl.backends.rocm import env as env_tables
from portrl.backends.rocm.peaks import DEVICE_MODELS
from portrl.device.backend import KernelRegistry, ProbeResult, module_available
from portrl.device.checks import FAIL, OK, WARN, Check, version_satisfies
from portrl.device.versions import CompatRow, package_version

# the command of a compatibility row (torch 2.9.0 wheels for ROCm 6.4), as docs/backends/amd.md spells it
TORCH_ROCM_INSTALL = ('of one compatibility row (torch 2.9.0, ROCm 6.4): '
                      'pip install "torch==2.9.0" --index-url https://download.pytorch.org/whl/rocm6.4')


def _torch_rocm(torch: str, rocm: str) -> str:
    """Install line of a torch / ROCm row: the wheel of download.pytorch.org/whl/rocmX.Y on a host with that ROCm."""
    return (f'pip install "torch=={torch}" --index-url https://download.pytorch.org/whl/rocm{rocm} '
            f"(on a host with ROCm {rocm})")


KFD_NODES = "/sys/class/kfd/kfd/topology/nodes/*/properties"
KFD_DEVICE = "/dev/kfd"


def kfd_device(path: str = KFD_DEVICE) -> bool:
    """Whether this host has the AMD GPU compute device node (``/dev/kfd``: one for all GPUs)."""
    return os.path.exists(path)


def fp8_dtype_for_arch(arch: str) -> str | None:
    """fp8 e4m3 dtype for a gfx target such as ``"gfx942:sramecc+:xnack-"``.

    gfx94x (MI300) computes only FNUZ fp8; gfx950 (MI350) and gfx12 use OCP e4m3fn; older
    Instinct (gfx90a, gfx908) and RDNA 2/3 (gfx10, gfx11) have no fp8 matrix cores.
    """
    chip = arch.split(":", 1)[0].strip().lower()
    if chip.startswith("gfx94"):
        return "float8_e4m3fnuz"
    if chip.startswith(("gfx90", "gfx10", "gfx11")) or not chip.startswith("gfx"):
        return None
    return "float8_e4m3fn"


def gfx_name(target_version: int) -> str:
    """KFD ``gfx_target_version`` (major*10000 + minor*100 + stepping) to a gfx name: 90402 -> gfx942."""
    major, minor, step = target_version // 10000, (target_version // 100) % 100, target_version % 100
    return f"gfx{major}{minor:x}{step:x}"


def kfd_gfx_targets(pattern: str = KFD_NODES) -> list[str]:
    """gfx names of the GPU nodes in the KFD topology (CPU nodes report 0); no runtime is touched."""
    names = []
    for path in sorted(glob.glob(pattern)):
        try:
            with open(path) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "gfx_target_version" and int(value or 0) > 0:
                        names.append(gfx_name(int(value)))
        except (OSError, ValueError):
            continue
    return names


def rocm_version_from_torch(torch_version: str | None) -> str | None:
    """The ROCm release a torch wheel was built for, from its local tag: ``2.8.0+rocm6.4`` -> ``6.4``."""
    if not torch_version or "+rocm" not in torch_version:
        return None
    return torch_version.split("+rocm", 1)[1]


class ROCmBackend(CUDABackend):
    """A ROCm build of torch runs AMD GPUs as torch.cuda (HIP): bf16 support and the memory answers are
    CUDABackend's, read through torch.cuda from HIP; fp8 is its own (from the GPU's gcnArchName)."""

    name = "rocm"
    device_models = DEVICE_MODELS  # the peak table: backends/rocm/peaks.py
    device_type = "cuda"
    dist_backend = "nccl"  # RCCL implements the NCCL API
    ray_resource = "GPU"
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    ray_noset_env = ("RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",)
    detect_priority = 20
    declared_env = env_tables.DECLARED  # device.env: backends/rocm/env.py
    refused_env = env_tables.REFUSED_HERE
    version_packages = ("torch", "transformers", "triton", "vllm", "flash-attn", "ray")
    # AMD's MI300-validated vLLM image (docker/rocm/Dockerfile is pinned to it), then the torch / ROCm
    # pairs of the official wheels (download.pytorch.org/whl/rocmX.Y)
    compat_rows = (
        CompatRow({"torch": "2.9.0", "ROCm": "7.0", "vllm": "0.11.2"},
                  "AMD image rocm/vllm:rocm7.0.0_vllm_0.11.2_20251210 (ROCm 7.0.0, vLLM 0.11.2, PyTorch 2.9.0)",
                  "docker build -f docker/rocm/Dockerfile -t portrl:rocm . (its base is that image)"),
        CompatRow({"torch": "2.9.0", "ROCm": "6.4"}, "PyTorch 2.9 wheels for ROCm 6.4", _torch_rocm("2.9.0", "6.4")),
        CompatRow({"torch": "2.8.0", "ROCm": "6.4"}, "PyTorch 2.8 wheels for ROCm 6.4", _torch_rocm("2.8.0", "6.4")),
        CompatRow({"torch": "2.7.1", "ROCm": "6.3"}, "PyTorch 2.7 wheels for ROCm 6.3", _torch_rocm("2.7.1", "6.3")),
    )

    def installed_versions(self) -> dict[str, str]:
        versions = super().installed_versions()
        rocm = rocm_version_from_torch(versions.get("torch"))
        if rocm:
            versions["ROCm"] = rocm
        return versions

    # --- probe ----------------------------------------------------------------------------------
    def host_shows_device(self) -> tuple[bool | None, str]:
        """A host with an AMD GPU has the KFD device node, ``/dev/kfd`` (in a container: ``--device /dev/kfd``);
        WSL 2 reaches the GPU through ``/dev/dxg`` instead, where nodes tell nothing."""
        if kfd_device():
            return True, ""
        if os.path.exists(WSL_GPU_NODE) or not os.path.isdir("/dev"):
            return None, ""
        return False, ("no /dev/kfd device node: no amdgpu driver on this host, or a container started without "
                       "--device /dev/kfd --device /dev/dri")

    def probe(self) -> ProbeResult:
        absent = self.no_device_here()  # no device: say so, not how to install a ROCm build of torch
        if absent is not None:
            return absent
        versions = self.installed_versions()
        if not module_available("torch"):
            return ProbeResult(False, f"torch is not installed; install a ROCm build {TORCH_ROCM_INSTALL}", versions=versions)
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        if not torch.version.hip:
            flavour = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
            return ProbeResult(False, f"torch {torch.__version__} was built without HIP ({flavour}); "
                                      f"install a ROCm build {TORCH_ROCM_INSTALL}", versions=versions)
        count = int(torch.cuda.device_count())
        if count == 0:
            return ProbeResult(False, self._no_gpu_reason(), versions=versions)
        targets = kfd_gfx_targets()
        return ProbeResult(True, device_count=count, device_name=targets[0] if targets else "", versions=versions)

    def _no_gpu_reason(self) -> str:
        hip, rocr = os.environ.get("HIP_VISIBLE_DEVICES"), os.environ.get("ROCR_VISIBLE_DEVICES")
        if hip is not None and rocr is not None:
            return (f"no AMD GPU visible: HIP_VISIBLE_DEVICES={hip!r} and ROCR_VISIBLE_DEVICES={rocr!r} are both set "
                    "(HIP indexes the GPUs ROCR left, which can hide all); unset ROCR_VISIBLE_DEVICES")
        return f"no AMD GPU visible (HIP_VISIBLE_DEVICES={hip!r}); check rocm-smi"

    # --- dtypes ---------------------------------------------------------------------------------
    def fp8_dtype(self) -> str | None:
        """From the current device's ``gcnArchName`` (reads device properties: initialises HIP)."""
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        return fp8_dtype_for_arch(torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName)

    # --- kernels and engines --------------------------------------------------------------------
    def register_kernels(self, registry: KernelRegistry) -> None:
        from portrl.backends.rocm.kernels import register  # noqa: PLC0415  (torch: the doctor runs without it)

        register(registry)

    def kernel_preferences(self) -> dict[str, tuple[str, ...]]:
        prefs = super().kernel_preferences()
        prefs["attention_varlen"] = ("aiter", "flash_attn", "sdpa", "native")
        return prefs

    # --- profiling ------------------------------------------------------------------------------
    profiler_activities = ("CUDA",)  # torch's ROCm builds record HIP kernels under the CUDA activity (roctracer)
    range_api = "roctx"

    def range_push(self, name: str) -> None:
        """``torch.cuda.nvtx.range_push``, which a ROCm build of torch implements with ``roctxRangePushA``: the
        range shows in rocprofv3 (``--marker-trace``). Only a ROCm machine can confirm it."""
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        torch.cuda.nvtx.range_push(name)

    def range_pop(self) -> None:
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        torch.cuda.nvtx.range_pop()

    # --- environment ----------------------------------------------------------------------------
    def env_presets(self, deterministic: bool = False) -> dict[str, str]:
        """MI300 presets: scratch memory kept (``HSA_NO_SCRATCH_RECLAIM=1``), more RCCL channels
        (``NCCL_MIN_NCHANNELS=112``), kernel arguments in device memory (``HIP_FORCE_DEV_KERNARG=1``),
        expandable allocator segments; vLLM's AITER kernels when aiter is installed.

        Deterministic: ``NCCL_ALGO=Ring`` (fixed reduction order, honoured by RCCL), TunableOp off
        (it picks GEMM kernels by timing, which differs run to run), and the cuBLAS workspace
        setting torch asks for with deterministic algorithms.
        """
        env = {
            "HSA_NO_SCRATCH_RECLAIM": "1",
            "NCCL_MIN_NCHANNELS": "112",
            "HIP_FORCE_DEV_KERNARG": "1",
            "PYTORCH_HIP_ALLOC_CONF": "expandable_segments:True",
        }
        if module_available("aiter"):
            env["VLLM_ROCM_USE_AITER"] = "1"
        if deterministic:
            env.update({"NCCL_ALGO": "Ring", "PYTORCH_TUNABLEOP_ENABLED": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
        return env

    # --- doctor ---------------------------------------------------------------------------------
    def doctor_checks(self) -> list[Check]:
        checks = super().doctor_checks()
        hip, rocr = os.environ.get("HIP_VISIBLE_DEVICES"), os.environ.get("ROCR_VISIBLE_DEVICES")
        if hip is not None and rocr is not None:
            checks.append(Check("visible-devices variables", FAIL,
                                f"HIP_VISIBLE_DEVICES={hip!r} and ROCR_VISIBLE_DEVICES={rocr!r} are both set: "
                                "this can hide every GPU, and Ray raises on it", "unset ROCR_VISIBLE_DEVICES"))
        else:
            checks.append(Check("visible-devices variables", OK, "not both HIP_VISIBLE_DEVICES and ROCR_VISIBLE_DEVICES set"))
        ray = package_version("ray")
        if ray and not version_satisfies(ray, ">=2.50"):
            checks.append(Check("Ray AMD support", WARN, f"ray {ray} does not set HIP_VISIBLE_DEVICES for its workers",
                                "pip install 'ray>=2.50'"))
        return checks
