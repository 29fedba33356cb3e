"""docker/check_pins.py, the build-time guard that an image carries the row its Dockerfile pins."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docker" / "check_pins.py"


@pytest.fixture(scope="module")
def check_pins():
    spec = importlib.util.spec_from_file_location("check_pins", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("pinned, installed, same", [
    ("2.8.0", "2.8.0+cu128", True),          # local build tag ignored
    ("7.0", "7.0.0", True),                  # zero padding
    ("2.9.0", "2.9.0a0+git1c57644", True),   # torch source build marker
    ("2.9.0", "2.9.0a0", False),             # a real pre-release is not the release
    ("8.3.RC1", "8.3.rc1", True),
    ("8.3.RC1", "8.3.RC2", False),
    ("2.10.0.post4", "2.10.0", False),
    ("2.10.0", "2.10.1", False),
    ("0.23.0", "0.23.0+empty", True),        # vLLM built with VLLM_TARGET_DEVICE=empty
])
def test_same_version(check_pins, pinned, installed, same):
    assert check_pins.same_version(pinned, installed) is same


def test_mismatches_name_missing_and_different(check_pins):
    lines = check_pins.mismatches({"torch": "2.8.0", "vllm": "0.11.0", "CANN": "9.1.0"},
                                  {"torch": "2.8.0+cu128", "vllm": "0.10.0"})
    assert lines == ["vllm: pinned 0.11.0, installed 0.10.0", "CANN: pinned 9.1.0, not installed"]


def test_rocm_version_falls_back_to_hip(check_pins, monkeypatch):
    monkeypatch.setattr(check_pins, "_rocm_from_hip", lambda: "7.0")
    assert check_pins.installed_components("rocm")["ROCm"] == "7.0"


def _run(*args):
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_script_exit_status_on_this_host():
    from portrl.device import package_version

    torch = package_version("torch")
    ok = _run("cpu", f"torch={torch}")
    assert ok.returncode == 0, ok.stderr
    bad = _run("cpu", "torch=1.0.0")
    assert bad.returncode == 1 and "torch: pinned 1.0.0, installed" in bad.stderr
    usage = _run("cpu", "torch")
    assert usage.returncode != 0 and "expected NAME=VERSION" in usage.stderr
