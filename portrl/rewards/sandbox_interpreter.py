"""The interpreter the code sandbox runs, and what it is made of.

* :func:`base_executable`: the real executable behind a virtual environment's launcher (the sandbox needs no
  virtual environment: it runs the base interpreter);
* :func:`interpreter_info`: its standard library, library folders and site folders, learnt once per process by
  running it with ``-I -S`` in a clean environment (SandboxError when it cannot be run, or is another Python
  version than this process);
* :func:`stdlib_dirs`: the folders of its standard library; :func:`real_dirs` and :func:`inside`, the path helpers
  the root's layout (portrl/rewards/sandbox_layout.py) and the package lookup (sandbox_packages.py) share.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

from portrl.rewards.sandbox_errors import SandboxError

# run by the base interpreter with -I -S: its module search path without and with site, the libraries it has
# mapped before site runs (.pth files may import more), its site folders and the sysconfig paths
_QUERY = """\
import json, sys
plain = list(sys.path)
libs = set()
try:
    with open('/proc/self/maps') as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith('/') and '.so' in parts[5]:
                libs.add(parts[5].strip())
except OSError:
    pass
import site, sysconfig
site.main()
paths = sysconfig.get_paths()
print(json.dumps({'executable': sys.executable, 'stdlib_path': plain, 'path': sys.path, 'libs': sorted(libs),
                  'site': site.getsitepackages(), 'stdlib': paths['stdlib'], 'platstdlib': paths['platstdlib'],
                  'libdir': sysconfig.get_config_var('LIBDIR') or '', 'version': list(sys.version_info[:2])}))
"""


def base_executable() -> str:
    """The real path of the base interpreter (not a virtual environment's launcher): what the sandbox runs."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


@functools.lru_cache(maxsize=1)
def interpreter_info() -> dict:
    """What the base interpreter (:func:`base_executable`) is made of, asked once per process by running it
    (``-I -S``, a clean environment): {"executable", "stdlib_path" (sys.path without site), "path" (with site),
    "libs" (shared libraries mapped at start), "site" (site.getsitepackages()), "stdlib", "platstdlib",
    "libdir", "version"}. SandboxError when it cannot be run."""
    python = base_executable()
    try:
        done = subprocess.run([python, "-I", "-S", "-c", _QUERY], capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/")
        info = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise SandboxError(f"cannot run the base interpreter {python} to learn its paths: {exc}") from None
    if info is None:
        tail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise SandboxError(f"cannot run the base interpreter {python} to learn its paths: {tail}")
    if tuple(info["version"]) != tuple(sys.version_info[:2]):
        raise SandboxError(f"the base interpreter {python} is Python {info['version'][0]}.{info['version'][1]}, "
                           f"not this process's {sys.version_info[0]}.{sys.version_info[1]}")
    return info


def real_dirs(paths) -> list[str]:
    """The real paths of those of ``paths`` that are folders (empty entries left out)."""
    return [os.path.realpath(p) for p in paths if p and os.path.isdir(p)]


def stdlib_dirs(info: dict) -> list[str]:
    """The folders of the standard library (stdlib, platstdlib, lib-dynload: sys.path without site)."""
    return sorted(set(real_dirs(info["stdlib_path"] + [info["stdlib"], info["platstdlib"]])))


def inside(path: str, folders) -> bool:
    """Whether ``path`` is one of ``folders`` or lies below one."""
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)
