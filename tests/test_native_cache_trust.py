"""The CPU kernel cache loads only what this user built (backends/cpu/native_build.py): a library its manifest
vouches for (the sha256 of the bytes built), a regular file of this user, in a folder no one else can write.
Anything else is built again, or, when the folder is refused, not loaded at all (one warning, the fallback serves).

The fast tests stand a Python one-liner in for the compiler and record what would be loaded (``ctypes.CDLL``);
one test builds and loads the real library, in subprocesses (a process registers a library's ops once)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from portrl.backends.cpu import native_build

NAME = "swiglu"  # a real source of backends/cpu/ (the cache key hashes it)


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A cache folder under tmp_path, a fake compiler that writes ``built <n>`` and a recorder of loads."""
    folder = tmp_path / "kernels"
    monkeypatch.setenv("PORTRL_KERNEL_CACHE", str(folder))
    monkeypatch.setattr(native_build, "compiler", lambda: sys.executable)
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setattr(native_build, "_failed", {})
    builds: list[str] = []

    def command(cxx, source, output):
        builds.append(source.name)
        return [sys.executable, "-c", "import sys; open(sys.argv[1], 'wb').write(sys.argv[2].encode())",
                str(output), f"built {len(builds)}"]

    monkeypatch.setattr(native_build, "_command", command)
    loaded: list[bytes] = []
    names: list[str] = []
    real_cdll = ctypes.CDLL

    def cdll(path, *args, **kwargs):
        if str(path).startswith(("/proc/self/fd/", str(tmp_path))):
            loaded.append(Path(path).read_bytes())
            names.append(str(path))
            return None
        return real_cdll(path, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(native_build, "_held", {})
    yield SimpleNamespace(folder=folder, builds=builds, loaded=loaded, names=names,
                          path=lambda: native_build.library_path(NAME))
    for fd in native_build._held.values():
        os.close(fd)


def _again(monkeypatch):
    """A later process: nothing loaded yet."""
    monkeypatch.setattr(native_build, "_loaded", {})


def _plant(path: Path, data: bytes) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o755)


def test_a_build_is_vouched_for_by_its_manifest_and_reused(cache, monkeypatch):
    """Under a umask that lets the group write (many distributions' default): the folder is 0700, the library
    writable by its owner only, the manifest names it and its sha256; a later process loads it without building."""
    old = os.umask(0o002)
    try:
        native_build.load(NAME)
    finally:
        os.umask(old)
    path = cache.path()
    assert cache.builds == [f"{NAME}.cpp"] and cache.loaded == [b"built 1"]
    assert stat.S_IMODE(cache.folder.stat().st_mode) == 0o700 and not path.stat().st_mode & 0o022
    record = json.loads(native_build.manifest_path(path).read_text())
    assert record == {"library": path.name, "sha256": hashlib.sha256(b"built 1").hexdigest()}
    assert not native_build.manifest_path(path).stat().st_mode & 0o022
    _again(monkeypatch)
    native_build.load(NAME)
    assert cache.builds == [f"{NAME}.cpp"] and cache.loaded == [b"built 1", b"built 1"]


def test_each_library_is_loaded_under_a_name_of_its_own(cache):
    """The dynamic loader takes a name it loaded before for that library: two libraries loaded one after the
    other must not reach it under the same /proc/self/fd/<n> (a descriptor closed and reused)."""
    native_build.load(NAME)
    native_build.load("rows_linear")
    assert cache.loaded == [b"built 1", b"built 2"] and len(set(cache.names)) == 2


def test_a_planted_library_without_a_manifest_is_built_again_not_loaded(cache):
    _plant(cache.path(), b"planted")
    native_build.load(NAME)
    assert cache.loaded == [b"built 1"] and len(cache.builds) == 1
    assert cache.path().read_bytes() == b"built 1"


def test_a_library_changed_after_its_build_is_built_again(cache, monkeypatch):
    native_build.load(NAME)
    cache.path().write_bytes(b"changed")  # same owner, same mode: only the bytes differ from the manifest
    _again(monkeypatch)
    native_build.load(NAME)
    assert cache.loaded == [b"built 1", b"built 2"] and len(cache.builds) == 2


