"""The code sandbox (portrl.rewards.sandbox): every hostile program gets a result, nothing escapes or outlives it.

Each test runs real subprocesses. Where this platform cannot give an isolation (no namespaces in the
container, not root), the test that needs it is skipped with the reason -- run_program reports what it got. The
limits here accept running without isolation (``allow_unisolated=True``): these tests are about results, limits and
cleanup, which hold on every platform; the refusal itself is tested in tests/test_rewards_sandbox_isolation.py.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
import uuid

import pytest

from portrl.rewards.sandbox import (
    RunResult,
    SandboxLimits,
    live_processes,
    run_program,
    shared_pool,
)
from portrl.rewards.sandbox_host import uid_lock_path


def _limits(**given) -> SandboxLimits:
    """Limits that accept running without isolation (module docstring)."""
    return SandboxLimits(allow_unisolated=True, **given)


FAST = _limits(timeout_s=2.0, memory_mb=256)


@pytest.fixture(scope="module")
def isolation() -> RunResult:
    """What this platform gives (one probe run)."""
    return run_program("print('probe')", "", FAST)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _host_pids_with(marker: str) -> list[int]:
    """Live processes of this machine whose command line holds ``marker`` (pids in a PID namespace mean
    nothing here: a program reports what it started by a marker in its command line)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read() and _alive(int(name)):
                        found.append(int(name))
            except OSError:
                pass
    return found


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
            except OSError:
                pass
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _no_leftovers(result: RunResult) -> None:
    assert live_processes(pgid=result.pid) == []
    if result.uid_dropped:
        # the run released its uid: a sandbox run of another test process may hold it now, so wait for its lock
        fd = os.open(uid_lock_path(result.details["uid"]), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            assert live_processes(uid=result.details["uid"]) == []
        finally:
            os.close(fd)


def test_correct_program_reads_stdin_and_prints():
    r = run_program("a, b = map(int, input().split())\nprint(a + b)\n", "2 3\n", FAST)
    assert (r.status, r.stdout, r.returncode) == ("ok", "5\n", 0)
    assert r.time_s < FAST.timeout_s


def test_clean_environment_and_private_folder_removed():
    src = ("import os, sys\nprint(os.getcwd())\nprint(sorted(os.environ))\nprint(os.environ['HOME'], "
           "os.environ['TMPDIR'])\nprint(sys.flags.isolated)\nopen('scratch.txt', 'w').write('x')\n")
    r = run_program(src, "", FAST)
    assert r.status == "ok", r.stderr
    cwd, env, homes, isolated = r.stdout.splitlines()
    assert env == str(["HOME", "LANG", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PATH",
                       "TMPDIR"])
    assert homes == f"{cwd} {cwd}" and isolated == "1"
    assert not os.path.exists(cwd)  # the temporary folder (with the file written in it) is gone


def test_infinite_loop_times_out_and_is_killed():
    start = time.monotonic()
    r = run_program("while True:\n    pass\n", "", _limits(timeout_s=1.0, memory_mb=256))
    assert r.status == "timeout"
    assert time.monotonic() - start < 5
    _no_leftovers(r)


def test_fork_bomb_is_bounded_and_leaves_no_process():
    src = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    r = run_program(src, "", _limits(timeout_s=1.5, memory_mb=256, nproc=8))
    assert r.status == "timeout"
    assert time.monotonic() - start < 10
    _no_leftovers(r)


def test_process_that_leaves_the_group_is_killed(isolation):
    if not (isolation.uid_dropped or isolation.pid_isolated):
        pytest.skip("needs the uid drop (root) or a PID namespace: otherwise nothing finds a setsid() escapee")
    marker = f"portrl-escapee-{uuid.uuid4().hex}"
    src = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n"
           f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
           "time.sleep(1.0)\nprint('parent done')\n")
    run = shared_pool(1).submit(run_program, src, "", FAST)
    seen = False
    while not run.done():
        seen = seen or bool(_host_pids_with(marker))
        time.sleep(0.02)
    r = run.result()
    assert r.status == "ok", r.stderr
    assert seen  # the escapee ran
    time.sleep(0.05)
    assert _host_pids_with(marker) == []
    _no_leftovers(r)


def test_memory_hog_hits_the_memory_limit():
    r = run_program("blocks = []\nwhile True:\n    blocks.append(bytearray(16 * 1024 * 1024))\n", "",
                    _limits(timeout_s=5.0, memory_mb=200))
    assert r.status == "memory", (r.status, r.stderr)


def test_huge_print_is_cut_at_the_output_cap():
    r = run_program("while True:\n    print('x' * 1000)\n", "",
                    _limits(timeout_s=5.0, memory_mb=256, output_bytes=100_000))
    assert r.status == "output_limit"
    assert len(r.stdout) == 100_000
    assert r.time_s < 5.0
    _no_leftovers(r)
    r = run_program("import sys\nwhile True:\n    sys.stderr.write('e' * 1000)\n", "",
                    _limits(timeout_s=5.0, memory_mb=256, output_bytes=100_000, stderr_bytes=500))
    assert (r.status, r.stderr) == ("output_limit", "e" * 500) and r.time_s < 5.0


