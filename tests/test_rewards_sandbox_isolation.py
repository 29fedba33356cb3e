"""The code sandbox's isolation (portrl.rewards.sandbox): what a program may see and do on this machine.

A policy that learns to read its answers (the checkout, the training parquet with its ground truths) or to
tamper with the reward process is reward hacking; these tests run real programs that try. Where the platform
cannot give a part (no namespaces in a container, no seccomp), the test that needs it is skipped with the
reason, except :func:`test_every_part_applies_where_the_platform_allows`, which fails when a part the kernel
offers did not apply.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

import portrl.rewards.sandbox as sandbox
from portrl.rewards.sandbox import RunResult, SandboxLimits, SandboxUnisolated, run_program
from portrl.rewards.sandbox_host import WRITABLE_DIRS, base_executable, root_layout
from portrl.rewards.sandbox_seccomp import DENIED
from portrl.rewards.sandbox_syscalls import native, table

REPO = Path(__file__).resolve().parents[1]
FAST = SandboxLimits(timeout_s=5.0, memory_mb=256, allow_unisolated=True)  # the probe, and tests that skip parts


@pytest.fixture(scope="module")
def isolation() -> RunResult:
    return run_program("print('probe')", "", FAST)


def _need(isolation: RunResult, *parts: str) -> None:
    missing = [p for p in parts if not getattr(isolation, p)]
    if missing:
        pytest.skip(f"this platform does not give {missing}: {isolation.details}")


def _seccomp_available() -> bool:
    with open("/proc/self/status") as f:
        return native() is not None and "\nSeccomp:" in f.read()


def _namespaces_allowed() -> bool:
    """Whether this process may make the namespaces the sandbox asks for (root; in a child process)."""
    flags = 0x00020000 | 0x08000000 | 0x20000000 | 0x40000000  # NEWNS NEWIPC NEWPID NEWNET
    probe = f"import ctypes, sys\nsys.exit(ctypes.CDLL(None).unshare({flags}) != 0)"
    return os.geteuid() == 0 and subprocess.run([sys.executable, "-I", "-c", probe]).returncode == 0


def test_every_part_applies_where_the_platform_allows():
    if not (sys.platform == "linux" and _seccomp_available() and _namespaces_allowed()):
        pytest.skip("not root, or this platform refuses new namespaces or seccomp (the sandbox then degrades, "
                    "with warnings)")
    r = run_program("print('probe')", "", replace(FAST, allow_unisolated=False))  # SandboxUnisolated: a part is off
    assert r.status == "ok", r.stderr
    applied = {p: getattr(r, p) for p in ("network_isolated", "mount_isolated", "pid_isolated", "root_isolated",
                                          "seccomp_filtered", "uid_dropped")}
    assert all(applied.values()), (applied, r.details)


@pytest.fixture
def training_data():
    """A training parquet with its ground truths where runs keep their files: in the checkout (outputs/ is
    ignored by git), world-readable like everything a user's checkout holds."""
    outputs_existed = (REPO / "outputs").exists()
    folder = REPO / "outputs" / f"sandbox-test-{uuid.uuid4().hex}"
    folder.mkdir(parents=True)
    secret = f"ground-truth-{uuid.uuid4().hex}"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "train.parquet"
        pq.write_table(pa.table({"prompt": ["add 2 and 3"], "ground_truth": [secret]}), path)
        os.chmod(folder, 0o755)
        os.chmod(path, 0o644)
        yield path, secret
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if not outputs_existed:
            try:
                (REPO / "outputs").rmdir()  # only when empty: a run may have started writing there meanwhile
            except OSError:
                pass


def test_program_cannot_read_the_checkout_or_the_training_data(isolation, training_data):
    _need(isolation, "root_isolated")
    parquet, secret = training_data
    targets = [str(REPO / "README.md"), str(parquet), str(Path(__file__).resolve())]
    src = textwrap.dedent(f"""
        import os
        for path in {targets!r}:
            try:
                print('read', path, open(path, 'rb').read()[-200:])
            except OSError as exc:
                print('refused', path, type(exc).__name__)
        for folder in {[str(REPO), str(parquet.parent)]!r}:
            try:
                print('listed', folder, sorted(os.listdir(folder)))
            except OSError as exc:
                print('refused', folder, type(exc).__name__)
    """)
    r = run_program(src, "", FAST)
    assert r.status == "ok", r.stderr
    assert secret not in r.stdout
    for path in targets + [str(REPO), str(parquet.parent)]:  # the checkout's folder does not exist in there
        assert f"refused {path} " in r.stdout, r.stdout


