"""``device.env`` is an allow-list of exact names each backend declares (portrl/config/checks.py ``check_env``,
``Backend.accepted_env`` / ``env_refusals``): what loads a library, a plugin, a hook or a debugger is refused
with its reason, plain settings pass, and portrl/ holds no vendor's list of environment prefixes."""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path

import pytest

from portrl.cli import main
from portrl.config import compose
from portrl.config.checks import check_env
from portrl.device.registry import all_backends

BACKENDS = ("cpu", "cuda", "rocm", "npu")

# Variables of the runtimes portrl runs on that load code, attach a debugger, or are Ray's and portrl's to set,
# with a word the reason must hold. Listed here from the runtimes' documentation, not read from backends/, so a
# table that drops one fails.
DANGEROUS = {
    # the dynamic loader, the interpreter, the shell
    "LD_PRELOAD": "load code", "LD_LIBRARY_PATH": "load code", "LD_AUDIT": "load code",
    "PYTHONPATH": "load code", "PYTHONHOME": "load code", "PYTHONSTARTUP": "load code",
    "PYTHONUSERBASE": "load code", "PYTHONPYCACHEPREFIX": "load code", "PYTHONWARNINGS": "load code",
    "PYTHONBREAKPOINT": "debugger", "PATH": "load code", "GCONV_PATH": "load code", "BASH_ENV": "load code",
    # torch, its compilers and caches; OpenMP's tool and debugger interfaces
    "CC": "load code", "CXX": "load code", "TORCH_EXTENSIONS_DIR": "load code", "TORCHINDUCTOR_CACHE_DIR": "load code",
    "TRITON_CACHE_DIR": "load code", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "load code",
    "OMP_TOOL_LIBRARIES": "load code", "OMP_DEBUG": "debugger",
    # Ray: the jemalloc preload, hooks, plugins, debuggers, the cluster address
    "RAY_JEMALLOC_LIB_PATH": "LD_PRELOAD", "RAY_LD_PRELOAD_ON_WORKERS": "LD_PRELOAD",
    "RAY_RUNTIME_ENV_HOOK": "load code", "RAY_RUNTIME_ENV_PLUGINS": "load code", "RAY_START_HOOK": "load code",
    "RAY_JOB_SUBMIT_HOOK": "load code", "RAY_DEBUG": "debugger", "RAY_DEBUG_POST_MORTEM": "debugger",
    "RAY_ADDRESS": "ray_address",
    # vLLM
    "VLLM_PLUGINS": "load code", "VLLM_NCCL_SO_PATH": "load code", "VLLM_ALLOW_INSECURE_SERIALIZATION": "load code",
    # NCCL / RCCL
    "NCCL_NET_PLUGIN": "load code", "NCCL_TUNER_PLUGIN": "load code", "NCCL_PROFILER_PLUGIN": "load code",
    "NCCL_ENV_PLUGIN": "load code", "NCCL_NET": "load code", "NCCL_CONF_FILE": "load code",
    "NCCL_DEBUG_FILE": "writes",
    # CUDA and its tools
    "CUDA_INJECTION64_PATH": "load code", "NVTX_INJECTION64_PATH": "load code", "CUDA_CACHE_PATH": "load code",
    "CUDA_DEVICE_WAITS_ON_EXCEPTION": "debugger", "TRITON_PTXAS_PATH": "load code",
    "CUDA_VISIBLE_DEVICES": "Ray sets it",
    # ROCm
    "HSA_TOOLS_LIB": "load code", "ROCP_TOOL_LIB": "load code", "ROCP_TOOL_LIBRARIES": "load code",
    "MIOPEN_CUSTOM_CACHE_DIR": "load code", "ROCBLAS_TENSILE_LIBPATH": "load code",
    "HIP_VISIBLE_DEVICES": "Ray sets it", "ROCR_VISIBLE_DEVICES": "Ray assigned",
    # CANN / Ascend
    "ASCEND_OPP_PATH": "load code", "ASCEND_CUSTOM_OPP_PATH": "load code", "ASCEND_AICPU_PATH": "load code",
    "ASCEND_CACHE_PATH": "load code", "ACL_OP_COMPILER_CACHE_DIR": "load code",
    "ASCEND_RT_VISIBLE_DEVICES": "Ray sets it",
    # portrl's own compiled kernels (backends/cpu/native_build.py)
    "PORTRL_KERNEL_CACHE": "load code", "PORTRL_CACHE": "load code",
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "portrl sets it",
}

