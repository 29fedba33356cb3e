"""Build a C++ source of this folder into a library of torch ops, once per machine, and load it.

The source is compiled by the host's C++ compiler (``$CXX``, else ``g++`` or ``c++``) against the running
torch's headers and libraries, with OpenMP, for an instruction-set variant (:data:`ISA_FLAGS`: ``avx512`` for this
CPU, ``-march=native``; ``avx2``, ``-mavx2 -mfma``, which any AVX2 + FMA CPU runs; none, the plain library, for this
CPU; backends/cpu/isa.py chooses which runs). Each variant is its own library, cached under its own name, and its
ops are registered in their own namespace (``portrl_cpu_rows_avx2``...), so both variants load into one process
(the tests and benchmarks/rows_kernel_isa.py compare them). OpenMP:  (torch's ``at::parallel_for``
then runs on torch's own intra-op threads: the library's ``libgomp.so.1`` is the one torch already loaded).
The library is cached in :func:`cache_root` (default ``~/.cache/portrl/kernels``) under a name hashed
from the source and the headers of this folder it includes (:func:`source_text`), the variant's flags, torch's
version and the CPU's model and flags, so later processes (Ray workers, the next run) load it in milliseconds, and
a cache folder shared with a different CPU never serves a library built for another instruction set. It is compiled
to a temporary name and renamed: a concurrent or interrupted build never leaves a half-written library under the
final name.

Only what this user built is loaded. Beside each library, a manifest (``<library>.json``, written under a
temporary name and renamed) records the sha256 of the bytes the build produced. A cached library is loaded
only when it is a regular file (not a symlink) owned by this user and writable by no one else, so is its
manifest, and the manifest names it and its sha256; else it is built again. The bytes are hashed and loaded
through one descriptor (``/proc/self/fd``, kept open), so what is loaded is what was checked. The cache folder must
belong to this user and be writable by no one else (portrl creates it so, mode 0700); a folder that does not
(group- or world-writable, another user's), or a folder above it that another user owns or anyone may write
without the sticky bit, is refused: no library is built or loaded there, and the callers' fallback serves
with one warning that names the folder and the fix (``chmod go-w``, or ``PORTRL_KERNEL_CACHE`` elsewhere).
Building elsewhere instead would cost every process its own ~10 s build, unannounced.

The C++ standard is the one the installed torch builds its own extensions with (:func:`cxx_standard`, read from
``torch.utils.cpp_extension``: ``-std=c++20`` on torch 2.13 and later), so a torch whose headers need a newer
standard does not meet flags written for an older one. Compiling takes about 10 s a library on 2 cores (a minute or
two for all of a decode step's); a process's first build says so in one line on stderr (:func:`_announce`).
:class:`KernelBuildError` (one line: the compiler's first error) is raised when there is no compiler, the build
fails or the cache folder is refused; :func:`try_load` turns it into one warning that names the reason and what
serves instead (the whole compiler output is logged at DEBUG level only).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import re
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from .toolchain import compiler, first_error  # shared with the doctor, which must not import torch

SOURCE_DIR = Path(__file__).resolve().parent
# Not here: the -std flag (the installed torch's: cxx_standard, in flags()) and the instruction set (ISA_FLAGS).
# -Wfatal-errors: a build that cannot work (headers that need a newer standard) stops at its first error, at once
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-w", "-Wfatal-errors")
#: the instruction-set flags of each variant (None: a library with no variant, for this CPU: the counting allocator;
#: a kernel source built so registers its ops in the plain namespace, portrl_cpu_swiglu). CPU_CAPABILITY_*:
#: at::vec::Vectorized<float> is 16 (AVX512) or 8 (AVX2) lanes wide, its exp Sleef's (in libtorch_cpu);
#: PORTRL_ISA names the variant's op namespace (portrl_cpu_rows_avx2...). The AVX2 variant is not -march=native:
#: it builds and runs on an AVX-512 CPU too, so such a host tests it.
ISA_FLAGS: dict[str | None, tuple[str, ...]] = {
    None: ("-march=native",),
    "avx512": ("-march=native", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-DPORTRL_ISA=avx512"),
    "avx2": ("-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-DPORTRL_ISA=avx2")}
#: what serves when a library cannot be built, for the one warning of try_load
FALLBACKS = {"rows_linear": "the decode linear takes MKL's packed matmul",
             "swiglu": "SwiGLU takes torch's ops",
             "rms_norm": "RMSNorm takes torch's ops",
             "rotary": "the rotary embedding takes torch's ops",
             "decode_attention": "the decode step's attention takes torch's ops",
             "decode_layer": "the decode step's layers take one op at a time",
             "counting_allocator": "no per-phase tensor memory (memory/peak_gib) is logged"}

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, Path] = {}
_failed: dict[str, str] = {}
_held: dict[str, int] = {}  # the open descriptor each loaded library was loaded through
_announced = False  # this process's first build said so on stderr (_announce)


class KernelBuildError(RuntimeError):
    """A native kernel library could not be built or loaded here."""


def cxx_standard() -> str | None:
    """The C++ standard (``"c++20"``) the installed torch's ``torch.utils.cpp_extension`` compiles extensions with:
    the newest ``-std=c++NN`` its source passes (torch states it there, not in an API), so the flags follow the
    torch the headers come from. None when its source cannot be read or names none: the compiler's default."""
    found = re.findall(r"-std=c\+\+(\d+)\b", _cpp_extension_source() or "")
    return f"c++{max(found, key=int)}" if found else None