def test_writing_outside_the_sandbox_is_refused_or_confined(isolation, tmp_path):
    if not (isolation.uid_dropped or isolation.mount_isolated):
        pytest.skip("this platform gives neither a uid drop nor a mount namespace: the program can write "
                    "wherever the user can")
    private = tmp_path / "outside.txt"  # in a folder only the test's user may write
    world = f"/tmp/portrl-outside-{uuid.uuid4().hex}.txt"  # in a world-writable folder
    src = (f"for path in {[str(private), world]!r}:\n    try:\n        open(path, 'w').write('escaped')\n"
           "        print('wrote', path)\n    except OSError as exc:\n"
           "        print('refused', path, type(exc).__name__)\n")
    r = run_program(src, "", FAST)
    assert r.status == "ok", r.stderr
    assert not private.exists()
    if isolation.mount_isolated:  # /tmp is a private tmpfs in the sandbox
        assert not os.path.exists(world)
    else:
        assert "wrote " + world in r.stdout  # documented: a dropped uid may still write world-writable folders
        os.unlink(world)


def test_socket_to_a_local_server_fails(isolation):
    if not isolation.network_isolated:
        pytest.skip(f"no network namespace on this platform: {isolation.details}")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    src = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
           "s.sendall(b'hello')\nprint('connected')\n")
    try:
        r = run_program(src, "", FAST)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # a connection, even one made and dropped, would wait in the backlog
            server.accept()
    finally:
        server.close()
    assert r.status == "runtime_error" and "connected" not in r.stdout
    assert "Error" in r.stderr.strip().splitlines()[-1]


def test_os_system_runs_inside_the_same_limits(isolation, tmp_path):
    marker = tmp_path / "from_shell.txt"
    duration = f"60.{uuid.uuid4().int % 10**9}"  # finds the background job on this machine by its command line
    shell = ("id -u; sed -n 's/^Max processes *\\([0-9]*\\).*/\\1/p' /proc/self/limits; "
             f"sleep {duration} & echo $! > bg.pid; touch {marker} 2>/dev/null; echo done")
    src = (f"import os\nos.system({shell!r})\nos.kill(int(open('bg.pid').read()), 0)\nprint('running')\n")
    r = run_program(src, "", _limits(timeout_s=3.0, memory_mb=256, nproc=8))
    assert r.status == "ok", r.stderr
    uid, nproc, done, running = r.stdout.split()
    assert (done, running) == ("done", "running")
    time.sleep(0.05)
    assert _host_pids_with(f"sleep\0{duration}\0") == []  # the shell's background job died with the run
    _no_leftovers(r)
    if isolation.uid_dropped:
        assert uid == str(r.details["uid"]) and nproc == "8"
    if isolation.uid_dropped or isolation.mount_isolated:
        assert not marker.exists()


def test_syntax_error_is_reported_as_such():
    r = run_program("def f(:\n    pass\n", "", FAST)
    assert r.status == "syntax_error"
    assert "SyntaxError" in r.stderr


def test_reading_stdin_past_its_end_gets_eof():
    r = run_program("print(input())\nprint(input())\n", "only line\n", FAST)
    assert r.status == "runtime_error" and "EOFError" in r.stderr
    assert r.stdout == "only line\n"
    r = run_program("import sys\nprint(repr(sys.stdin.read()))\nprint(repr(sys.stdin.read()))\n", "x", FAST)
    assert (r.status, r.stdout) == ("ok", "'x'\n''\n")


def test_file_size_and_open_file_limits():
    r = run_program("open('big', 'wb').write(b'0' * (4 * 1024 * 1024))\n", "",
                    _limits(timeout_s=2.0, memory_mb=256, file_size_mb=1))
    assert r.status == "runtime_error"  # SIGXFSZ / EFBIG
    r = run_program("fs = [open('f%d' % i, 'w') for i in range(100)]\n", "",
                    _limits(timeout_s=2.0, memory_mb=256, nofile=32))
    assert r.status == "runtime_error" and "Too many open files" in r.stderr


def test_pool_runs_cases_in_parallel_within_its_bound():
    src = "import time\nstart = time.time()\ntime.sleep(0.5)\nprint(start, time.time())\n"
    t0 = time.monotonic()
    limits = _limits(timeout_s=5.0, memory_mb=256)
    results = [f.result() for f in [shared_pool(3).submit(run_program, src, "", limits) for _ in range(6)]]
    wall = time.monotonic() - t0
    assert [r.status for r in results] == ["ok"] * 6
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert 2 <= most <= 3  # parallel, and never more than max_workers at once
    assert wall < 6 * 0.5  # faster than one at a time