def test_program_sees_a_minimal_read_only_root(isolation):
    _need(isolation, "root_isolated")
    src = textwrap.dedent("""
        import os, sys
        print(sorted(os.listdir('/')))
        print(sorted(os.listdir('/etc')))
        for path in ('/usr/portrl-escape', '/portrl-escape', sys.prefix + '/portrl-escape'):
            try:
                open(path, 'w')
                print('wrote', path)
            except OSError as exc:
                print('refused', path, exc.strerror)
        open('scratch.txt', 'w').write('own folder')  # its own folder stays writable
        print(open('scratch.txt').read())
    """)
    r = run_program(src, "", FAST)
    assert r.status == "ok", r.stderr
    top, etc, *writes, own = r.stdout.splitlines()
    # the way to the base interpreter (/root of /root/.pyenv) and to the sandbox folder; not the virtual environment
    ways = {Path(os.path.realpath(p)).parts[1] for p in (base_executable(), tempfile.gettempdir())}
    system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "tmp", "usr"}
    assert set(ast.literal_eval(top)) <= system | ways  # no home, /work, /var, /opt, /mnt, /sys, ...
    assert set(ast.literal_eval(etc)) <= {"alternatives", "ld.so.cache", "localtime"}  # no passwd, hosts, ssh keys
    assert all(w.startswith("refused") for w in writes), writes
    assert own == "own folder"


def test_program_sees_only_its_own_processes(isolation):
    _need(isolation, "pid_isolated")
    host_pid = os.getpid()
    src = textwrap.dedent(f"""
        import os, signal
        print(os.getpid(), os.getppid())
        print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
        for pid, sig in (({host_pid}, 0), (os.getppid(), signal.SIGKILL)):
            try:
                os.kill(pid, sig)
                print('signalled', pid)
            except OSError as exc:
                print('refused', pid, type(exc).__name__)
        print('alive')
    """)
    r = run_program(src, "", FAST)
    assert r.status == "ok", r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "2 1"  # the program is pid 2, the namespace's init pid 1
    assert lines[1] == "[1, 2]"  # no process of the machine is visible
    assert lines[2] == f"refused {host_pid} ProcessLookupError"  # the reward process does not exist in here
    if isolation.uid_dropped:  # init is root's: the sandbox uid may not signal it
        assert lines[3] == "refused 1 PermissionError"
    assert lines[-1] == "alive"


def test_init_and_the_program_show_nothing_of_the_host(isolation):
    """The namespace's init (the launcher's fork) was started as ``python <checkout>/sandbox_child.py <settings>``:
    its command line named the checkout, the host's pid and the root's layout. Now it is started from a pipe."""
    _need(isolation, "pid_isolated")
    files = ["/proc/1/cmdline", "/proc/1/environ", "/proc/self/cmdline", "/proc/self/environ", "/proc/1/status",
             "/proc/self/status"]
    src = textwrap.dedent(f"""
        for path in {files!r}:
            try:
                print(path, repr(open(path, 'rb').read()))
            except OSError as exc:
                print(path, 'refused', type(exc).__name__)
    """)
    r = run_program(src, "", FAST)
    assert r.status == "ok", r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert set(lines) == set(files), r.stdout
    assert lines["/proc/1/cmdline"].startswith("b"), r.stdout  # readable, as documented
    for path, text in lines.items():
        for secret in (str(REPO), "sandbox_child.py", "binds", "parent_pid", os.path.realpath(sys.prefix)):
            assert secret not in text, (path, secret, text)
        if path.endswith(("cmdline", "environ")):
            assert not re.search(rf"\b{os.getpid()}\b", text), (path, text)


def test_ptrace_namespaces_and_mounts_are_refused(isolation):
    _need(isolation, "seccomp_filtered")
    src = textwrap.dedent("""
        import ctypes, os, subprocess, sys, threading
        libc = ctypes.CDLL(None, use_errno=True)
        def attempt(name, *args):
            result = getattr(libc, name)(*args)
            print(name, result, os.strerror(ctypes.get_errno()) if result == -1 else '')
        attempt('ptrace', 0, 0, None, None)  # PTRACE_TRACEME
        attempt('ptrace', 16, os.getppid(), None, None)  # PTRACE_ATTACH
        attempt('unshare', 0x10000000)  # CLONE_NEWUSER: unprivileged, so only the filter refuses it
        attempt('mount', b'none', b'/tmp', b'tmpfs', 0, None)
        attempt('process_vm_readv', os.getppid(), None, 0, None, 0, 0)
        # what programs need still works: threads (clone3 -> ENOSYS -> clone), fork, subprocesses
        t = threading.Thread(target=print, args=('thread ok',))
        t.start(); t.join()
        print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout.strip())
    """)
    r = run_program(src, "", FAST)
    assert r.status == "ok", r.stderr
    lines = r.stdout.splitlines()
    assert lines[:5] == [f"{name} -1 Operation not permitted"
                         for name in ("ptrace", "ptrace", "unshare", "mount", "process_vm_readv")], lines
    assert lines[5:] == ["thread ok", "42"]


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the x32 ABI exists on x86_64 only")
def test_syscall_of_another_abi_kills_the_program(isolation):
    _need(isolation, "seccomp_filtered")
    r = run_program("import ctypes\nctypes.CDLL(None).syscall(0x40000000 | 39)\nprint('survived')\n", "", FAST)
    assert r.returncode == -signal.SIGSYS and "survived" not in r.stdout, r
    assert r.status == "runtime_error"