# plain settings each backend's users set, all of which must pass
PLAIN = {
    "cpu": ["OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "TORCH_DEVICE_BACKEND_AUTOLOAD",
            "THP_MEM_ALLOC_ENABLE", "TORCH_LOGS", "VLLM_CPU_KVCACHE_SPACE"],
    "cuda": ["NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_ALGO", "NCCL_PROTO",
             "NCCL_BUFFSIZE", "CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "PYTORCH_CUDA_ALLOC_CONF",
             "TORCH_CUDA_ARCH_LIST", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS"],
    "rocm": ["NCCL_DEBUG", "NCCL_MIN_NCHANNELS", "HSA_NO_SCRATCH_RECLAIM", "HIP_FORCE_DEV_KERNARG",
             "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ROCM_ARCH", "VLLM_ROCM_USE_AITER", "OMP_NUM_THREADS"],
    "npu": ["HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_IF_IP", "TASK_QUEUE_ENABLE", "PYTORCH_NPU_ALLOC_CONF",
            "ASCEND_LAUNCH_BLOCKING", "OMP_NUM_THREADS"],
}


@pytest.fixture(scope="module")
def base_cfg():
    return compose()


def _problems(cfg, device: str, env: dict) -> list[str]:
    cfg = copy.deepcopy(cfg)
    cfg.device.name = device
    cfg.device.env = env
    return check_env(cfg)


@pytest.mark.parametrize("device", ("auto", *BACKENDS))
def test_every_dangerous_variable_is_refused_with_its_reason(base_cfg, device):
    """On every backend (and ``auto``), each variable is refused, and the line says why, not just "unknown"."""
    for name, word in DANGEROUS.items():
        problems = _problems(base_cfg, device, {name: "/tmp/evil.so"})
        head = f"device.env.{name} is not accepted: "
        line = next((p for p in problems if p.startswith(head)), None)
        assert line is not None, (device, name, problems)
        assert word in line and "declare" not in line, (device, name, line)


def test_the_reported_reason_is_the_backends():
    """The reason comes from the backends' tables, and every backend refuses what any backend refuses."""
    refusals = {}
    for b in all_backends():
        refusals.update(b.env_refusals())
    assert set(DANGEROUS) <= set(refusals)
    cfg = compose()
    for name in ("RAY_JEMALLOC_LIB_PATH", "NCCL_NET_PLUGIN", "HSA_TOOLS_LIB", "ASCEND_CUSTOM_OPP_PATH"):
        assert _problems(cfg, "cpu", {name: "x"})[0] == f"device.env.{name} is not accepted: {refusals[name]}"


@pytest.mark.parametrize("device", BACKENDS)
def test_plain_settings_and_presets_are_accepted(base_cfg, device):
    assert _problems(base_cfg, device, {name: "1" for name in PLAIN[device]}) == []
    assert _problems(base_cfg, "auto", {name: "1" for name in PLAIN[device]}) == []


@pytest.mark.parametrize("backend", all_backends(), ids=lambda b: b.name)
def test_backends_declare_exact_names_none_of_them_refused(backend):
    """No prefixes (a name ending in ``_``), nothing a backend declares or presets is refused by any backend,
    and every preset variable is accepted (a deterministic run's too)."""
    refused = set().union(*(set(b.env_refusals()) for b in all_backends()))
    declared = set(backend.declared_env)
    presets = set(backend.env_presets(deterministic=False)) | set(backend.env_presets(deterministic=True))
    assert all(re.fullmatch(r"[A-Z][A-Z0-9_]*[A-Z0-9]", n) for n in declared | presets)
    assert not (declared | presets) & refused
    assert presets <= backend.accepted_env()


def test_a_new_variable_under_a_known_prefix_is_not_accepted(base_cfg):
    """Prefixes are gone: an unknown variable of a known runtime is refused, naming the accepted ones."""
    problems = _problems(base_cfg, "cuda", {"NCCL_SOMETHING_PLUGIN": "x", "NCCL_DEBG": "INFO"})
    assert problems[0] == ("device.env.NCCL_SOMETHING_PLUGIN is not accepted: backend 'cuda' does not declare it; "
                           "set a variable portrl does not know in the shell that starts portrl")
    assert "(did you mean NCCL_DEBUG?)" in problems[1]
    assert problems[-1].startswith("device.env accepted: variables backend 'cuda' declares, ")
    assert "NCCL_SOCKET_IFNAME" in problems[-1] and "OMP_NUM_THREADS" in problems[-1]
    last = _problems(base_cfg, "auto", {"FOO_BAR": "1"})[-1]
    assert "OMP_NUM_THREADS" in last and "NCCL_DEBUG" not in last and "set device.name (cpu, cuda, npu, rocm)" in last


def test_the_command_line_refuses_a_preloaded_library_in_one_line(capsys):
    """Issue 33's run: Ray turned this variable into LD_PRELOAD in every worker. Now: exit 2, one line, the reason."""
    rc = main(["config", "show", "device.env.RAY_JEMALLOC_LIB_PATH=/tmp/evil.so"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert ("device.env.RAY_JEMALLOC_LIB_PATH is not accepted: it names a native library Ray preloads (LD_PRELOAD) "
            "into every worker; a config cannot load code") in err


VENDOR_ENV = re.compile(r"^(NCCL|RCCL|HCCL|HSA|HIP|ROCR|ROCP|CUDA|CUBLAS|NVTX|ASCEND|ACL|ATB|MIOPEN|VLLM)_")


@pytest.mark.parametrize("value", ["avx2", "AVX512", "off", "auto"])
def test_the_cpu_kernel_variant_may_be_chosen_in_the_config(base_cfg, value):
    assert _problems(base_cfg, "cpu", {"PORTRL_CPU_ISA": value}) == []


def test_a_bad_cpu_kernel_variant_is_one_line_naming_the_valid_ones(capsys):
    rc = main(["config", "show", "--device", "cpu", "device.env.PORTRL_CPU_ISA=sse4"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "device.env.PORTRL_CPU_ISA='sse4' is not valid: use one of auto, avx512, avx2, off" in err


def test_portrl_holds_no_vendor_environment_names():
    """Which variables a vendor's runtime reads is backends/' knowledge: no string of portrl/ names one (a prefix
    list such as the old ``ENV_PREFIXES`` included)."""
    found = []
    for path in sorted((Path(__file__).resolve().parents[1] / "portrl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and VENDOR_ENV.match(node.value):
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert not found, found
