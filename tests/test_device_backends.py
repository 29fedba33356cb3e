"""Facts, env presets, dtypes and probe reasons of the cuda / rocm / npu backends, without hardware.

Package presence is faked by replacing the metadata/find_spec helpers each module imported; torch
attributes (``torch.version.cuda``/``hip``, ``torch.cuda.device_count``) are monkeypatched with the
signatures torch documents.
"""

import types

import pytest
import torch

import portrl.backends.cpu.backend as cpu_mod
import portrl.backends.cuda.backend as cuda_mod
import portrl.backends.npu.backend as npu_mod
import portrl.backends.npu.versions as npu_versions
import portrl.backends.rocm.backend as rocm_mod
import portrl.device.backend as base_mod
import portrl.device.checks as checks_mod
from portrl.backends.cuda import CUDABackend
from portrl.backends.npu import NPUBackend
from portrl.backends.rocm import ROCmBackend

MODULES = (base_mod, checks_mod, cpu_mod, cuda_mod, rocm_mod, npu_mod)


@pytest.fixture
def fake_env(monkeypatch):
    """fake_env(packages={dist: version}, modules={name}) replaces what is "installed" for every backend module, on a
    host that shows every vendor's device nodes (the reasons a probe gives where the device is there)."""
    def apply(packages, modules=()):
        monkeypatch.setattr(npu_mod, "davinci_devices", lambda: ["/dev/davinci0"])
        monkeypatch.setattr(cuda_mod, "nvidia_devices", lambda: ["/dev/nvidia0"])
        monkeypatch.setattr(rocm_mod, "kfd_device", lambda: True)
        norm = {k.lower().replace("_", "-"): v for k, v in packages.items()}
        for mod in MODULES:
            if hasattr(mod, "package_version"):
                monkeypatch.setattr(mod, "package_version", lambda d: norm.get(d.lower().replace("_", "-")))
            if hasattr(mod, "module_available"):
                monkeypatch.setattr(mod, "module_available", lambda m: m in set(modules))
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES",
                "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        monkeypatch.delenv(var, raising=False)
    return apply


def _torch_build(monkeypatch, *, cuda=None, hip=None, count=0):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


# --- identity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, facts", [
    (CUDABackend, dict(name="cuda", device_type="cuda", dist_backend="nccl", ray_resource="GPU",
                       visible_devices_env="CUDA_VISIBLE_DEVICES",
                       ray_noset_env=("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",))),
    (ROCmBackend, dict(name="rocm", device_type="cuda", dist_backend="nccl", ray_resource="GPU",
                       visible_devices_env="HIP_VISIBLE_DEVICES",
                       ray_noset_env=("RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",))),
    (NPUBackend, dict(name="npu", device_type="npu", dist_backend="hccl", ray_resource="NPU",
                      visible_devices_env="ASCEND_RT_VISIBLE_DEVICES",
                      ray_noset_env=("RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",))),
])
def test_identity_facts(cls, facts):
    backend = cls()
    for key, want in facts.items():
        assert getattr(backend, key) == want, key


def test_detection_priority_npu_rocm_cuda_cpu():
    assert NPUBackend.detect_priority > ROCmBackend.detect_priority > CUDABackend.detect_priority > cpu_mod.CPUBackend.detect_priority


