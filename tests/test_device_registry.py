"""Backend discovery through the ``portrl.backends`` entry points, resolution order, detection."""

import subprocess
import sys
import textwrap

import pytest

from portrl.device import BackendError, ProbeResult, backend_names, clear_cache, detect, get_backend, resolve_backend


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv("PORTRL_DEVICE", raising=False)
    clear_cache()
    yield
    clear_cache()


def _usable(self):
    return ProbeResult(True, device_count=1)


def test_builtin_backends_registered_in_detection_order():
    assert backend_names() == ["npu", "rocm", "cuda", "cpu"]
    priorities = [get_backend(n).detect_priority for n in backend_names()]
    assert priorities == sorted(priorities, reverse=True)


def test_detect_picks_cpu_here():
    assert detect().name == "cpu"


@pytest.mark.parametrize("usable, expected", [
    ({"cuda"}, "cuda"), ({"cuda", "rocm"}, "rocm"), ({"cuda", "rocm", "npu"}, "npu"), ({"npu", "cuda"}, "npu"),
])
def test_detect_follows_priority(monkeypatch, usable, expected):
    for name in usable:
        monkeypatch.setattr(type(get_backend(name)), "probe", _usable)
    assert detect().name == expected


def test_detect_with_nothing_usable_lists_every_reason(monkeypatch):
    monkeypatch.setattr(type(get_backend("cpu")), "probe", lambda self: ProbeResult(False, "cpu disabled for the test"))
    with pytest.raises(BackendError) as err:
        detect()
    for name in ("npu", "rocm", "cuda", "cpu disabled for the test"):
        assert name in str(err.value)


def test_resolution_order_cli_env_config_detect(monkeypatch):
    assert resolve_backend().name == "cpu"  # detection
    assert resolve_backend(None, "cuda", require_usable=False).name == "cuda"  # config
    monkeypatch.setenv("PORTRL_DEVICE", "rocm")
    assert resolve_backend(None, "cuda", require_usable=False).name == "rocm"  # env beats config
    assert resolve_backend("npu", "cuda", require_usable=False).name == "npu"  # cli beats env
    assert resolve_backend("cpu", "cuda").name == "cpu"


def test_auto_means_detect(monkeypatch):
    monkeypatch.setenv("PORTRL_DEVICE", "auto")
    assert resolve_backend("auto", "auto").name == "cpu"
    assert resolve_backend(None, "cuda", require_usable=False).name == "cuda"  # env 'auto' defers to config


def test_explicit_unusable_backend_is_an_error_with_reason():
    with pytest.raises(BackendError, match=r"device 'cuda' \(from --device\) is not usable here: (this host has no cuda "
                                           r"device|.*built without CUDA).*; usable here: cpu \(see `portrl devices`\)"):
        resolve_backend("cuda")


def test_unknown_name_lists_valid_ones(monkeypatch):
    with pytest.raises(BackendError, match=r"unknown device 'xpu' \(from --device\); registered: npu, rocm, cuda, cpu, "
                                           r"or 'auto'"):
        resolve_backend("xpu")
    monkeypatch.setenv("PORTRL_DEVICE", "cdua")
    with pytest.raises(BackendError, match=r"unknown device 'cdua' \(from \$PORTRL_DEVICE\).*Did you mean 'cuda'"):
        resolve_backend()


def test_source_of_device_name_is_named_and_the_command_line_beats_the_environment(monkeypatch):
    """device.name set by compose from --device beats $PORTRL_DEVICE; an unusable one names where it came from."""
    monkeypatch.setenv("PORTRL_DEVICE", "cuda")
    assert resolve_backend(config="cpu", config_source="--device").name == "cpu"
    with pytest.raises(BackendError, match=r"device 'cuda' \(from \$PORTRL_DEVICE\) is not usable"):
        resolve_backend(config="cpu", config_source="preset cpu")
    monkeypatch.delenv("PORTRL_DEVICE")
    with pytest.raises(BackendError, match=r"device 'npu' \(from preset ascend-910b\) is not usable"):
        resolve_backend(config="npu", config_source="preset ascend-910b")


