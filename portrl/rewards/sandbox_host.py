"""Host-side bookkeeping of the code sandbox (portrl/rewards/sandbox.py runs the programs).

* :class:`UidSlot` (root only): a sandbox uid from ``UID_BASE`` that no other run of any process uses now,
  reserved by an exclusive lock file in /run/portrl-sandbox-uids; a uid with processes or an account is skipped.
* the process table read from /proc: :func:`live_processes` of a process group or a uid, :func:`user_task_count`
  (what RLIMIT_NPROC counts for a non-root user);
* cleanup after a run: :func:`kill_uid` and :func:`kill_group` SIGKILL until nothing of the run is left;
* the interpreter the sandbox runs: :func:`base_executable` (the real executable behind a virtual environment's
  launcher) and :func:`interpreter_info` (its standard library, library folders and site folders, learnt once per
  process by running it with ``-I -S``);
* :func:`root_layout`: what the minimal root (portrl/rewards/sandbox_root.py) holds -- the system's programs and
  libraries (``SYSTEM_DIRS``), three files, the base interpreter with its standard library and library folders,
  five devices; every Python package folder inside those masked, and the packages a program may import bound into
  the interpreter's site folder -- computed once per process and package list;
* :func:`exposed_packages`: which top-level import names a sandboxed program can import (found here without
  importing them: importlib.util.find_spec; bound with their auditwheel library folder, numpy.libs);
* :func:`isolation_view`: the fallback where that root cannot be built: the folders the child masks with tmpfs in
  its mount namespace (``WRITABLE_DIRS`` and, as root, folders a dropped uid cannot enter) and the paths it binds
  back (the sandbox folder, this process's interpreter).
"""

from __future__ import annotations

import fcntl
import functools
import glob
import importlib.util
import json
import keyword
import logging
import os
import pwd
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

log = logging.getLogger("portrl.rewards.sandbox")  # the sandbox's warnings keep one logger name

UID_BASE = 64200  # sandbox uids UID_BASE .. UID_BASE + UID_COUNT - 1 (root only; Debian leaves 60000-64999 free)
UID_COUNT = 256
WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# the system's programs and shared libraries: a folder is bound, a link copied; /etc/alternatives holds the links
# of Debian tools (/usr/bin/awk -> ...); the time zones for zoneinfo and /etc/localtime
SYSTEM_DIRS = ("/bin", "/lib", "/lib32", "/lib64", "/libx32", "/usr/bin", "/usr/lib", "/usr/lib32", "/usr/lib64",
               "/usr/libx32", "/usr/libexec", "/etc/alternatives", "/usr/share/zoneinfo")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")  # the loader's library index; the local time zone
DEFAULT_PACKAGES = ("numpy",)  # what a sandboxed program may import besides the standard library, by default
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


class SandboxError(RuntimeError):
    """The sandbox itself could not start a program (not the program's fault): the message says why."""


# ------------------------------------------------------------------------------------------- uid slots
def uid_lock_path(uid: int) -> Path:
    """The lock file whose exclusive holder is the one run using sandbox ``uid`` (the folder is created)."""
    # one place for every process of the machine (not TMPDIR, which differs between processes)
    lock_dir = Path("/run" if os.path.isdir("/run") else tempfile.gettempdir()) / "portrl-sandbox-uids"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    return lock_dir / str(uid)


