"""What a config's ``device.env`` may set on the NPU backend, and what it may not, with why.

Sources: CANN's environment variable reference ("maintenref/envvar": HCCL, the runtime, the operator package
and custom operator paths, the compile cache), torch_npu's environment variables (``TASK_QUEUE_ENABLE``,
``PYTORCH_NPU_ALLOC_CONF``, ...) and ATB's (``ATB_*``).
"""

from __future__ import annotations

from portrl.backends.runtime_env import ACCEPTED, NO_CODE, REFUSED

NPU_ACCEPTED: tuple[str, ...] = (
    "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_EVENT_TIMEOUT", "HCCL_DETERMINISTIC", "HCCL_BUFFSIZE",
    "HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "HCCL_SOCKET_FAMILY", "HCCL_INTRA_ROCE_ENABLE", "HCCL_INTRA_PCIE_ENABLE",
    "HCCL_OP_EXPANSION_MODE", "HCCL_ALGO", "HCCL_RDMA_TC", "HCCL_RDMA_SL", "HCCL_RDMA_TIMEOUT",
    "HCCL_RDMA_RETRY_CNT", "HCCL_ENTRY_LOG_ENABLE",
    "ASCEND_LAUNCH_BLOCKING", "ASCEND_GLOBAL_LOG_LEVEL", "ASCEND_SLOG_PRINT_TO_STDOUT", "ASCEND_GLOBAL_EVENT_ENABLE",
    "ACL_OP_COMPILER_CACHE_MODE",
    # torch_npu
    "PYTORCH_NPU_ALLOC_CONF", "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF", "INF_NAN_MODE_ENABLE", "COMBINED_ENABLE",
    "MULTI_STREAM_MEMORY_REUSE",
    # ATB's deterministic matmul switches (the backend's deterministic presets)
    "CLOSE_MATMUL_K_SHIFT", "ATB_MATMUL_SHUFFLE_K_ENABLE",
)

_CACHE = "compiled operators are loaded from it"

NPU_REFUSED: dict[str, str] = {
    "ASCEND_OPP_PATH": f"it names the operator package whose kernels and libraries CANN loads; {NO_CODE}",
    "ASCEND_CUSTOM_OPP_PATH": f"it names custom operator packages and libraries CANN loads; {NO_CODE}",
    "ASCEND_AICPU_PATH": f"it names the folder CANN loads its AI CPU kernels from; {NO_CODE}",
    "ASCEND_HOME_PATH": f"it names the CANN installation whose libraries are loaded; {NO_CODE}",
    "ASCEND_TOOLKIT_HOME": f"it names the CANN installation whose libraries are loaded; {NO_CODE}",
    "ASCEND_CACHE_PATH": f"it names the folder CANN caches compiled operators in, and {_CACHE}; {NO_CODE}",
    "ASCEND_WORK_PATH": f"it names the folder CANN keeps its caches in, and {_CACHE}; {NO_CODE}",
    "ACL_OP_COMPILER_CACHE_DIR": f"it names the folder operators are compiled into, and {_CACHE}; {NO_CODE}",
    "ATB_HOME_PATH": f"it names the ATB installation whose libraries are loaded; {NO_CODE}",
    "TOOLCHAIN_HOME": f"it names the toolchain whose compilers build operators; {NO_CODE}",
    "HCCL_WHITELIST_DISABLE": "it switches off HCCL's list of trusted hosts; set it in the shell that starts portrl "
                              "if the network is yours alone",
}

DECLARED: tuple[str, ...] = ACCEPTED + NPU_ACCEPTED
REFUSED_HERE: dict[str, str] = {**REFUSED, **NPU_REFUSED}