def _write_plugin(root, dist, module, entries, body):
    """A real installed distribution (dist-info with entry_points.txt) plus its module, on sys.path."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{name} = {module}:{cls}" for name, cls in entries)
    (info / "entry_points.txt").write_text(f"[portrl.backends]\n{lines}\n")
    (root / f"{module}.py").write_text(textwrap.dedent(body))


XPU_PLUGIN = """
    from portrl.device import Backend, ProbeResult

    class XPUBackend(Backend):
        name = "xpu"
        device_type = "xpu"
        dist_backend = "xccl"
        ray_resource = "GPU"
        detect_priority = 40

        def probe(self):
            return ProbeResult(True, device_count=2, device_name="test xpu")

        def supports_bf16(self):
            return True

        def fp8_dtype(self):
            return None

        def memory_stats(self):
            return {}

        def reset_peak_memory(self):
            pass

        def memory_available(self):
            return None
"""


def test_third_party_backend_through_entry_points(tmp_path, monkeypatch):
    _write_plugin(tmp_path, "portrl_xpu_plugin", "portrl_test_xpu", [("xpu", "XPUBackend")], XPU_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "portrl_test_xpu", raising=False)
    clear_cache()
    assert backend_names()[0] == "xpu"
    assert "cpu" in backend_names()
    assert resolve_backend().name == "xpu"  # highest priority and usable
    assert resolve_backend("xpu").dist_backend == "xccl"


def test_two_plugins_claiming_one_name_is_an_error(tmp_path, monkeypatch):
    body = XPU_PLUGIN.replace('name = "xpu"', 'name = "cpu"')
    _write_plugin(tmp_path, "portrl_dup_plugin", "portrl_test_dup", [("cpu", "XPUBackend")], body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "portrl_test_dup", raising=False)
    clear_cache()
    assert "cpu" not in backend_names() and "cuda" in backend_names()  # the others still work
    with pytest.raises(BackendError, match=r"two plugins claim backend 'cpu'"):
        get_backend("cpu")


def test_entry_point_name_must_match_class_name(tmp_path, monkeypatch):
    _write_plugin(tmp_path, "portrl_bad_plugin", "portrl_test_bad", [("gpu2", "XPUBackend")], XPU_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "portrl_test_bad", raising=False)
    clear_cache()
    assert "gpu2" not in backend_names() and "cpu" in backend_names()  # the others still work
    with pytest.raises(BackendError, match=r"declares name 'xpu'"):
        get_backend("gpu2")


def test_a_backend_without_its_own_bf16_fp8_and_memory_answers_is_refused_at_registration(tmp_path, monkeypatch):
    forgetful = XPU_PLUGIN.replace("def fp8_dtype", "def _fp8").replace("def memory_available", "def _free")
    _write_plugin(tmp_path, "portrl_forgetful_plugin", "portrl_test_forgetful", [("xpu", "XPUBackend")], forgetful)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "portrl_test_forgetful", raising=False)
    clear_cache()
    assert "xpu" not in backend_names() and "cpu" in backend_names()  # the others still work
    with pytest.raises(BackendError) as err:
        get_backend("xpu")
    assert str(err.value) == (
        "device 'xpu': its plugin portrl_test_forgetful:XPUBackend is broken: TypeError: backend 'xpu' "
        "(portrl_test_forgetful.XPUBackend) does not answer fp8_dtype, memory_available: every backend gives these "
        "itself (portrl.device.backend); working backends: npu, rocm, cuda, cpu (see `portrl devices`)")
    assert "\n" not in str(err.value)


def test_import_and_discovery_do_not_import_torch():
    code = (
        "import sys, portrl, portrl.device, portrl.cli\n"
        "from portrl.device import backend_names, all_backends\n"
        "names = backend_names(); backends = all_backends()\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_npu', 'vllm', 'flash_attn'))\n"
        "assert not loaded, loaded\n"
        "print(names)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cpu" in out.stdout

