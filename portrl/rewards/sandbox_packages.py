"""The packages a sandboxed program may import besides the standard library: checking their names and finding them
on the host (nothing is imported).

* :data:`DEFAULT_PACKAGES`: what ``SandboxLimits.packages`` holds by default (numpy);
* :func:`check_package_names`: top-level import names only, each once, never portrl (ValueError, one line);
* :func:`resolve`: where this interpreter finds a top-level module (importlib.util.find_spec): nothing to bind for
  one of the interpreter itself or its standard library, else its folder or file with the folders of its bundled
  shared libraries (auditwheel's ``<distribution>.libs``, numpy.libs), or None when it cannot be bound.

The root's layout (portrl/rewards/sandbox_layout.py) binds what :func:`resolve` finds into the sandbox's site
folder; its ``exposed_packages`` says which names a program can import.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import keyword
import os
import re
from collections.abc import Mapping

from portrl.rewards.sandbox_interpreter import inside, interpreter_info, stdlib_dirs

DEFAULT_PACKAGES = ("numpy",)  # what a sandboxed program may import besides the standard library, by default


def check_package_names(names) -> tuple[str, ...]:
    """``names`` as a tuple of top-level import names (each once, in order); ValueError (one line) for anything
    else."""
    try:
        unique = tuple(dict.fromkeys(names)) if not isinstance(names, (str, bytes)) else None
    except TypeError:
        unique = None
    if unique is None or not all(isinstance(n, str) for n in unique):
        raise ValueError(f"sandbox packages must be a list of top-level import names, got {names!r}")
    for name in unique:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"sandbox packages: {name!r} is not a top-level import name (numpy, not numpy.linalg "
                             "or scikit-learn)")
        if name == "portrl":
            raise ValueError("sandbox packages: portrl cannot be exposed to sandboxed programs (its package data "
                             "holds the training problems and their tests)")
    return unique


@functools.lru_cache(maxsize=64)
def resolve(name: str) -> tuple[str, ...] | None:
    """Where the host finds the top-level module ``name`` (nothing is imported): () for a module of the
    interpreter itself (built in, frozen) or of its standard library, (path, companion folders...) for one to
    bind, None when it is not installed or cannot be bound (a namespace package spread over several folders, a
    module inside a zip)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin in ("built-in", "frozen"):
        return ()
    locations = list(spec.submodule_search_locations or [])
    if locations:
        if len(locations) != 1 or not os.path.isdir(locations[0]):
            return None
        path = os.path.realpath(locations[0])
    elif spec.origin and os.path.isfile(spec.origin):
        path = os.path.realpath(spec.origin)
    else:
        return None
    if inside(path, stdlib_dirs(interpreter_info())):
        return ()
    return (path, *_companions(name, os.path.dirname(path)))


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _companions(name: str, folder: str) -> list[str]:
    """The folders of bundled shared libraries next to a package (auditwheel's ``<distribution>.libs``, e.g.
    numpy.libs, pillow.libs for PIL)."""
    try:
        libs = [e for e in os.listdir(folder) if e.endswith(".libs") and os.path.isdir(os.path.join(folder, e))]
    except OSError:
        return []
    owners = {_normal(name)}
    if libs and not any(_normal(e[:-5]) in owners for e in libs):  # named after the distribution, not the module
        owners |= {_normal(d) for d in _distributions().get(name, [])}
    return [os.path.realpath(os.path.join(folder, e)) for e in sorted(libs) if _normal(e[:-5]) in owners]


@functools.lru_cache(maxsize=1)
def _distributions() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()