class UidSlot:
    """A sandbox uid no other run (in any process) uses now, held by an exclusive lock file; root only."""

    def __init__(self):
        busy = _uids_with_tasks()
        for uid in range(UID_BASE, UID_BASE + UID_COUNT):
            # a uid with processes (a leftover zombie would count against RLIMIT_NPROC) or an account (its files
            # would be the program's, and its processes are killed after the run) is never used
            if uid in busy or _is_account(uid):
                continue
            fd = os.open(uid_lock_path(uid), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise SandboxError(f"all {UID_COUNT} sandbox uids from {UID_BASE} are in use; lower the number of "
                           "concurrent sandbox runs (reward.code.max_workers x reward workers)")

    def release(self) -> None:
        os.close(self._fd)  # drops the lock


def _is_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def _proc_tasks() -> Iterable[tuple[int, int, int, str]]:
    """(pid, uid, process group, state letter) of every process visible in /proc (none without /proc)."""
    for name in (os.listdir("/proc") if os.path.isdir("/proc") else ()):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat_line = f.read().decode(errors="replace")
            uid = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue
        fields = stat_line[stat_line.rfind(")") + 2:].split()  # after "pid (comm) "
        yield int(name), uid, int(fields[2]), fields[0]


def _uids_with_tasks() -> set[int]:
    return {uid for _, uid, _, _ in _proc_tasks()}


def live_processes(pgid: int | None = None, uid: int | None = None) -> list[int]:
    """Pids of the processes (not zombies) in process group ``pgid`` or owned by ``uid``."""
    return [pid for pid, u, g, state in _proc_tasks()
            if state != "Z" and ((pgid is not None and g == pgid) or (uid is not None and u == uid))]


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left (a fork bomb refills; NPROC bounds it)."""
    for _ in range(100):
        pids = live_processes(uid=uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    log.warning("sandbox uid %d still has processes after repeated SIGKILL", uid)


def user_task_count() -> int:
    """Threads of the calling user (what RLIMIT_NPROC counts for a non-root user)."""
    me, count = os.getuid(), 0
    for pid, uid, _, state in _proc_tasks():
        if uid == me:
            try:
                count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return count


# ------------------------------------------------------------------------------------------ isolation view
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


def _inside(path: str, folders) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def base_executable() -> str:
    """The real path of the base interpreter (not a virtual environment's launcher): what the sandbox runs."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


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


def _real_dirs(paths) -> list[str]:
    return [os.path.realpath(p) for p in paths if p and os.path.isdir(p)]


def _stdlib_dirs(info: dict) -> list[str]:
    """The folders of the standard library (stdlib, platstdlib, lib-dynload: sys.path without site)."""
    return sorted(set(_real_dirs(info["stdlib_path"] + [info["stdlib"], info["platstdlib"]])))


def _package_folder_candidates(info: dict, folders: list[str]) -> set[str]:
    """Every Python package folder the interpreter knows of (its sys.path entries besides the standard library, its
    site folders) and every site-packages / dist-packages folder directly below the bound ``folders``."""
    stdlib = set(_stdlib_dirs(info))
    found = {p for p in _real_dirs(info["path"] + info["site"]) if p not in stdlib}
    for folder in folders:
        for pattern in ("site-packages", "dist-packages", "python*/site-packages", "python*/dist-packages",
                        "lib/python*/site-packages"):
            found.update(_real_dirs(glob.glob(os.path.join(glob.escape(folder), pattern))))
    return found


def _site_folder(info: dict, binds: list[str], masks: list[str]) -> str | None:
    """Where the exposed packages go: the first of the interpreter's site folders that is masked (it exists) or
    lies outside every bound folder (it can be made in the root); None when neither (a site folder missing inside
    a bound folder has nowhere to be mounted)."""
    for path in info["site"]:
        real = os.path.realpath(path)
        if real in masks or not _inside(real, binds):
            return real
    return None


@functools.lru_cache(maxsize=64)
def _resolve(name: str) -> tuple[str, ...] | None:
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
    if _inside(path, _stdlib_dirs(interpreter_info())):
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
    import importlib.metadata  # noqa: PLC0415 - only for a package whose .libs folder is named differently

    return importlib.metadata.packages_distributions()


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
        where = _resolve(name)
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
    stdlib = _stdlib_dirs(info)
    libdirs = _real_dirs([info["libdir"]] + [os.path.dirname(lib) for lib in info["libs"] if os.path.isfile(lib)])
    for path in stdlib + libdirs:
        if path != "/" and not _inside(path, linked):
            binds.setdefault(path, path)
    outer = sorted(t for t in binds if not any(t != o and _inside(t, [o]) for o in binds))
    if not _inside(python, outer):
        files.append([python, python])
    files = [[s, t] for s, t in files if not _inside(t, outer)]
    needed = [python] + stdlib + libdirs + [b for b in outer if b in SYSTEM_DIRS]
    masks = sorted(m for m in _package_folder_candidates(info, outer)
                   if _inside(m, outer) and not any(_inside(n, [m]) for n in needed))
    masks = [m for m in masks if not any(m != o and _inside(m, [o]) for o in masks)]
    site = _site_folder(info, outer, masks)
    exposed: list[list[str]] = []
    if site is not None:
        for name in packages:
            for source in _resolve(name) or ():
                exposed.append([source, os.path.basename(source)])
    return {"binds": [[binds[t], t] for t in outer], "files": files, "links": links,
            "devices": [d for d in DEVICES if os.path.exists(d)], "masks": masks, "site": site,
            "packages": exposed, "python": python}


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


def kill_group(pgid: int) -> None:
    """SIGKILL the process group until none of it is left (killed processes take a moment to go)."""
    for _ in range(200):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if not live_processes(pgid=pgid):
            return
        time.sleep(0.01)
    log.warning("sandbox process group %d still has processes after repeated SIGKILL", pgid)
