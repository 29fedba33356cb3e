"""Environment variables of the runtimes every backend shares (torch, OpenMP, the math libraries, Ray, vLLM):
which ones a config's ``device.env`` may set, and which it may not, with why.

A backend adds these to its own tables (``declared_env``, ``refused_env``: portrl/device/backend.py). The
accepted names are exact and each is a plain setting (a number, a switch, a level, a list of names): no
prefixes, since a prefix lets through the variables of the same runtime that load code. The refused tables
name what a config must never set and say why; anything not accepted is refused anyway, the tables only give
the reason for the variables someone is likely to try.

Sources: torch's documentation of its environment variables (``torch.utils.cpp_extension``, Inductor's and
Triton's cache and tool paths, ``torch.load``'s weights-only switches), the OpenMP 5.x specification (the
OMPT tool and OMPD debugger interfaces), Ray 2.x's ``ray/_private/services.py``, ``ray_constants.py``,
``runtime_env/constants.py`` and ``util/rpdb.py`` / ``util/debugpy.py`` (the jemalloc preload, hooks,
plugins, debuggers), and vLLM's ``vllm/envs.py``.
"""

from __future__ import annotations

#: the clause that ends the reason of every variable that loads or runs code a config would name
NO_CODE = "a config cannot load code"

TORCH_ACCEPTED: tuple[str, ...] = (
    "TORCH_DEVICE_BACKEND_AUTOLOAD",  # torch's device plugins imported with torch (installed ones only)
    "THP_MEM_ALLOC_ENABLE",  # huge pages for large CPU tensors (portrl/process_env.py)
    "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES", "TORCH_DISTRIBUTED_DEBUG",
    "TORCHDYNAMO_DISABLE", "TORCH_FORCE_WEIGHTS_ONLY_LOAD",
)

OPENMP_ACCEPTED: tuple[str, ...] = (
    "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OMP_PROC_BIND", "OMP_PLACES", "OMP_DYNAMIC", "OMP_SCHEDULE",
    "OMP_STACKSIZE", "OMP_MAX_ACTIVE_LEVELS",
    "GOMP_SPINCOUNT", "GOMP_CPU_AFFINITY",  # GNU libgomp (torch's Linux wheels)
    "KMP_AFFINITY", "KMP_BLOCKTIME",  # LLVM / Intel OpenMP
)

MATH_ACCEPTED: tuple[str, ...] = (
    "MKL_NUM_THREADS", "MKL_DYNAMIC", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "OPENBLAS_NUM_THREADS",
)

#: a Ray worker takes its cluster's settings from its raylet; only its own log level is read from its environment
RAY_ACCEPTED: tuple[str, ...] = ("RAY_BACKEND_LOG_LEVEL",)

#: vLLM's settings of every platform (every backend offers the vllm engine; a platform's own are its backend's)
VLLM_ACCEPTED: tuple[str, ...] = (
    "VLLM_LOGGING_LEVEL", "VLLM_ATTENTION_BACKEND", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ENABLE_V1_MULTIPROCESSING",
)

#: every backend's plain runtime settings
ACCEPTED: tuple[str, ...] = TORCH_ACCEPTED + OPENMP_ACCEPTED + MATH_ACCEPTED + RAY_ACCEPTED + VLLM_ACCEPTED

_CACHE = "compiled kernels are loaded from it"

TORCH_REFUSED: dict[str, str] = {
    "CC": f"it names the C compiler torch's Inductor and Triton run; {NO_CODE}",
    "CXX": f"it names the C++ compiler torch's extensions and the CPU backend's kernels are built with; {NO_CODE}",
    "TORCH_EXTENSIONS_DIR": f"it names the folder torch builds and loads C++ extensions from; {NO_CODE}",
    "TORCHINDUCTOR_CACHE_DIR": f"it names the folder torch's Inductor caches compiled code in, and {_CACHE}; "
                               f"{NO_CODE}",
    "TRITON_CACHE_DIR": f"it names the folder Triton caches compiled kernels in, and {_CACHE}; {NO_CODE}",
    "TRITON_HOME": f"it names the folder above Triton's kernel cache, and {_CACHE}; {NO_CODE}",
    "PYTORCH_KERNEL_CACHE_PATH": f"it names the folder torch's JIT fuser caches kernels in, and {_CACHE}; {NO_CODE}",
    "TORCH_HOME": f"it names the folder torch.hub imports repositories' code from; {NO_CODE}",
    "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": f"it lets torch.load run the code a checkpoint's pickle names; {NO_CODE}",
}

