"""The code sandbox whatever the install: what a program can read and import, and where the interpreter may live.

The minimal root (portrl/rewards/sandbox_layout.root_layout) holds the base interpreter, its standard library, the
system's programs and libraries and the packages of ``SandboxLimits.packages``; every site-packages folder is an
empty tmpfs. These tests run real programs that look for what they must not see -- portrl's package data (the
shipped problems and their tests), the checkout, the test's own data, the installed packages -- from an editable
install (this checkout), from a non-editable one (portrl copied into a virtual environment's site-packages), and
from interpreters that live in /tmp and /dev/shm, where the root's private /tmp and /dev/shm used to hide them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import portrl
from portrl.rewards.sandbox import (
    DEFAULT_PACKAGES,
    RunResult,
    SandboxLimits,
    exposed_packages,
    run_program,
)
from portrl.rewards.sandbox_host import base_executable, interpreter_info

REPO = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(timeout_s=20.0, memory_mb=512, allow_unisolated=True)
VERSION = f"python{sys.version_info[0]}.{sys.version_info[1]}"


@pytest.fixture(scope="module")
def isolation() -> RunResult:
    return run_program("print('probe')", "", LIMITS)


def _need_root(isolation: RunResult) -> None:
    if not isolation.root_isolated:
        pytest.skip(f"this platform does not give the minimal root: {isolation.details}")


def _probe(paths: list[str], folders: list[str]) -> str:
    """A program that tries to read ``paths``, list ``folders`` and its own site folder, and imports a few
    packages; one line each."""
    return textwrap.dedent(f"""
        import os, site
        for path in {paths!r}:
            try:
                print('read', path, len(open(path, 'rb').read()))
            except OSError as exc:
                print('refused', path, type(exc).__name__)
        for folder in {folders!r}:
            try:
                print('listed', folder, sorted(os.listdir(folder)))
            except OSError as exc:
                print('refused', folder, type(exc).__name__)
        print('site', sorted(os.listdir(site.getsitepackages()[0])))
        for name in ('numpy', 'torch', 'portrl', 'pytest'):
            try:
                module = __import__(name)
                print('imported', name, module.__name__)
            except ImportError as exc:
                print('missing', name, type(exc).__name__)
        import numpy
        print('numpy', int(numpy.arange(5).sum()))
    """)


def _check(stdout: str, refused: list[str], empty: list[str]) -> None:
    lines = stdout.splitlines()
    for path in refused:
        assert any(line.startswith(f"refused {path} ") for line in lines), (path, stdout)
    for folder in empty:  # a masked package folder: listed, and empty
        assert f"listed {folder} []" in lines or any(line.startswith(f"refused {folder} ") for line in lines), stdout
    assert "site ['numpy', 'numpy.libs']" in lines or "site ['numpy']" in lines, stdout
    assert "imported numpy numpy" in lines and "numpy 10" in lines, stdout
    for name in ("torch", "portrl", "pytest"):
        assert f"missing {name} ModuleNotFoundError" in lines, stdout


def test_editable_install_the_checkout_its_data_and_site_packages_are_out_of_reach(isolation, tmp_path):
    _need_root(isolation)
    pytest.importorskip("numpy")
    secret = tmp_path / "tests.jsonl"
    secret.write_text(json.dumps({"input": "1 2", "output": f"secret-{uuid.uuid4().hex}"}) + "\n")
    secret.chmod(0o644)
    data = Path(portrl.__file__).resolve().parent / "data" / "code_problems.jsonl"
    assert data.is_file()
    venv_site = Path(sys.prefix) / "lib" / VERSION / "site-packages"
    base_site = [p for p in interpreter_info()["site"] if os.path.isdir(p)]
    r = run_program(_probe([str(data), str(REPO / "README.md"), str(secret), str(Path(__file__).resolve())],
                           [str(REPO), str(venv_site), *base_site, str(tmp_path)]), "", LIMITS)
    assert r.status == "ok", r.stderr
    _check(r.stdout, [str(data), str(REPO / "README.md"), str(secret), str(REPO), str(tmp_path)],
           [] if os.path.realpath(venv_site) in map(os.path.realpath, base_site) else [str(venv_site)])
    assert "secret-" not in r.stdout


# ------------------------------------------------------------------------------ interpreters in temporary folders
def _copy_base_interpreter(dest: Path) -> Path:
    """The base interpreter and its standard library (not its site-packages' contents, not its tests) copied to
    ``dest``: a Python installation that lives there (its prefix is ``dest``)."""
    source = Path(sys.base_prefix)
    exe = Path(base_executable())
    (dest / "bin").mkdir(parents=True)
    shutil.copy2(exe, dest / "bin" / exe.name)
    shutil.copytree(source / "lib" / VERSION, dest / "lib" / VERSION, symlinks=True,
                    ignore=shutil.ignore_patterns("site-packages", "test", "__pycache__", "config-*", "idlelib",
                                                  "tkinter", "turtledemo", "lib2to3", "ensurepip"))
    (dest / "lib" / VERSION / "site-packages").mkdir()  # as an installation has it, empty
    python = dest / "bin" / exe.name
    done = subprocess.run([str(python), "-I", "-c", "import sys, json; print(json.dumps(sys.prefix))"],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and json.loads(done.stdout) == str(dest), done  # it runs from there, standalone
    return python


@pytest.fixture(scope="module")
def copied_base(tmp_path_factory) -> Path:
    if not (Path(sys.base_prefix) / "lib" / VERSION / "os.py").is_file():
        pytest.skip(f"the base interpreter's standard library is not in {sys.base_prefix}/lib/{VERSION}")
    return _copy_base_interpreter(tmp_path_factory.mktemp("base") / "python")


_LOAD_SANDBOX = textwrap.dedent("""
    import importlib.util, sys, types
    import portrl
    # portrl.rewards/__init__ imports the reward manager (torch): the sandbox modules need only the standard library
    rewards = types.ModuleType('portrl.rewards')
    rewards.__path__ = [portrl.__path__[0] + '/rewards']
    sys.modules['portrl.rewards'] = rewards
    from portrl.rewards.sandbox import SandboxLimits, exposed_packages, run_program
""")


def _run_host(python: Path, script: str, env: dict) -> dict:
    done = subprocess.run([str(python), "-c", _LOAD_SANDBOX + textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=300, cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": "/tmp",
                                                                "TMPDIR": "/tmp", **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sandbox_starts_from_a_base_interpreter_in_tmp(isolation, copied_base):
    """An interpreter under /tmp: the root's private /tmp used to be mounted over it once it was bound."""
    _need_root(isolation)
    r = _run_host(copied_base, """
        import json
        limits = SandboxLimits(timeout_s=20.0, memory_mb=256)
        r = run_program("import sys\\nprint('hello from', sys.executable)", "", limits)
        print(json.dumps({**r.__dict__, "exposed": exposed_packages(("numpy", "json"))}))
    """, {"PYTHONPATH": str(REPO)})
    assert (r["status"], r["stdout"]) == ("ok", f"hello from {copied_base}\n"), r
    assert r["root_isolated"] and r["pid_isolated"] and r["seccomp_filtered"], r
    assert r["exposed"] == [["json"], ["numpy"]], r  # numpy is not installed in that interpreter


@pytest.fixture(scope="module")
def venv_in_shm(copied_base, tmp_path_factory):
    """A virtual environment made by the copied interpreter in /dev/shm (a tmpfs the root also replaces), with
    portrl installed non-editable: the package (and its package data) copied into its site-packages. numpy comes
    from this test's environment through a .pth file."""
    parent = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path_factory.mktemp("shm")
    venv = parent / f"portrl-test-venv-{uuid.uuid4().hex}"
    try:
        subprocess.run([str(copied_base), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin"})
        site = venv / "lib" / VERSION / "site-packages"
        shutil.copytree(Path(portrl.__file__).parent, site / "portrl", ignore=shutil.ignore_patterns("__pycache__"))
        numpy_home = Path(pytest.importorskip("numpy").__file__).resolve().parents[1]
        (site / "test-numpy.pth").write_text(f"{numpy_home}\n")
        yield venv
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def test_non_editable_install_in_a_venv_in_dev_shm_keeps_its_package_data_out_of_reach(isolation, venv_in_shm,
                                                                                        tmp_path):
    _need_root(isolation)
    site = venv_in_shm / "lib" / VERSION / "site-packages"
    data = site / "portrl" / "data" / "code_problems.jsonl"
    secret = tmp_path / "ground_truth.txt"
    secret.write_text(f"secret-{uuid.uuid4().hex}")
    secret.chmod(0o644)
    refused = [str(data), str(site / "portrl" / "__init__.py"), str(REPO / "README.md"), str(secret)]
    r = _run_host(venv_in_shm / "bin" / "python", f"""
        import json, portrl
        assert portrl.__file__.startswith({str(site)!r}), portrl.__file__  # the non-editable copy
        r = run_program({_probe(refused, [str(site), str(venv_in_shm), str(tmp_path)])!r}, "",
                        SandboxLimits(timeout_s=20.0, memory_mb=512))
        print(json.dumps(r.__dict__))
    """, {})
    assert r["status"] == "ok", r
    assert r["root_isolated"] and r["uid_dropped"] == (os.geteuid() == 0), r
    _check(r["stdout"], refused + [str(site), str(venv_in_shm), str(tmp_path)], [])
    assert "secret-" not in r["stdout"]


# ---------------------------------------------------------------------------------------- the package list
def test_exposed_packages_says_which_names_a_program_can_import():
    pytest.importorskip("numpy")
    assert DEFAULT_PACKAGES == ("numpy",)
    assert exposed_packages(["numpy", "json", "sys", "numpy", "no_such_package_xyz"]) == (
        ("numpy", "json", "sys"), ("no_such_package_xyz",))
    for bad, problem in ((["numpy.linalg"], "not a top-level import name"), (["scikit-learn"], "not a top-level"),
                         ("numpy", "a list of top-level import names"), ([3], "a list of top-level import names"),
                         (["portrl"], "portrl cannot be exposed")):
        with pytest.raises(ValueError, match=problem) as raised:
            exposed_packages(bad)
        assert "\n" not in str(raised.value)
        with pytest.raises(ValueError, match=problem):
            SandboxLimits(packages=bad)


def test_only_the_listed_packages_import(isolation):
    _need_root(isolation)
    pytest.importorskip("numpy")
    yaml = pytest.importorskip("yaml")
    src = ("for name in ('numpy', 'yaml'):\n    try:\n        __import__(name)\n        print(name, 'imported')\n"
           "    except ImportError:\n        print(name, 'missing')\n")
    assert run_program(src, "", LIMITS).stdout == "numpy imported\nyaml missing\n"
    r = run_program(src + "print(__import__('yaml').safe_load('a: [1, 2]'))\n", "",
                    SandboxLimits(timeout_s=20.0, memory_mb=512, allow_unisolated=True, packages=("yaml",)))
    assert r.stdout == "numpy missing\nyaml imported\n{'a': [1, 2]}\n", (r.stdout, r.stderr, yaml.__file__)
    assert run_program(src, "", SandboxLimits(timeout_s=20.0, allow_unisolated=True, packages=())).stdout == (
        "numpy missing\nyaml missing\n")