def _cpp_extension_source() -> str | None:
    """The text of ``torch/utils/cpp_extension.py``, read without importing it (that takes ~0.3 s: setuptools)."""
    spec = importlib.util.find_spec("torch.utils.cpp_extension")
    if spec is None or not spec.origin:
        return None
    try:
        return Path(spec.origin).read_text()
    except (OSError, UnicodeDecodeError):  # installed without its .py sources
        return None


def flags(variant: str | None = None) -> tuple[str, ...]:
    """The compiler flags of a library of ``variant`` (:data:`ISA_FLAGS`): :data:`FLAGS`, the variant's and torch's
    C++ standard (:func:`cxx_standard`)."""
    std = cxx_standard()
    return (*FLAGS, *ISA_FLAGS[variant], *((f"-std={std}",) if std else ()))


def ops_namespace(name: str, variant: str) -> str:
    """The torch.ops namespace of library ``name``'s ``variant``: ``portrl_cpu_rows_avx2`` for rows_linear."""
    return {"rows_linear": "portrl_cpu_rows", "swiglu": "portrl_cpu_swiglu", "rms_norm": "portrl_cpu_rms_norm",
            "rotary": "portrl_cpu_rotary",
            "decode_attention": "portrl_cpu_decode_attention",
            "decode_layer": "portrl_cpu_decode_layer"}[name] + f"_{variant}"


def _key(name: str, variant: str | None) -> str:
    """How ``_loaded`` / ``_failed`` name a library's variant (and how a warning does): ``rows_linear[avx2]``."""
    return f"{name}[{variant}]" if variant else name


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


def _command(cxx: str, source: Path, output: Path, variant: str | None = None) -> list[str]:
    from torch.utils import cpp_extension  # noqa: PLC0415  (torch: the doctor runs without it)

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *flags(variant), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), str(source), "-o", str(output),
            *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]


