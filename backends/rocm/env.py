"""What a config's ``device.env`` may set on the ROCm backend, and what it may not, with why.

RCCL reads NCCL's names (``NCCL_ACCEPTED`` / ``NCCL_REFUSED`` of backends/cuda/env.py). Sources: ROCm's
"Environment variables" reference (HIP, ROCR / HSA), the ROCprofiler and ROCprofiler-SDK tool-library pages
(``HSA_TOOLS_LIB``, ``ROCP_TOOL_LIB``, ``ROCP_TOOL_LIBRARIES``), MIOpen's and rocBLAS / hipBLASLt's cache and
library paths, and vLLM's ROCm variables.
"""

from __future__ import annotations

from portrl.backends.cuda.env import NCCL_ACCEPTED, NCCL_REFUSED
from portrl.backends.runtime_env import ACCEPTED, NO_CODE, REFUSED

ROCM_ACCEPTED: tuple[str, ...] = (
    "HSA_NO_SCRATCH_RECLAIM", "HSA_FORCE_FINE_GRAIN_PCIE", "HSA_ENABLE_SDMA", "HSA_OVERRIDE_GFX_VERSION",
    "HIP_FORCE_DEV_KERNARG", "HIP_LAUNCH_BLOCKING", "AMD_SERIALIZE_KERNEL", "AMD_SERIALIZE_COPY", "AMD_LOG_LEVEL",
    "GPU_MAX_HW_QUEUES", "RCCL_MSCCL_ENABLE", "RCCL_MSCCLPP_ENABLE",
    "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ROCM_ARCH", "PYTORCH_TUNABLEOP_ENABLED", "TORCH_BLAS_PREFER_HIPBLASLT",
    "CUBLAS_WORKSPACE_CONFIG",  # torch asks for it with deterministic algorithms on ROCm too
    "VLLM_ROCM_USE_AITER", "VLLM_USE_TRITON_FLASH_ATTN",
)

_CACHE = "compiled kernels are loaded from it"

ROCM_REFUSED: dict[str, str] = {
    "HSA_TOOLS_LIB": f"it names native libraries the ROCm runtime loads as tools into every process; {NO_CODE}",
    "ROCP_TOOL_LIB": f"it names a native library ROCprofiler loads as its tool; {NO_CODE}",
    "ROCP_TOOL_LIBRARIES": f"it names native libraries ROCprofiler-SDK loads as tools into every process; {NO_CODE}",
    "ROCR_VISIBLE_DEVICES": "it hides devices under the ones Ray assigned to each worker (HIP_VISIBLE_DEVICES); "
                            "choose the devices in the shell that starts portrl",
    "CUDA_VISIBLE_DEVICES": "HIP reads it as well as HIP_VISIBLE_DEVICES, which Ray sets for each worker; choose "
                            "the devices in the shell that starts portrl",
    "MIOPEN_USER_DB_PATH": f"it names the folder MIOpen keeps its kernel database in, and {_CACHE}; {NO_CODE}",
    "MIOPEN_CUSTOM_CACHE_DIR": f"it names the folder MIOpen caches compiled kernels in, and {_CACHE}; {NO_CODE}",
    "ROCBLAS_TENSILE_LIBPATH": f"it names the folder rocBLAS loads its GPU code objects from; {NO_CODE}",
    "HIPBLASLT_TENSILE_LIBPATH": f"it names the folder hipBLASLt loads its GPU code objects from; {NO_CODE}",
    "ROCM_PATH": f"it names the ROCm installation whose libraries and compilers are used; {NO_CODE}",
    "HIP_PATH": f"it names the HIP installation whose libraries and compilers are used; {NO_CODE}",
    "TRITON_HIP_LLD_PATH": f"it names the linker executable Triton runs; {NO_CODE}",
}

DECLARED: tuple[str, ...] = ACCEPTED + NCCL_ACCEPTED + ROCM_ACCEPTED
REFUSED_HERE: dict[str, str] = {**REFUSED, **NCCL_REFUSED, **ROCM_REFUSED}
