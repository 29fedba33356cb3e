"""What a config's ``device.env`` may set on the CUDA backend, and what it may not, with why.

``NCCL_ACCEPTED`` / ``NCCL_REFUSED`` are shared with the ROCm backend: RCCL reads NCCL's variable names.
Sources: NCCL's user guide, "Environment Variables" (2.2x; the plugin chapters for the net, tuner, profiler
and environment plugins, ``NCCL_CONF_FILE``), RCCL's plugin how-tos, CUDA's programming guide appendix
"CUDA Environment Variables" (the injection libraries, the JIT cache, the debugger waits), NVTX's injection
variables, torch's ``ProcessGroupNCCL`` variables (``TORCH_NCCL_*``) and Triton's tool paths.
"""

from __future__ import annotations

from portrl.backends.runtime_env import ACCEPTED, NO_CODE, REFUSED

NCCL_ACCEPTED: tuple[str, ...] = (
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS",
    "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD",
    "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_IB_TC",
    "NCCL_IB_SL", "NCCL_IB_QPS_PER_CONNECTION", "NCCL_NET_GDR_LEVEL", "NCCL_NET_GDR_READ", "NCCL_CROSS_NIC",
    "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE",
    "NCCL_ALGO", "NCCL_PROTO", "NCCL_BUFFSIZE", "NCCL_NTHREADS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS",
    "NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE", "NCCL_COLLNET_ENABLE",
    "NCCL_LAUNCH_MODE", "NCCL_IGNORE_CPU_AFFINITY",
    # torch's process group over NCCL (and RCCL)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_AVOID_RECORD_STREAMS", "TORCH_NCCL_HIGH_PRIORITY",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
)

_WRITES = "a config writes no file outside the run folder"

NCCL_REFUSED: dict[str, str] = {
    "NCCL_NET_PLUGIN": f"it names the network plugin library NCCL loads; {NO_CODE}",
    "NCCL_TUNER_PLUGIN": f"it names the tuner plugin library NCCL loads; {NO_CODE}",
    "NCCL_PROFILER_PLUGIN": f"it names the profiler plugin library NCCL loads; {NO_CODE}",
    "NCCL_ENV_PLUGIN": f"it names a library NCCL loads to read all its settings through; {NO_CODE}",
    "NCCL_NET": f"it chooses NCCL's network by name, a plugin's among them; {NO_CODE}",
    "NCCL_CONF_FILE": f"it names a file of NCCL settings, the plugin libraries among them, that no check reads; "
                      f"{NO_CODE}",
    "NCCL_DEBUG_FILE": f"it names a file NCCL writes its log to, over what is there; {_WRITES}",
    "NCCL_TOPO_DUMP_FILE": f"it names a file NCCL writes the topology to, over what is there; {_WRITES}",
    "NCCL_GRAPH_DUMP_FILE": f"it names a file NCCL writes its graphs to, over what is there; {_WRITES}",
}

CUDA_ACCEPTED: tuple[str, ...] = (
    "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING", "CUDA_CACHE_DISABLE",
    "CUDA_CACHE_MAXSIZE", "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE",
    "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING", "PYTORCH_NVML_BASED_CUDA_CHECK",
    "PYTORCH_TUNABLEOP_ENABLED", "TORCH_CUDA_ARCH_LIST", "TORCH_USE_CUDA_DSA",
)

_DEBUGGER = "a config attaches no debugger"

CUDA_REFUSED: dict[str, str] = {
    "CUDA_INJECTION64_PATH": f"it names a native library the CUDA driver loads into every process (CUPTI "
                             f"injection); {NO_CODE}",
    "CUDA_INJECTION32_PATH": f"it names a native library the CUDA driver loads into every 32-bit process; {NO_CODE}",
    "NVTX_INJECTION64_PATH": f"it names a native library NVTX loads into every process as its tool; {NO_CODE}",
    "NVTX_INJECTION32_PATH": f"it names a native library NVTX loads into every 32-bit process; {NO_CODE}",
    "CUDA_CACHE_PATH": f"it names the folder the CUDA driver caches JIT-compiled kernels in and loads them from; "
                       f"{NO_CODE}",
    "CUDA_HOME": f"it names the CUDA toolkit whose compilers and libraries torch's extensions use; {NO_CODE}",
    "CUDA_PATH": f"it names the CUDA toolkit whose compilers and libraries torch's extensions use; {NO_CODE}",
    "CUDA_DEVICE_WAITS_ON_EXCEPTION": f"it stops a failing kernel until a debugger attaches; {_DEBUGGER}",
    "CUDA_ENABLE_COREDUMP_ON_EXCEPTION": f"it makes a failing kernel write a GPU core dump for a debugger; "
                                         f"{_DEBUGGER}",
    "CUDA_COREDUMP_FILE": f"it names the file a GPU core dump is written to; {_WRITES}",
    "CUDA_DEVICE_ORDER": "it renumbers the devices under the indices Ray assigned to each worker; leave the order "
                         "Ray sees",
    "TRITON_LIBCUDA_PATH": f"it names the folder Triton loads the CUDA driver library from; {NO_CODE}",
    "TRITON_PTXAS_PATH": f"it names the assembler executable Triton runs; {NO_CODE}",
    "TRITON_CUOBJDUMP_PATH": f"it names an executable Triton runs; {NO_CODE}",
    "TRITON_NVDISASM_PATH": f"it names an executable Triton runs; {NO_CODE}",
}

DECLARED: tuple[str, ...] = ACCEPTED + NCCL_ACCEPTED + CUDA_ACCEPTED
REFUSED_HERE: dict[str, str] = {**REFUSED, **NCCL_REFUSED, **CUDA_REFUSED}