# --- env presets -----------------------------------------------------------------------------
def test_cuda_env_presets():
    assert CUDABackend().env_presets() == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    det = CUDABackend().env_presets(deterministic=True)
    assert det["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and det["NCCL_ALGO"] == "Ring"


def test_rocm_env_presets(fake_env):
    fake_env({}, modules=())
    env = ROCmBackend().env_presets()
    assert env["HSA_NO_SCRATCH_RECLAIM"] == "1" and env["NCCL_MIN_NCHANNELS"] == "112"
    assert env["HIP_FORCE_DEV_KERNARG"] == "1" and env["PYTORCH_HIP_ALLOC_CONF"] == "expandable_segments:True"
    assert "VLLM_ROCM_USE_AITER" not in env and "NCCL_ALGO" not in env
    det = ROCmBackend().env_presets(deterministic=True)
    assert det["NCCL_ALGO"] == "Ring" and det["PYTORCH_TUNABLEOP_ENABLED"] == "0"
    fake_env({}, modules={"aiter"})
    assert ROCmBackend().env_presets()["VLLM_ROCM_USE_AITER"] == "1"


def test_npu_env_presets():
    assert NPUBackend().env_presets() == {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
    det = NPUBackend().env_presets(deterministic=True)
    assert det["HCCL_DETERMINISTIC"] == "true"
    assert det["CLOSE_MATMUL_K_SHIFT"] == "1" and det["ATB_MATMUL_SHUFFLE_K_ENABLE"] == "0"


# --- dtypes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, want", [
    ("gfx942:sramecc+:xnack-", "float8_e4m3fnuz"), ("gfx940", "float8_e4m3fnuz"), ("gfx941", "float8_e4m3fnuz"),
    ("gfx950", "float8_e4m3fn"), ("gfx1201", "float8_e4m3fn"), ("gfx90a:sramecc+:xnack-", None), ("gfx1100", None),
])
def test_rocm_fp8_by_arch(arch, want):
    assert rocm_mod.fp8_dtype_for_arch(arch) == want


def test_rocm_fp8_reads_gcn_arch_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-"))
    assert ROCmBackend().fp8_dtype() == "float8_e4m3fnuz"


@pytest.mark.parametrize("cap, want", [((9, 0), "float8_e4m3fn"), ((8, 9), "float8_e4m3fn"), ((8, 0), None), ((7, 0), None)])
def test_cuda_fp8_by_capability(cap, want):
    assert cuda_mod.fp8_dtype_for_capability(cap) == want


@pytest.mark.parametrize("soc, bf16", [
    ("Ascend910A", False), ("Ascend910ProA", False), ("Ascend910PremiumA", False), ("Ascend910ProB", False),
    ("Ascend910B1", True), ("Ascend910B4", True), ("Ascend910_9391", True),
])
def test_npu_bf16_by_soc(soc, bf16):
    assert npu_mod.bf16_supported_for_soc(soc) is bf16


def test_npu_supported_dtypes_on_910a(monkeypatch):
    fake = types.SimpleNamespace(current_device=lambda: 0, get_device_name=lambda i: "Ascend910A")
    monkeypatch.setattr(NPUBackend, "_module", lambda self: fake)
    assert NPUBackend().supported_dtypes() == ("float16", "float32")
    assert NPUBackend().fp8_dtype() is None


# --- kernels and engines ---------------------------------------------------------------------
def test_kernel_preferences():
    assert CUDABackend().kernel_preferences()["attention_varlen"] == ("flash_attn3", "flash_attn", "sdpa", "native")
    assert ROCmBackend().kernel_preferences()["attention_varlen"] == ("aiter", "flash_attn", "sdpa", "native")
    assert NPUBackend().kernel_preferences()["attention_varlen"] == ("npu_fusion", "native")
    for cls in (CUDABackend, ROCmBackend):
        assert cls().kernel_preferences()["logprobs_entropy"] == ("triton", "native")
    assert NPUBackend().kernel_preferences()["rms_norm"] == ("npu_rms_norm", "native")
    for cls in (CUDABackend, ROCmBackend, NPUBackend):
        assert all(prefs[-1] == "native" for prefs in cls().kernel_preferences().values())


