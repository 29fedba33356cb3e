"""A device this host does not have is said as such, at once: ``--device npu`` on a machine without one names what
is missing and the devices that are here, before the config's composition imports torch; ``portrl doctor`` and
``portrl devices`` print their first line before anything slow runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from portrl.device import BackendError, check_cli_device, clear_cache, get_backend


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("PORTRL_DEVICE", raising=False)
    clear_cache()
    yield
    clear_cache()


def _absent(name: str) -> bool:
    return get_backend(name).host_shows_device()[0] is False


def _run(argv):
    """``portrl <argv>`` in a fresh process: (exit code, stderr, whether torch was imported)."""
    code = ("import sys; from portrl.cli import main; rc = main(sys.argv[1:]); "
            "print('torch' in sys.modules, file=sys.stderr); sys.exit(rc)")
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("PORTRL_DEVICE", None)
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120)
    lines = r.stderr.strip().splitlines()
    return r.returncode, "\n".join(lines[:-1]), lines[-1] == "True"


@pytest.mark.parametrize("name", ["npu", "cuda", "rocm"])
def test_check_cli_device_names_what_is_missing_and_what_is_here(name):
    if not _absent(name):
        pytest.skip(f"this host has {name} device nodes")
    with pytest.raises(BackendError) as err:
        check_cli_device(name)
    msg = str(err.value)
    assert msg.startswith(f"device '{name}' (from --device) is not usable here: this host has no {name} device (no /dev/")
    assert msg.endswith("usable here: cpu (see `portrl devices`)") and "pip install" not in msg


@pytest.mark.parametrize("kw", [{"preset": "cpu"}, {"config_file": "run.yaml"}, {"overrides": ["device=cpu"]},
                                {"overrides": ["device.name=cpu"]}, {"overrides": ["+preset=cpu"]}])
def test_check_cli_device_leaves_a_name_that_may_still_change_to_the_config(kw):
    """--preset, --config or an override can still change the device: the composed config decides."""
    check_cli_device("npu", **kw)
    check_cli_device("h100")  # a device preset's name, not a backend's
    check_cli_device(None)
    check_cli_device("auto")


def test_a_device_error_comes_before_torch_is_imported():
    if not _absent("npu"):
        pytest.skip("this host has npu device nodes")
    rc, err, torch_imported = _run(["eval", "--device", "npu"])
    assert rc == 2 and err.startswith("portrl eval: error: device 'npu' (from --device) is not usable here: this host "
                                      "has no npu device") and "usable here: cpu" in err
    assert not torch_imported  # measured on a 2-core host: 0.5 s instead of 10 to 13 s


def test_doctor_on_the_cpu_imports_no_torch():
    """The CPU's checks (its compiler included) read the host only: 0.5 s instead of 7 s."""
    if not all(_absent(n) for n in ("npu", "cuda", "rocm")):
        pytest.skip("this host has a vendor's device nodes: detection probes it with torch")
    rc, _, torch_imported = _run(["doctor"])
    assert rc == 0 and not torch_imported
