"""The file system a sandboxed program sees, as the host computes it (the child, portrl/rewards/sandbox_child.py,
builds it).

* :func:`root_layout`: what the minimal root (portrl/rewards/sandbox_root.py) holds -- the system's programs and
  libraries (``SYSTEM_DIRS``), ``SYSTEM_FILES``, the base interpreter with its standard library and library folders
  (portrl/rewards/sandbox_interpreter.py), ``DEVICES``; every Python package folder inside those masked, and the
  packages a program may import (portrl/rewards/sandbox_packages.py) bound into the interpreter's site folder --
  computed once per process and package list;
* :func:`exposed_packages`: which top-level import names a sandboxed program can import;
* :func:`isolation_view`: the fallback where that root cannot be built: the folders the child masks with tmpfs in
  its mount namespace (``WRITABLE_DIRS`` and, as root, folders a dropped uid cannot enter) and the paths it binds
  back (the sandbox folder, this process's interpreter).
"""

from __future__ import annotations

import functools
import glob
import os
import stat
import sys
from pathlib import Path

from portrl.rewards.sandbox_interpreter import inside, interpreter_info, real_dirs, stdlib_dirs
from portrl.rewards.sandbox_packages import check_package_names, resolve

WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# the system's programs and shared libraries: a folder is bound, a link copied; /etc/alternatives holds the links
# of Debian tools (/usr/bin/awk -> ...); the time zones for zoneinfo and /etc/localtime
SYSTEM_DIRS = ("/bin", "/lib", "/lib32", "/lib64", "/libx32", "/usr/bin", "/usr/lib", "/usr/lib32", "/usr/lib64",
               "/usr/libx32", "/usr/libexec", "/etc/alternatives", "/usr/share/zoneinfo")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")  # the loader's library index; the local time zone
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


# ------------------------------------------------------------------------------------------- minimal root
def _package_folder_candidates(info: dict, folders: list[str]) -> set[str]:
    """Every Python package folder the interpreter knows of (its sys.path entries besides the standard library, its
    site folders) and every site-packages / dist-packages folder directly below the bound ``folders``."""
    stdlib = set(stdlib_dirs(info))
    found = {p for p in real_dirs(info["path"] + info["site"]) if p not in stdlib}
    for folder in folders:
        for pattern in ("site-packages", "dist-packages", "python*/site-packages", "python*/dist-packages",
                        "lib/python*/site-packages"):
            found.update(real_dirs(glob.glob(os.path.join(glob.escape(folder), pattern))))
    return found


def _site_folder(info: dict, binds: list[str], masks: list[str]) -> str | None:
    """Where the exposed packages go: the first of the interpreter's site folders that is masked (it exists) or
    lies outside every bound folder (it can be made in the root); None when neither (a site folder missing inside
    a bound folder has nowhere to be mounted)."""
    for path in info["site"]:
        real = os.path.realpath(path)
        if real in masks or not inside(real, binds):
            return real
    return None


