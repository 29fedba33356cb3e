"""The code sandbox's minimal root: what the program's file system is, built per run (standard library only).

:func:`build_root` runs in the sandbox's own mount namespace (the caller made every mount private) and makes
this, in a tmpfs mounted over the sandbox folder, then pivots into it and detaches the old root, in this order:

* the layout's ``links`` recreated as the same symbolic links (/bin -> usr/bin);
* /tmp and /dev/shm: private tmpfs (64 MiB, mode 1777) -- first, so that what is bound below them (an interpreter
  living in /tmp or /dev/shm) sits on top of them, not hidden under them;
* read-only (recursive binds, also nosuid and nodev): the ``binds`` of the layout -- the system's programs and
  libraries, the base interpreter's standard library and library folders -- and the single ``files``
  (/etc/ld.so.cache, the interpreter's executable);
* /dev: the layout's ``devices`` (null, zero, full, random, urandom) bound one by one, fd/stdin/stdout/stderr
  links into /proc/self;
* every folder of the layout's ``masks`` (Python package folders inside the binds) covered by an empty read-only
  tmpfs, except the ``site`` folder: a tmpfs holding only the layout's ``packages`` (each bound read-only), then
  made read-only itself;
* the sandbox folder at its own path: a tmpfs of ``disk_mb`` holding only the program (``workdir_options``
  give its owner);
* /proc: a new procfs of the caller's PID namespace when ``mount_proc`` (only that namespace's processes);
  where the kernel refuses it (an unprivileged user namespace under a /proc with masked parts) /proc stays an
  empty folder and the result says why;
* the root itself read-only; nothing else of the host (its home folders, /etc, /usr/local, /opt, /work, /var,
  /sys, other mounts) exists in it.

The layout is computed once per process by portrl.rewards.sandbox_layout.root_layout. A failure before the
pivot raises :class:`RootError` after detaching the half-built root, so the caller can fall back to the
sandbox folder as it was.
"""

import ctypes
import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_RELATIME = 0x400, 0x800, 0x1000, 0x4000, 0x200000
MNT_DETACH = 2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
# statvfs flags a read-only remount must repeat: inside a user namespace the kernel refuses to clear them
_LOCKED = ((os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
           (os.ST_RELATIME, MS_RELATIME))
DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
             ("stderr", "/proc/self/fd/2"))


class RootError(OSError):
    """The minimal root could not be built; the half-built one is gone and the old view is untouched."""


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _mount(libc, source, target: str, fstype, flags: int, data=None) -> None:
    b = os.fsencode
    if libc.mount(source and b(source), b(target), fstype and b(fstype), ctypes.c_ulong(flags),
                  data and b(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source or fstype or ''} on {target}: {os.strerror(err)}")


def _read_only(libc, path: str, setattr_nr: int | None) -> None:
    """Make the bind mount at ``path`` and the mounts below it read-only, nosuid, nodev."""
    if setattr_nr is not None:
        attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
        if libc.syscall(ctypes.c_long(setattr_nr), ctypes.c_int(AT_FDCWD), os.fsencode(path),
                        ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))) == 0:
            return
    # kernels before 5.12 (no mount_setattr): the top mount only
    flags = os.statvfs(path).f_flag
    locked = sum(ms for st, ms in _LOCKED if flags & st)
    _mount(libc, None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | locked)


def _tmpfs(libc, path: str, options: str, flags: int = 0) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)
    _mount(libc, "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | flags, options)


def _bind_file(libc, source: str, target: str) -> None:
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    _mount(libc, source, target, None, MS_BIND)


def _populate(libc, new: str, layout: dict, cwd: str, workdir_options: str, program: tuple[str, bytes],
              setattr_nr: int | None) -> None:
    for target, value in layout["links"]:
        os.makedirs(os.path.dirname(new + target), mode=0o755, exist_ok=True)
        os.symlink(value, new + target)
    # the private /tmp and /dev/shm first: what is bound below them (an interpreter in /tmp) goes on top of them
    _tmpfs(libc, new + "/dev/shm", "size=64m,mode=1777")
    _tmpfs(libc, new + "/tmp", "size=64m,mode=1777")
    for source, target in layout["binds"]:
        os.makedirs(new + target, mode=0o755, exist_ok=True)
        _mount(libc, source, new + target, None, MS_BIND | MS_REC)
        _read_only(libc, new + target, setattr_nr)
    for source, target in layout["files"]:
        _bind_file(libc, source, new + target)
        _read_only(libc, new + target, setattr_nr)
    for device in layout["devices"]:
        _bind_file(libc, device, new + device)
    for name, value in DEV_LINKS:
        os.symlink(value, f"{new}/dev/{name}")
    for path in layout["masks"]:  # Python package folders: empty (the site folder gets the exposed packages)
        if path != layout["site"]:
            _tmpfs(libc, new + path, "size=4k,nr_inodes=16,mode=0755", MS_RDONLY)
    if layout["site"] is not None:
        _exposed_packages(libc, new + layout["site"], layout["packages"], setattr_nr)
    _tmpfs(libc, new + cwd, workdir_options)
    name, code = program
    fd = os.open(f"{new}{cwd}/{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, code)
    finally:
        os.close(fd)
    os.makedirs(new + "/proc", mode=0o555, exist_ok=True)


def _exposed_packages(libc, site: str, packages: list, setattr_nr: int | None) -> None:
    """A tmpfs at ``site`` holding only the ``packages`` ([source, name]: a folder or a module file, bound
    read-only at ``site/name``), then read-only itself."""
    _tmpfs(libc, site, "size=64k,nr_inodes=256,mode=0755")
    for source, name in packages:
        target = f"{site}/{name}"
        if os.path.isdir(source):
            os.mkdir(target, 0o755)
            _mount(libc, source, target, None, MS_BIND | MS_REC)
        else:
            _bind_file(libc, source, target)
        _read_only(libc, target, setattr_nr)
    _mount(libc, None, site, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(libc, layout: dict, cwd: str, workdir_options: str, program: tuple[str, bytes], mount_proc: bool,
               pivot_nr: int, setattr_nr: int | None) -> dict:
    """Build the root (module docstring) at ``cwd``, pivot into it, and chdir to ``cwd`` inside it.
    ``program``: (file name, bytes) written into the new sandbox folder. Returns {"proc": bool, "proc_error"?}."""
    old_umask = os.umask(0o022)  # folders made on the way must be enterable by the sandbox uid
    try:
        try:
            _mount(libc, "tmpfs", cwd, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        except OSError as exc:
            raise RootError(exc.errno, str(exc)) from None
        try:
            _populate(libc, cwd, layout, cwd, workdir_options, program, setattr_nr)
            report: dict[str, bool | str | None] = {"proc": False}
            if mount_proc:
                try:
                    _mount(libc, "proc", cwd + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                    report["proc"] = True
                except OSError as exc:
                    report["proc_error"] = exc.strerror
            _mount(libc, None, cwd, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            os.chdir(cwd)
            if libc.syscall(ctypes.c_long(pivot_nr), b".", b".") != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"pivot_root: {os.strerror(err)}")
        except OSError as exc:
            os.chdir("/")
            libc.umount2(os.fsencode(cwd), MNT_DETACH)
            raise RootError(exc.errno, str(exc)) from None
        # the old root now sits on top of the new one at "/": detach it (after the pivot nothing is left to undo)
        if libc.umount2(b".", MNT_DETACH) != 0:
            raise OSError(ctypes.get_errno(), "detach the old root")
        os.chdir(cwd)
        return report
    finally:
        os.umask(old_umask)
