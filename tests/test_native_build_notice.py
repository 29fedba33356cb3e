"""The first build of the CPU kernels in a process says so in one line on stderr (backends/cpu/native_build.py:
a minute or two of compiling, silent otherwise); a process that finds them cached says nothing. A Python one-liner
stands in for the compiler and the loading is recorded, not done (as in tests/test_native_cache_trust.py)."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

from portrl.backends.cpu import native_build


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder, a fake compiler, nothing loaded or announced yet in this process."""
    folder = tmp_path / "kernels"
    monkeypatch.setenv("PORTRL_KERNEL_CACHE", str(folder))
    monkeypatch.setattr(native_build, "compiler", lambda: sys.executable)
    monkeypatch.setattr(native_build, "_command", lambda cxx, source, output: [
        sys.executable, "-c", "import sys; open(sys.argv[1], 'wb').write(b'built')", str(output)])
    for name in ("_loaded", "_failed", "_held"):
        monkeypatch.setattr(native_build, name, {})
    monkeypatch.setattr(native_build, "_announced", False)
    real_cdll = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL", lambda path, *a, **k: None if str(path).startswith(
        ("/proc/self/fd/", str(tmp_path))) else real_cdll(path, *a, **k))
    yield folder
    for fd in native_build._held.values():  # the descriptors load keeps open
        os.close(fd)


def _later_process(monkeypatch):
    for name in ("_loaded", "_failed"):
        monkeypatch.setattr(native_build, name, {})
    monkeypatch.setattr(native_build, "_announced", False)


def test_the_first_build_says_what_it_does_once_and_a_warm_cache_is_silent(fresh, monkeypatch, capfd):
    native_build.load("swiglu")
    native_build.load("rms_norm")  # a second build of the same process: no second line
    out, err = capfd.readouterr()
    assert out == ""
    assert err == f"portrl: compiling the CPU kernels for this machine (once; cached in {fresh})\n"
    _later_process(monkeypatch)
    native_build.load("swiglu")
    native_build.load("rms_norm")
    assert capfd.readouterr() == ("", "")


def test_a_warm_cache_and_a_new_library_say_it_once(fresh, monkeypatch, capfd):
    native_build.load("swiglu")
    capfd.readouterr()
    _later_process(monkeypatch)
    native_build.load("swiglu")  # cached: nothing
    assert capfd.readouterr().err == ""
    native_build.load("rotary")  # not cached yet: this process builds, and says so
    assert capfd.readouterr().err.startswith("portrl: compiling the CPU kernels for this machine (once;")