def exposed_packages(names) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(exposed, missing): which of the top-level import ``names`` a sandboxed program can import (found in this
    interpreter, bound into the sandbox's site folder, or part of the standard library) and which not (not
    installed here; a namespace package spread over several folders; no site folder in the sandbox). Nothing is
    imported. ValueError (one line) for a name that is not a top-level import name, and for portrl."""
    names = check_package_names(names)
    site_ok = root_layout(())["site"] is not None
    exposed: list[str] = []
    missing: list[str] = []
    for name in names:
        where = resolve(name)
        ok = where is not None and (where == () or site_ok)
        (exposed if ok else missing).append(name)
    return tuple(exposed), tuple(missing)


@functools.lru_cache(maxsize=16)
def root_layout(packages: tuple[str, ...] = ()) -> dict:
    """What the minimal root holds besides the program's folder, computed once per process (and per package list):

    * "binds": [[source, target], ...] folders bound read-only: the system's programs and libraries
      (``SYSTEM_DIRS`` that are folders), the base interpreter's standard library (stdlib, lib-dynload) and library
      folders (its LIBDIR, the folder of every shared library it maps at start, e.g. libpython); a folder inside
      another is left out (the outer bind holds it);
    * "files": [[source, target], ...] single files bound read-only: ``SYSTEM_FILES`` and the base interpreter;
    * "links": [[path, link text], ...] recreated (``SYSTEM_DIRS`` entries that are links, /bin -> usr/bin);
    * "devices": the character devices bound;
    * "masks": every Python package folder inside the binds (site-packages, dist-packages: the interpreter's own and
      any other below the bound library folders), each covered by an empty read-only tmpfs;
    * "site": the interpreter's site folder that holds the exposed packages (a mask, or a folder made in the
      root), or None;
    * "packages": [[source, name], ...] bound read-only into "site": each of ``packages`` that is installed (and
      not in the standard library) with its companion library folders (numpy.libs);
    * "python": the base interpreter the program runs with (a virtual environment's launcher is not needed).

    Paths are real paths (symbolic links resolved); "/" is never bound."""
    packages = check_package_names(packages)
    info = interpreter_info()
    python = os.path.realpath(info["executable"])
    binds: dict[str, str] = {}
    files, links = [], []
    for path in SYSTEM_DIRS + SYSTEM_FILES:
        if os.path.islink(path):
            links.append([path, os.readlink(path)])
        elif os.path.isdir(path):
            binds[path] = path
        elif os.path.isfile(path):
            files.append([path, path])
    linked = [path for path, _ in links]
    stdlib = stdlib_dirs(info)
    libdirs = real_dirs([info["libdir"]] + [os.path.dirname(lib) for lib in info["libs"] if os.path.isfile(lib)])
    for path in stdlib + libdirs:
        if path != "/" and not inside(path, linked):
            binds.setdefault(path, path)
    outer = sorted(t for t in binds if not any(t != o and inside(t, [o]) for o in binds))
    if not inside(python, outer):
        files.append([python, python])
    files = [[s, t] for s, t in files if not inside(t, outer)]
    needed = [python] + stdlib + libdirs + [b for b in outer if b in SYSTEM_DIRS]
    masks = sorted(m for m in _package_folder_candidates(info, outer)
                   if inside(m, outer) and not any(inside(n, [m]) for n in needed))
    masks = [m for m in masks if not any(m != o and inside(m, [o]) for o in masks)]
    site = _site_folder(info, outer, masks)
    exposed: list[list[str]] = []
    if site is not None:
        for name in packages:
            for source in resolve(name) or ():
                exposed.append([source, os.path.basename(source)])
    return {"binds": [[binds[t], t] for t in outer], "files": files, "links": links,
            "devices": [d for d in DEVICES if os.path.exists(d)], "masks": masks, "site": site,
            "packages": exposed, "python": python}


# ---------------------------------------------------------------------------- the fallback: a masked view
def _searchable_by_others(path: str) -> bool:
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def _blocking_ancestor(path: str) -> str | None:
    """The top-most folder on ``path`` that others cannot enter (so a dropped uid cannot reach ``path``)."""
    parts = Path(path).parts
    for i in range(2, len(parts) + 1):
        folder = str(Path(*parts[:i]))
        if not _searchable_by_others(folder):
            return folder
    return None


def _interpreter_paths() -> list[str]:
    """The host interpreter's folders (the masked fallback view runs it: its virtual environment works there)."""
    paths = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix),
             os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(paths)


def isolation_view(sandbox_dir: str, root: bool) -> tuple[list[str], list[str], bool]:
    """(folders to mask with tmpfs, folders to bind back, whether a dropped uid reaches the interpreter and the
    sandbox folder without the masks)."""
    masks = {os.path.realpath(d) for d in WRITABLE_DIRS if os.path.isdir(d)}
    needed = [os.path.realpath(sandbox_dir)] + _interpreter_paths()
    visible = True
    if root:
        for path in needed:
            blocker = _blocking_ancestor(path)
            if blocker is not None:
                visible = False
                masks.add(blocker)
    outer = sorted(m for m in masks if not any(m != o and m.startswith(o + "/") for o in masks))
    keep = [p for p in needed if any(p == m or p.startswith(m + "/") for m in outer)]
    keep = sorted({p for p in keep if not any(p != o and p.startswith(o + "/") for o in keep)})
    return outer, keep, visible