def test_a_manifest_of_another_library_does_not_vouch(cache, monkeypatch):
    native_build.load(NAME)
    path = cache.path()
    other = path.with_name("other-0000.so")
    _plant(other, b"planted")
    native_build.manifest_path(other).write_text(json.dumps(
        {"library": other.name, "sha256": hashlib.sha256(b"planted").hexdigest()}))
    os.replace(other, path)
    os.replace(native_build.manifest_path(other), native_build.manifest_path(path))
    _again(monkeypatch)
    native_build.load(NAME)
    assert cache.loaded == [b"built 1", b"built 2"]


def test_a_symlinked_library_is_not_loaded(cache, monkeypatch, tmp_path):
    """Even with the right bytes (its manifest matches): a symlink can be repointed after the check."""
    native_build.load(NAME)
    path = cache.path()
    os.replace(path, tmp_path / "elsewhere.so")
    path.symlink_to(tmp_path / "elsewhere.so")
    _again(monkeypatch)
    native_build.load(NAME)
    assert cache.loaded == [b"built 1", b"built 2"] and not path.is_symlink()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_library_of_another_user_is_not_loaded(cache, monkeypatch):
    native_build.load(NAME)
    os.chown(cache.path(), 65534, -1)
    _again(monkeypatch)
    native_build.load(NAME)
    assert cache.loaded == [b"built 1", b"built 2"] and cache.path().stat().st_uid == 0


@pytest.mark.parametrize("mode, writers", [(0o770, "its group"), (0o757, "anyone"), (0o1777, "its group and anyone")])
def test_a_cache_folder_others_can_write_is_refused_with_one_warning(cache, monkeypatch, mode, writers):
    """Refused, not rebuilt elsewhere: no library is built or loaded there; try_load warns once (the fallback
    serves) naming the folder and the fix."""
    native_build.load(NAME)
    cache.folder.chmod(mode)
    _again(monkeypatch)
    with pytest.raises(native_build.KernelBuildError, match=f"is refused: .* is writable by {writers} "):
        native_build.load(NAME)
    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    native_build.log.addHandler(handler)
    try:
        assert native_build.try_load(NAME) is False and native_build.try_load(NAME) is False
    finally:
        native_build.log.removeHandler(handler)
    assert len(seen) == 1 and "chmod go-w" in seen[0] and "PORTRL_KERNEL_CACHE" in seen[0]
    assert cache.builds == [f"{NAME}.cpp"] and cache.loaded == [b"built 1"]


def test_a_new_cache_folder_in_a_writable_folder_is_refused_before_any_build(cache, monkeypatch, tmp_path):
    """A folder above it that anyone may write without the sticky bit: another user could swap the cache."""
    above = tmp_path / "open"
    above.mkdir()
    above.chmod(0o777)
    monkeypatch.setenv("PORTRL_KERNEL_CACHE", str(above / "kernels"))
    with pytest.raises(native_build.KernelBuildError, match="above it, is writable by anyone and not sticky"):
        native_build.load(NAME)
    assert cache.builds == [] and cache.loaded == []
    above.chmod(0o1777)  # as /tmp: others may write, but not rename or delete this user's entries
    native_build.load(NAME)
    assert cache.loaded == [b"built 1"]


@pytest.fixture(scope="module")
def real_build(tmp_path_factory):
    """The real compiler builds the real library once, in a process of its own, into a fresh cache."""
    if native_build.compiler() is None:
        pytest.skip("no C++ compiler")
    folder = tmp_path_factory.mktemp("real") / "kernels"
    env = {**os.environ, "PORTRL_KERNEL_CACHE": str(folder)}
    script = ("import logging, sys, torch; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
              "from portrl.backends.cpu import native_build\n"
              f"print(native_build.load({NAME!r}))\n"
              "g, u = torch.randn(3, 8), torch.randn(3, 8)\n"
              "print(torch.allclose(torch.ops.portrl_cpu_swiglu.forward(g, u), torch.nn.functional.silu(g) * u,"
              " atol=1e-6))\n")
    run = lambda: subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    first = run()
    assert first.returncode == 0, first.stderr
    return SimpleNamespace(folder=folder, first=first, run=run)


def test_the_real_build_is_vouched_for_and_loaded_without_building_again(real_build):
    path = Path(real_build.first.stdout.splitlines()[-2])
    assert real_build.first.stdout.splitlines()[-1] == "True"
    record = json.loads(native_build.manifest_path(path).read_text())
    assert record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert not path.stat().st_mode & 0o022 and stat.S_IMODE(real_build.folder.stat().st_mode) == 0o700
    before = path.stat()
    second = real_build.run()
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[-1] == "True" and "building it again" not in second.stdout
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