def library_path(name: str, variant: str | None = None) -> Path:
    """Where ``name``'s library of ``variant`` for this source, torch and CPU is (or will be) cached
    (``rows_linear-avx2-<hash>.so``; ``<name>-<hash>.so`` without a variant)."""
    cxx = compiler() or ""
    text = source_text(SOURCE_DIR / f"{name}.cpp")
    key = hashlib.sha256("\n".join([text, " ".join(flags(variant)), torch.__version__, cxx,
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    return cache_root() / (f"{name}-{variant}-{key}.so" if variant else f"{name}-{key}.so")


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def source_text(source: Path) -> str:
    """``source``'s text followed by that of each header of its folder it includes (``#include "x.h"``, and theirs,
    each once): what its library is built from, so that editing a shared header builds the library again."""
    texts, seen, todo = [], set(), [source]
    while todo:
        path = todo.pop(0)
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        text = path.read_text()
        texts.append(text)
        todo.extend(source.parent / name for name in _LOCAL_INCLUDE.findall(text))
    return "\n".join(texts)


def manifest_path(library: Path) -> Path:
    """The manifest beside ``library``: its name and the sha256 of the bytes its build produced."""
    return library.with_name(library.name + ".json")


def load(name: str, variant: str | None = None) -> Path:
    """Build (unless a library its manifest vouches for is cached) and load ``backends/cpu/{name}.cpp``'s ops, of
    the instruction-set ``variant`` (:data:`ISA_FLAGS`), into this process; idempotent. Returns the library's
    path. Raises :class:`KernelBuildError` when it cannot be built or loaded, or the cache folder is refused
    (:func:`folder_problem`). The caller checks that this CPU runs ``variant`` (backends/cpu/isa.py)."""
    with _lock:
        if _key(name, variant) in _loaded:
            return _loaded[_key(name, variant)]
        cxx = compiler()
        if cxx is None:
            raise KernelBuildError("no C++ compiler found (install g++ or set CXX)")
        path = library_path(name, variant)
        _private_folder(path.parent)
        fd = _open_vouched(path)
        if fd is None:
            _announce(path.parent)
            fd = _build(cxx, SOURCE_DIR / f"{name}.cpp", path, variant)
        try:
            _load_open(fd, path)
        except BaseException:
            os.close(fd)
            raise
        _held[_key(name, variant)] = fd  # kept open: see _load_open
        _loaded[_key(name, variant)] = path
        return path


def _announce(folder: Path) -> None:
    """One line on stderr before this process's first build, which is otherwise silent for a minute or two (every
    kernel of a decode step, ~10 s each on 2 cores): what is happening and that it happens once. A process that
    finds its libraries cached says nothing."""
    global _announced
    if not _announced:
        _announced = True
        print(f"portrl: compiling the CPU kernels for this machine (once; cached in {folder})", file=sys.stderr,
              flush=True)


def try_load(name: str, variant: str | None = None) -> bool:
    """:func:`load`, or False when the library cannot be built or loaded here: the first failure per library is
    one line (the reason, and what serves instead), later calls return False at once. It is a warning, unless an
    earlier library of this process failed for the same reason (no compiler, a compiler that fails alike): then
    it is an info line, so one cause warns once."""
    key = _key(name, variant)
    if key in _failed:
        return False
    try:
        load(name, variant)
        return True
    except KernelBuildError as exc:
        reason = " ".join(str(exc).split())  # one line, whatever the message holds
        cause = reason.replace(f"{name}.cpp", "*.cpp")
        seen = any(r.replace(f"{k.split('[')[0]}.cpp", "*.cpp") == cause for k, r in _failed.items())
        _failed[key] = reason
        log.log(logging.INFO if seen else logging.WARNING, "the native CPU kernels of backends/cpu/%s.cpp are off "
                "(%s); instead, %s", name, "the same reason" if seen else reason,
                FALLBACKS.get(name, "the next implementation serves"))
        return False


def folder_problem(folder: Path) -> str:
    """Why libraries in ``folder`` must not be loaded ("" when they may): it must be a folder of this user that
    no one else can write; every folder above it must belong to this user or root and, if anyone else may write
    it, have the sticky bit (as /tmp has). Symlinks on the way are followed: the real folders are checked."""
    uid = os.getuid()
    real = Path(os.path.realpath(folder))
    try:
        st = os.stat(real)
    except OSError as exc:
        return f"cannot read it ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{real} is not a folder"
    if st.st_uid != uid:
        return f"{real} belongs to uid {st.st_uid}, not to this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"{real} is writable by {_writers(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):o})"
    for parent in real.parents:
        st = os.stat(parent)
        if st.st_uid not in (uid, 0):
            return f"{parent}, above it, belongs to uid {st.st_uid}"
        if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            return f"{parent}, above it, is writable by anyone and not sticky (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def _writers(mode: int) -> str:
    return " and ".join(w for bit, w in ((0o020, "its group"), (0o002, "anyone")) if mode & bit)


def _private_folder(folder: Path) -> None:
    """Create ``folder`` for this user only (0700) when missing; raise :class:`KernelBuildError` when it is
    refused (:func:`folder_problem`)."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelBuildError(f"cannot create the kernel cache {folder}: {exc}") from exc
    why = folder_problem(folder)
    if why:
        raise KernelBuildError(f"the kernel cache {folder} is refused: {why}; run chmod go-w on it, or set "
                               "PORTRL_KERNEL_CACHE to a folder only you can write")


def _own_file(fd: int) -> bool:
    """A regular file of this user that no one else can write."""
    st = os.fstat(fd)
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _open_checked(path: Path) -> int | None:
    """``path`` opened for reading, not through a symlink, when it is :func:`_own_file`; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # missing, or a symlink (ELOOP)
        return None
    if _own_file(fd):
        return fd
    os.close(fd)
    return None


def _sha256(fd: int) -> str:
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _open_vouched(path: Path) -> int | None:
    """An open descriptor of the cached library ``path`` when its manifest vouches for it (both checked files;
    the manifest names it and the sha256 of its bytes); None when it must be built (again)."""
    fd = _open_checked(path)
    if fd is None:
        if os.path.lexists(path):
            log.info("%s is a symlink, or not this user's alone; building it again", path)
        return None
    mfd = _open_checked(manifest_path(path))
    try:
        record = json.loads(os.read(mfd, 1 << 16)) if mfd is not None else None
    except ValueError:
        record = None
    finally:
        if mfd is not None:
            os.close(mfd)
    if isinstance(record, dict) and record.get("library") == path.name and record.get("sha256") == _sha256(fd):
        return fd
    os.close(fd)
    log.info("%s has no manifest that vouches for it; building it again", path)
    return None


def _write_manifest(path: Path, digest: str) -> None:
    """``path``'s manifest, written under a temporary name and renamed: never half-written under its name."""
    target = manifest_path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"library": path.name, "sha256": digest}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_open(fd: int, path: Path) -> None:
    """Load the library open as ``fd`` into this process (its static initialisers register the ops): through
    ``/proc/self/fd``, the bytes that were checked, whatever ``path`` names by now; by ``path`` where there is
    no /proc. The caller keeps ``fd`` open for good: the dynamic loader takes a name it has loaded before for
    that library, so a later library opened under the same descriptor number would not be loaded at all."""
    target = f"/proc/self/fd/{fd}"
    if not os.path.exists(target):
        target = str(path)
    try:
        ctypes.CDLL(target)  # what torch.ops.load_library does, without resolving the descriptor back to a path
    except OSError as exc:
        raise KernelBuildError(f"cannot load {path}: {exc}") from exc
    torch.ops.loaded_libraries.add(str(path))


def _build(cxx: str, source: Path, path: Path, variant: str | None = None) -> int:
    """Compile ``source`` to ``path`` and record its sha256 in the manifest beside it. Returns a descriptor open
    on the bytes built (the caller closes it)."""
    _private_folder(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        # no variant: the 3-argument call (tests/test_native_cache_trust.py's fake compiler command takes those)
        command = _command(cxx, source, Path(tmp), variant) if variant else _command(cxx, source, Path(tmp))
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            output = (done.stderr or done.stdout or "").strip()
            log.debug("%s\n%s", " ".join(command), output)
            std = next((f for f in command if f.startswith("-std=")), "the compiler's default standard")
            raise KernelBuildError(f"building {source.name} failed ({Path(cxx).name} {std}, exit "
                                   f"{done.returncode}): {first_error(output)}")
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o755)  # the linker's mode follows the umask: no one else may write what is loaded
            digest = _sha256(fd)
            os.replace(tmp, path)
            _write_manifest(path, digest)
        except BaseException:
            os.close(fd)
            raise
        return fd
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"building {source.name} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