OPENMP_REFUSED: dict[str, str] = {
    "OMP_TOOL_LIBRARIES": f"it names native libraries the OpenMP runtime loads as tools (OMPT); {NO_CODE}",
    "OMP_TOOL": "it switches the OpenMP runtime's tool interface (OMPT), which loads OMP_TOOL_LIBRARIES, on or "
                "off; a config leaves it as the shell has it",
    "OMP_DEBUG": "it switches on the OpenMP runtime's debugger interface (OMPD); a config attaches no debugger",
}

RAY_REFUSED: dict[str, str] = {
    "RAY_JEMALLOC_LIB_PATH": f"it names a native library Ray preloads (LD_PRELOAD) into every worker; {NO_CODE}",
    "RAY_LD_PRELOAD_ON_WORKERS": f"it makes Ray preload its jemalloc library (LD_PRELOAD) into every worker; "
                                 f"{NO_CODE}",
    "RAY_JEMALLOC_CONF": "it configures the jemalloc Ray preloads, profile dumps to files included; set it in the "
                         "shell that starts Ray",
    "RAY_JEMALLOC_PROFILE": "it makes Ray run its processes under jemalloc's profiler, which Ray preloads; set it in "
                            "the shell that starts Ray",
    "RAY_RUNTIME_ENV_HOOK": f"it names a Python function Ray imports and runs on every job's runtime_env; {NO_CODE}",
    "RAY_RUNTIME_ENV_PLUGINS": f"it names Python classes Ray imports and runs as runtime_env plugins; {NO_CODE}",
    "RAY_RUNTIME_ENV_PLUGIN_SCHEMAS": "it names files Ray reads as runtime_env plugin schemas; set it in the shell "
                                      "that starts Ray",
    "RAY_START_HOOK": f"it names a Python function `ray start` imports and runs; {NO_CODE}",
    "RAY_JOB_SUBMIT_HOOK": f"it names a Python function Ray imports and runs at each job submission; {NO_CODE}",
    "RAY_CLUSTER_ACTIVITY_HOOK": f"it names a Python function Ray's dashboard imports and runs; {NO_CODE}",
    "RAY_DEBUG": "it chooses Ray's debugger (`legacy`: a remote pdb that listens on a port); a config attaches "
                 "no debugger",
    "RAY_DEBUG_POST_MORTEM": "it stops a failing worker in Ray's debugger, which waits for a connection on a "
                             "port; a config attaches no debugger",
    "RAY_INTERNAL_MEM_PROFILE_COMPONENTS": "it runs Ray's processes under the memray profiler (with a live port "
                                           "among its options); a config attaches no profiler",
    "RAY_INTERNAL_MEM_PROFILE_OPTIONS": "it passes options (a live port among them) to the memray profiler Ray "
                                        "runs its processes under; a config attaches no profiler",
    "RAY_ADDRESS": "Ray sets it for each worker to the cluster it belongs to; trainer.ray_address names the cluster",
}

VLLM_REFUSED: dict[str, str] = {
    "VLLM_PLUGINS": f"it names the plugins vLLM imports and runs at start; {NO_CODE}",
    "VLLM_NCCL_SO_PATH": f"it names the native collective library vLLM loads; {NO_CODE}",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": f"it lets vLLM unpickle messages, which runs the code they name; {NO_CODE}",
    "VLLM_LOGGING_CONFIG_PATH": f"it names a logging configuration whose handlers and filters vLLM imports; "
                                f"{NO_CODE}",
    "VLLM_CACHE_ROOT": f"it names the folder vLLM caches torch.compile's code in, and {_CACHE}; {NO_CODE}",
}

#: what no backend's config may set, with why
REFUSED: dict[str, str] = {**TORCH_REFUSED, **OPENMP_REFUSED, **RAY_REFUSED, **VLLM_REFUSED}