def _header_numbers(path: str) -> dict[str, int]:
    text = Path(path).read_text()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", text)}


@pytest.mark.parametrize("arch, header", [("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
                                          ("aarch64", "/usr/include/asm-generic/unistd.h")])
def test_syscall_table_matches_the_kernel_headers(arch, header):
    if not os.path.exists(header):
        pytest.skip(f"no {header} here (linux-libc-dev)")
    numbers, kernel = table(arch), _header_numbers(header)
    assert {name: kernel.get(name) for name in numbers} == numbers
    missing = set(DENIED) - set(numbers)
    assert missing <= ({"iopl", "ioperm"} if arch == "aarch64" else set())


def _blocking_ancestor(path: str) -> str | None:
    parts = Path(path).parts
    for i in range(2, len(parts) + 1):
        folder = str(Path(*parts[:i]))
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def _reachable_by_others(paths: list[str]) -> str:
    """Shell commands that, in a private mount namespace, make ``paths`` reachable by every uid: each path under
    a folder others cannot enter is bound aside, a tmpfs covers that folder, and the path is moved back."""
    paths = sorted({os.path.realpath(p) for p in paths})
    paths = [p for p in paths if not any(p != o and p.startswith(o + "/") for o in paths)]
    hidden = [(shlex.quote(p), b) for p in paths if (b := _blocking_ancestor(p)) is not None]
    save = "".join(f"d{i}=$(mktemp -d); mount --bind {p} $d{i}; " for i, (p, _) in enumerate(hidden))
    cover = "".join(f"mount -t tmpfs tmpfs {shlex.quote(b)}; " for b in sorted({b for _, b in hidden}))
    back = "".join(f"mkdir -p {p}; mount --move $d{i} {p}; " for i, (p, _) in enumerate(hidden))
    return save + cover + back


def test_an_unprivileged_user_gets_the_same_isolation():
    """The non-root path (a user namespace with an identity map), run as uid 65534 by setpriv."""
    if os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("unshare") and shutil.which("mount")):
        pytest.skip("needs root to start a process as another user (setpriv, unshare, mount from util-linux)")
    if Path("/proc/sys/user/max_user_namespaces").read_text().strip() == "0":
        pytest.skip("user namespaces are off on this kernel")
    probe = textwrap.dedent(f"""
        import json, sys
        from portrl.rewards.sandbox import SandboxLimits, run_program
        src = ("import ctypes, os\\n"
               "try:\\n    open({str(REPO / 'README.md')!r}).read(); print('read')\\n"
               "except OSError as exc:\\n    print('refused', type(exc).__name__)\\n"
               "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\\n"
               "print(ctypes.CDLL(None).ptrace(0, 0, None, None))\\n"
               "import site, numpy\\nprint(sorted(os.listdir(site.getsitepackages()[0])), int(numpy.ones(3).sum()))\\n")
        r = run_program(src, '', SandboxLimits(timeout_s=10.0, memory_mb=256))
        print(json.dumps(r.__dict__))
    """)
    # the interpreter and the checkout must be reachable by uid 65534 (Python in /root/.pyenv, a checkout in
    # /root): in a mount namespace of this test, such folders are bound back onto a tmpfs over what hides them
    masks = _reachable_by_others([sys.base_prefix, sys.prefix, str(REPO)])
    command = (f"set -e; {masks}cd {shlex.quote(str(REPO))}; exec setpriv --reuid=65534 --regid=65534 --clear-groups "
               f"env HOME=/tmp TMPDIR=/tmp TORCH_DEVICE_BACKEND_AUTOLOAD=0 {sys.executable} -c {shlex.quote(probe)}")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["status"] == "ok", r
    assert not r["uid_dropped"]
    assert all(r[p] for p in ("network_isolated", "mount_isolated", "pid_isolated", "root_isolated",
                              "seccomp_filtered")), r
    # the site folder holds only the exposed package (a tmpfs made and bound into inside the user namespace)
    assert r["stdout"].splitlines() == ["refused FileNotFoundError", "[1, 2]", "-1",
                                        "['numpy', 'numpy.libs'] 3"], r


