"""Build a C++ source of this folder into a library of torch ops, once per machine, and load it.

The source is compiled by the host's C++ compiler (``$CXX``, else ``g++`` or ``c++``) against the running
torch's headers and libraries, for this CPU (``-march=native``) with OpenMP (torch's ``at::parallel_for``
then runs on torch's own intra-op threads: the library's ``libgomp.so.1`` is the one torch already loaded).
The library is cached in :func:`cache_root` (default ``~/.cache/portrl/kernels``) under a name hashed
from the source, the flags, torch's version and the CPU's model and flags, so later processes (Ray workers,
the next run) load it in milliseconds, and a cache folder shared with a different CPU never serves a library
built for another instruction set. It is compiled to a temporary name and renamed: a concurrent or
interrupted build never leaves a half-written library under the final name.

Compiling takes about 10 s on 2 cores. :class:`KernelBuildError` (with the compiler's last lines) is raised
when there is no compiler or the build fails; callers fall back to another implementation.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).resolve().parent
# CPU_CAPABILITY_AVX512: at::vec::Vectorized<float> is 16 lanes wide and its exp is Sleef's (in libtorch_cpu)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w", "-DCPU_CAPABILITY_AVX512",
         "-DCPU_CAPABILITY=AVX512")

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, Path] = {}
_failed: dict[str, str] = {}


class KernelBuildError(RuntimeError):
    """A native kernel library could not be built or loaded here."""


def compiler() -> str | None:
    """Path of the C++ compiler to use: ``$CXX`` if set (and found), else ``g++`` or ``c++``; None when none."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++"]
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def cache_root() -> Path:
    """``$PORTRL_KERNEL_CACHE``, else ``$PORTRL_CACHE/kernels``, else ``~/.cache/portrl/kernels``."""
    if os.environ.get("PORTRL_KERNEL_CACHE"):
        return Path(os.environ["PORTRL_KERNEL_CACHE"])
    return Path(os.environ.get("PORTRL_CACHE") or Path.home() / ".cache" / "portrl") / "kernels"


def _cpu_identity() -> str:
    """The CPU's model name and flags (Linux), so a library built with ``-march=native`` stays on its CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _command(cxx: str, source: Path, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), str(source), "-o", str(output),
            *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]


def library_path(name: str) -> Path:
    """Where ``name``'s library for this source, torch and CPU is (or will be) cached."""
    cxx = compiler() or ""
    source = SOURCE_DIR / f"{name}.cpp"
    key = hashlib.sha256("\n".join([source.read_text(), " ".join(FLAGS), torch.__version__, cxx,
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    return cache_root() / f"{name}-{key}.so"


def load(name: str) -> Path:
    """Build (if not cached) and load ``backends/cpu/{name}.cpp``'s ops into this process; idempotent.
    Returns the library's path. Raises :class:`KernelBuildError` when it cannot be built or loaded."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        cxx = compiler()
        if cxx is None:
            raise KernelBuildError("no C++ compiler found (install g++ or set CXX)")
        path = library_path(name)
        if not path.exists():
            _build(cxx, SOURCE_DIR / f"{name}.cpp", path)
        try:
            torch.ops.load_library(str(path))
        except OSError as exc:
            raise KernelBuildError(f"cannot load {path}: {exc}") from exc
        _loaded[name] = path
        return path


def try_load(name: str) -> bool:
    """:func:`load`, or False when the library cannot be built or loaded here: the first failure per library is
    one warning (the reason, and that the callers fall back), later calls return False at once."""
    if name in _failed:
        return False
    try:
        load(name)
        return True
    except KernelBuildError as exc:
        _failed[name] = str(exc)
        log.warning("the native CPU kernels of backends/cpu/%s.cpp are off (%s); the next implementation serves "
                    "instead", name, exc)
        return False


def _build(cxx: str, source: Path, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run(_command(cxx, source, Path(tmp)), capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
            raise KernelBuildError(f"building {source.name} failed (exit {done.returncode}):\n{tail}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"building {source.name} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