def test_rollout_engines(fake_env):
    fake_env({"torch": "2.8.0"})
    assert CUDABackend().rollout_engines() == ROCmBackend().rollout_engines() == NPUBackend().rollout_engines() == ("hf",)
    fake_env({"torch": "2.8.0", "vllm": "0.11.0"})
    assert CUDABackend().rollout_engines() == ROCmBackend().rollout_engines() == ("vllm", "hf")
    assert NPUBackend().rollout_engines() == ("hf",)  # vLLM on Ascend needs the vllm-ascend plugin
    fake_env({"torch": "2.10.0", "vllm": "0.23.0", "vllm-ascend": "0.23.0"})
    assert NPUBackend().rollout_engines() == ("vllm", "hf")


# --- probe -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, pip", [(CUDABackend, "whl/cu"), (ROCmBackend, "whl/rocm"), (NPUBackend, 'pip install -e ".[npu]"')])
def test_probe_without_torch_names_install_command(fake_env, cls, pip):
    fake_env({})
    r = cls().probe()
    assert not r.usable and "torch is not installed" in r.reason and pip in r.reason


def test_probe_on_this_cpu_torch_says_built_without(monkeypatch):
    monkeypatch.setattr(cuda_mod, "nvidia_devices", lambda: ["/dev/nvidia0"])
    monkeypatch.setattr(rocm_mod, "kfd_device", lambda: True)
    assert "built without CUDA" in CUDABackend().probe().reason
    assert "built without HIP (a CPU-only build)" in ROCmBackend().probe().reason


@pytest.mark.parametrize("cls", [CUDABackend, ROCmBackend, NPUBackend])
def test_a_host_without_the_device_says_so_and_not_how_to_install(monkeypatch, fake_env, cls):
    """No device nodes (and no WSL GPU node): "this host has no <name> device", whatever is installed; the install
    command is for a host that has the device (the tests above)."""
    for packages, modules in (({}, ()), ({"torch": "2.13.0+cpu"}, {"torch"})):
        fake_env(packages, modules)
        monkeypatch.setattr(npu_mod, "davinci_devices", lambda: [])
        monkeypatch.setattr(cuda_mod, "nvidia_devices", lambda: [])
        monkeypatch.setattr(rocm_mod, "kfd_device", lambda: False)
        monkeypatch.setattr(cuda_mod.os.path, "exists", lambda p: False)  # no /dev/dxg
        r = cls().probe()
        assert not r.usable and r.reason.startswith(f"this host has no {cls.name} device (no /dev/")
        assert "install" not in r.reason
    monkeypatch.setattr(cuda_mod.os.path, "exists", lambda p: p == cuda_mod.WSL_GPU_NODE)
    if cls is not NPUBackend:  # WSL 2 reaches the GPU through /dev/dxg: the nodes tell nothing, the probe goes on
        assert cls().host_shows_device() == (None, "") and "this host has no" not in cls().probe().reason


def test_cuda_probe_tells_rocm_build_apart(monkeypatch, fake_env):
    fake_env({"torch": "2.8.0+rocm6.4"}, modules={"torch"})
    _torch_build(monkeypatch, cuda=None, hip="6.4.43482", count=8)
    r = CUDABackend().probe()
    assert not r.usable and "ROCm (HIP 6.4.43482) build; use --device rocm" in r.reason
    r = ROCmBackend().probe()
    assert r.usable and r.device_count == 8 and r.versions["ROCm"] == "6.4"


def test_rocm_probe_on_cuda_build(monkeypatch, fake_env):
    fake_env({"torch": "2.8.0+cu128"}, modules={"torch"})
    _torch_build(monkeypatch, cuda="12.8", count=1)
    r = ROCmBackend().probe()
    assert not r.usable and "a CUDA 12.8 build" in r.reason
    assert CUDABackend().probe().usable


def test_cuda_probe_no_device_reports_driver_warning(monkeypatch, fake_env):
    import warnings

    fake_env({"torch": "2.8.0+cu128"}, modules={"torch"})
    _torch_build(monkeypatch, cuda="12.8")

    def count():
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).")
        return 0

    monkeypatch.setattr(torch.cuda, "device_count", count)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    r = CUDABackend().probe()
    assert not r.usable
    assert "no CUDA device visible" in r.reason and "CUDA_VISIBLE_DEVICES=''" in r.reason
    assert "driver on your system is too old" in r.reason