_DOCKER_LIKE = textwrap.dedent("""
    import ctypes, json, logging, sys
    from portrl.rewards import sandbox_seccomp, sandbox_syscalls
    from portrl.rewards.sandbox import SandboxLimits, SandboxUnisolated, run_program
    arch, audit_arch, numbers = sandbox_syscalls.native()
    refused = {name: numbers[name] for name in ("unshare", "clone", "clone3")}
    libc = ctypes.CDLL(None, use_errno=True)
    assert sandbox_seccomp.install(libc, sandbox_seccomp.build_filter(audit_arch, refused)) is None
    logging.basicConfig(format="WARNING %(message)s")
    limits = SandboxLimits(timeout_s=10.0, memory_mb=256, allow_unisolated=sys.argv[1] == "allow")
    try:
        r = run_program("print('still runs')", "", limits)
    except SandboxUnisolated as exc:
        print(json.dumps({"refused": str(exc)}))
    else:
        print(json.dumps(r.__dict__))
""")


def _run_where_namespaces_are_refused(allow: bool) -> tuple[dict, str]:
    """Docker's default seccomp profile refuses unshare without CAP_SYS_ADMIN: imitated by a filter on a helper
    process, which the sandbox inherits. (the helper's last stdout line as JSON, its stderr)"""
    if not _seccomp_available():
        pytest.skip("no seccomp on this platform to imitate the refusal with")
    done = subprocess.run([sys.executable, "-c", _DOCKER_LIKE, "allow" if allow else "refuse"], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_platform_that_refuses_namespaces_refuses_to_run_the_program():
    r, _ = _run_where_namespaces_are_refused(allow=False)
    message = r.get("refused")
    assert message is not None, r  # the program did not run
    assert "\n" not in message
    parts = "network namespace, mount namespace, PID namespace, minimal root"
    assert f"no {parts}" in message and "unshare: Operation not permitted" in message, message
    assert "--security-opt seccomp=unconfined" in message and "sandbox.allow_unisolated=true" in message
    assert "kernel.unprivileged_userns_clone=1" in message
    assert "kernel.apparmor_restrict_unprivileged_userns=0" in message
    if os.geteuid() == 0:
        assert "--cap-add SYS_ADMIN" in message


def test_allow_unisolated_runs_where_namespaces_are_refused_with_flags_and_warnings():
    r, stderr = _run_where_namespaces_are_refused(allow=True)
    assert (r["status"], r["stdout"]) == ("ok", "still runs\n"), r
    assert not any(r[p] for p in ("network_isolated", "mount_isolated", "pid_isolated", "root_isolated")), r
    assert r["seccomp_filtered"] and "Operation not permitted" in r["details"]["ns_error"], r
    for part in ("no new network namespace", "no new PID namespace", "no private root file system"):
        assert f"WARNING code sandbox: {part}" in stderr, stderr[-3000:]


def test_namespaces_false_needs_allow_unisolated():
    with pytest.raises(ValueError, match="allow_unisolated=True"):
        SandboxLimits(namespaces=False)
    r = run_program("print('plain')", "", SandboxLimits(timeout_s=5.0, memory_mb=256, namespaces=False,
                                                        allow_unisolated=True))
    assert (r.status, r.stdout) == ("ok", "plain\n"), r
    assert not any((r.network_isolated, r.mount_isolated, r.pid_isolated, r.root_isolated)), r


def test_where_the_root_cannot_be_built_the_masked_view_applies(isolation, monkeypatch, caplog):
    _need(isolation, "root_isolated", "pid_isolated")
    broken = {**root_layout(FAST.packages), "binds": [["/nonexistent-portrl-sandbox-source", "/usr"]]}
    monkeypatch.setattr(sandbox, "root_layout", lambda packages=(): broken)
    monkeypatch.setattr(sandbox, "_warned", set())
    src = textwrap.dedent(f"""
        import os
        try:
            open({str(REPO / 'README.md')!r}).read()
            print('read')
        except OSError as exc:
            print('refused', type(exc).__name__)
        print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
    """)
    # refused by default: the minimal root is a part of the isolation
    with pytest.raises(SandboxUnisolated, match=r"no minimal root \(minimal root: .*nonexistent-portrl-sandbox-source"):
        run_program(src, "", replace(FAST, allow_unisolated=False))
    with caplog.at_level(logging.WARNING, logger="portrl.rewards.sandbox"):
        r = run_program(src, "", FAST)
    assert r.status == "ok", r.stderr
    assert (r.root_isolated, r.mount_isolated, r.pid_isolated) == (False, True, True)
    assert "nonexistent-portrl-sandbox-source" in r.details["root_error"]
    assert "no private root file system" in caplog.text
    # as documented: the checkout is readable again (unless it sits in a folder the fallback masks with a tmpfs,
    # /tmp for one), /proc is still the namespace's own
    masked = any(Path(os.path.realpath(REPO)).is_relative_to(os.path.realpath(d)) for d in WRITABLE_DIRS)
    assert r.stdout.splitlines() == ["refused FileNotFoundError" if masked else "read", "[1, 2]"], r.stdout