def test_program_dies_with_a_killed_parent(tmp_path):
    """A reward process terminated mid-run (the reward manager's pool on its time limit) takes the program
    with it, although nobody is left to enforce the wall-time limit."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(
        "import os, threading, time\n"
        "from portrl.rewards.sandbox import SandboxLimits, run_program\n"
        "from portrl.rewards.sandbox_host import interpreter_info\n"
        "interpreter_info()\n"  # asked once per process by running the interpreter: not the child looked for below
        "threading.Thread(target=run_program, args=('import time\\ntime.sleep(60)\\n', '', "
        "SandboxLimits(allow_unisolated=True, timeout_s=60, memory_mb=256)), daemon=True).start()\n"
        "for _ in range(500):\n"
        "    kids = [p for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/stat').read()"
        ".rsplit(')', 1)[1].split()[1] == str(os.getpid())]\n"
        "    if kids:\n"
        "        time.sleep(0.3)\n"  # past the launcher's setup: the program runs
        "        print(kids[0], flush=True)\n"
        "        break\n"
        "    time.sleep(0.01)\n"
        "time.sleep(60)\n")
    sandboxes = tmp_path / "tmp"  # the killed parent cannot remove its sandbox folder: keep it in tmp_path
    sandboxes.mkdir()
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(sandboxes)})
    try:
        launcher = int(parent.stdout.readline())
        tree = [launcher] + _descendants(launcher)  # with a PID namespace: its init and the program
        assert all(_alive(pid) for pid in tree)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    for _ in range(100):
        if not any(_alive(pid) for pid in tree):
            break
        time.sleep(0.02)
    assert not any(_alive(pid) for pid in tree)


def test_folder_made_unreadable_by_the_program_is_still_removed():
    src = ("import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a/b', 0)\nos.chmod('a', 0)\n"
           "print(os.getcwd())\nos.chmod('.', 0)\n")
    r = run_program(src, "", FAST)
    assert r.status == "ok", r.stderr
    assert not os.path.exists(r.stdout.strip())


def test_files_written_in_the_sandbox_folder_are_bounded(isolation):
    if not isolation.mount_isolated:
        pytest.skip("without a mount namespace only each file's size is limited (file_size_mb)")
    src = ("for i in range(100):\n    try:\n        open(f'f{i}', 'wb').write(b'0' * (4 * 1024 * 1024))\n"
           "    except OSError as exc:\n        print(i, exc.strerror)\n        break\n")
    r = run_program(src, "", _limits(timeout_s=3.0, memory_mb=256, disk_mb=16, file_size_mb=8))
    assert r.status == "ok", r.stderr
    written, why = r.stdout.split(" ", 1)
    assert int(written) <= 4 and "No space left" in why


def test_numpy_works_under_the_default_limits():
    pytest.importorskip("numpy")
    r = run_program("import numpy as np\nprint(int(np.arange(10).sum()))\n", "", _limits(timeout_s=10.0))
    assert (r.status, r.stdout) == ("ok", "45\n"), r.stderr


_ABANDON = """\
import os, sys, threading, time
from portrl.rewards.sandbox import SandboxLimits, run_program, shared_pool
src = "import os, sys\\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', MARKER])"
limits = SandboxLimits(allow_unisolated=True, timeout_s=60, memory_mb=256)
START
def running():
    for p in os.listdir('/proc'):
        try:
            if p.isdigit() and MARKER.encode() in open(f'/proc/{p}/cmdline', 'rb').read():
                return True
        except OSError:
            pass
for _ in range(1000):
    if running():
        break
    time.sleep(0.01)
print(os.listdir(os.environ['TMPDIR']), flush=True)
"""  # then the main thread ends: the interpreter exits with the run going


@pytest.mark.parametrize("thread", ["daemon", "pool"])
def test_runs_still_going_at_interpreter_exit_are_cleaned_up(tmp_path, thread):
    """A run abandoned in its thread (the agent loop gives up on a tool call past its timeout: a daemon thread;
    a reward pool's worker) is killed and its folder removed when the process exits, without waiting for it."""
    import subprocess
    import sys

    marker = f"portrl-abandoned-{uuid.uuid4().hex}"
    start = ("threading.Thread(target=run_program, args=(src, '', limits), daemon=True).start()" if thread == "daemon"
             else "shared_pool(1).submit(run_program, src, '', limits)")
    script = tmp_path / "abandon.py"
    script.write_text(_ABANDON.replace("MARKER", repr(marker)).replace("START", start))
    sandboxes = tmp_path / "tmp"
    sandboxes.mkdir()
    began = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(sandboxes)})
    took = time.monotonic() - began
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("['portrl-sandbox-"), done.stdout  # the run was going when the process exited
    assert list(sandboxes.iterdir()) == []
    time.sleep(0.05)
    assert _host_pids_with(marker) == []
    assert took < 30, took  # not the run's 60 s