def test_rocm_probe_no_device_with_both_visibility_vars(monkeypatch, fake_env):
    fake_env({"torch": "2.8.0+rocm6.4"}, modules={"torch"})
    _torch_build(monkeypatch, hip="6.4", count=0)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "1")
    r = ROCmBackend().probe()
    assert not r.usable and "both set" in r.reason and "unset ROCR_VISIBLE_DEVICES" in r.reason


def test_npu_probe_reasons_in_order(monkeypatch, fake_env, tmp_path):
    imported = []
    monkeypatch.setattr(NPUBackend, "_import_plugin", staticmethod(lambda: imported.append("torch_npu")))
    fake_env({"torch": "2.10.0"}, modules={"torch"})
    assert "torch_npu is not installed" in NPUBackend().probe().reason
    fake_env({"torch": "2.13.0+cpu", "torch-npu": "2.10.0.post4"}, modules={"torch", "torch_npu"})
    r = NPUBackend().probe()
    assert "built for torch 2.10.0 but torch 2.13.0+cpu is installed" in r.reason and "pip install torch==2.10.0" in r.reason
    fake_env({"torch": "2.10.0", "torch-npu": "2.10.0.post4"}, modules={"torch", "torch_npu"})
    assert "CANN environment not loaded" in NPUBackend().probe().reason
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    monkeypatch.setattr(npu_mod, "davinci_devices", lambda: [])
    assert "this host has no npu device (no /dev/davinci<N> device nodes" in NPUBackend().probe().reason
    assert imported == []  # nothing imported while a static reason applies
    monkeypatch.setattr(npu_mod, "davinci_devices", lambda: ["/dev/davinci0", "/dev/davinci1"])
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(device_count=lambda: 2), raising=False)
    r = NPUBackend().probe()
    assert r.usable and r.device_count == 2 and imported == ["torch_npu"]


def test_npu_probe_reports_import_failure(monkeypatch, fake_env, tmp_path):
    def broken():
        raise ImportError("libhccl.so: cannot open shared object file")

    fake_env({"torch": "2.10.0", "torch-npu": "2.10.0.post4"}, modules={"torch", "torch_npu"})
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    monkeypatch.setattr(npu_mod, "davinci_devices", lambda: ["/dev/davinci0"])
    monkeypatch.setattr(NPUBackend, "_import_plugin", staticmethod(broken))
    r = NPUBackend().probe()
    assert not r.usable and r.reason == "import torch_npu failed: ImportError: libhccl.so: cannot open shared object file"


# --- versions read without importing ---------------------------------------------------------
def test_gfx_name_and_kfd_topology(tmp_path):
    assert rocm_mod.gfx_name(90402) == "gfx942" and rocm_mod.gfx_name(90010) == "gfx90a"
    assert rocm_mod.gfx_name(90500) == "gfx950" and rocm_mod.gfx_name(110000) == "gfx1100"
    for i, target in enumerate([0, 90402, 90402]):  # node 0 is the CPU
        node = tmp_path / str(i)
        node.mkdir()
        (node / "properties").write_text(f"cpu_cores_count 0\ngfx_target_version {target}\nsimd_count 1216\n")
    assert rocm_mod.kfd_gfx_targets(str(tmp_path / "*" / "properties")) == ["gfx942", "gfx942"]


def test_rocm_version_from_torch_tag():
    assert rocm_mod.rocm_version_from_torch("2.8.0+rocm6.4") == "6.4"
    assert rocm_mod.rocm_version_from_torch("2.8.0+cu128") is None


def test_cann_version_from_install_record(tmp_path):
    (tmp_path / "aarch64-linux").mkdir()
    (tmp_path / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.3.RC1\ninnerversion=V100R001C23\narch=aarch64\n")
    assert npu_versions.cann_version(str(tmp_path)) == "8.3.RC1"
    assert npu_versions.cann_version(str(tmp_path / "missing")) is None


def test_npu_compat_rows_from_vendor_tables():
    rows = {tuple(sorted(r.pins.items())) for r in NPUBackend.compat_rows}
    assert tuple(sorted({"torch-npu": "2.10.0.post4", "torch": "2.10.0", "CANN": "9.1.0"}.items())) in rows
    assert tuple(sorted({"torch-npu": "2.5.1", "torch": "2.5.1", "CANN": "8.1.RC1"}.items())) in rows
    va = [r.pins for r in NPUBackend.compat_rows if "vllm-ascend" in r.pins]
    assert {p["vllm-ascend"]: (p["CANN"], p["torch-npu"]) for p in va} == {
        "0.23.0": ("9.1.0", "2.10.0.post4"), "0.13.0": ("8.5.0", "2.8.0"), "0.11.0": ("8.3.RC2", "2.7.1.post1")}
    assert all(p["vllm"] == p["vllm-ascend"] for p in va)  # the plugin's tag tracks vLLM's


def test_every_torch_npu_row_pairs_with_its_torch():
    for row in NPUBackend.compat_rows:
        assert npu_versions.torch_pair_mismatch(row.pins["torch"], row.pins["torch-npu"]) == "", row


def test_npu_extra_in_pyproject_is_a_compat_row():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")

    extra = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]["npu"]
    pins = dict(req.split("==") for req in extra)
    row = npu_versions.NPU_EXTRA_ROW.pins
    assert pins == {"torch-npu": row["torch-npu"], "vllm-ascend": row["vllm-ascend"]}


@pytest.mark.parametrize("cpuinfo, want", [
    ("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n", ("avx512_bf16", "amx_bf16")),
    ("processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n", ()),  # AVX2 only: bf16 is emulated
    ("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n", ("bf16",)),  # Arm (Graviton 3, Grace)
    ("", ()),
])
def test_cpu_native_bf16_flags(cpuinfo, want, monkeypatch):
    assert cpu_mod.native_bf16_features(cpuinfo) == want
    monkeypatch.setattr(cpu_mod, "native_bf16_features", lambda cpuinfo=None: want)
    backend = cpu_mod.CPUBackend()
    assert backend.supports_bf16() is bool(want) and backend.supported_dtypes()[0] == "float32"
    check = backend.doctor_checks()[0]
    assert check.name == "bfloat16" and check.status == ("ok" if want else "warn")
    assert want or "device.dtype=float32" in check.fix


@pytest.mark.parametrize("text, mode", [
    ("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"), ("", None),
])
def test_cpu_transparent_hugepage_mode_and_doctor_line(text, mode):
    """Linux's THP mode is the bracketed word; doctor warns (with the fix) only where torch's huge-page allocation
    (portrl/process_env.py) cannot work, and says so when the user turned it off."""
    assert cpu_mod.transparent_hugepage_mode(text) == mode
    check = cpu_mod.huge_pages_check(mode, "1")
    assert check.status == ("ok" if mode in ("always", "madvise") else "warn")
    assert check.status == "ok" or cpu_mod.THP_ENABLED_FILE in check.fix
    off = cpu_mod.huge_pages_check(mode, "0")
    assert off.status == "ok" and "THP_MEM_ALLOC_ENABLE=0" in off.message
    assert [c.name for c in cpu_mod.CPUBackend().doctor_checks()] == ["bfloat16", "huge pages", "C++ compiler",
                                                                     "CPU kernels"]


def test_cpu_doctor_line_for_the_compiler():
    """The compiler builds the native kernels and the counting allocator; without one doctor warns with the fix."""
    assert cpu_mod.compiler_check("/usr/bin/g++").status == "ok"
    missing = cpu_mod.compiler_check(None)
    assert missing.status == "warn" and "g++" in missing.fix and "memory/peak_gib" in missing.message
