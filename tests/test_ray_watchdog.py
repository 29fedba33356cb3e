"""The watchdog of a local Ray (portrl.workers.ray_watchdog), on stand-in processes: a "driver" that starts the
watchdog and a "raylet" (a script in a folder standing for Ray's package folder) which starts an "agent". When the
driver is killed alone, or its raylet ends while it lives, the raylet and the agent go and the watchdog exits;
what is not that Ray (another child of the driver, a raylet the driver did not start) is left alone."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="the watchdog reads /proc (Linux)")

RAYLET = textwrap.dedent("""
    import subprocess, sys, time
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(sys.argv[1], "w") as fh:
        fh.write(str(agent.pid))
    time.sleep(120)
""")

DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from portrl.workers import ray_watchdog
    ray_dir, pid_file, end_raylet = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    watchdog = ray_watchdog.start(ray_dir)
    raylet = subprocess.Popen([sys.executable, ray_dir + "/raylet.py", pid_file])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the driver's, not Ray's
    print(watchdog.pid, raylet.pid, other.pid, flush=True)
    if end_raylet:
        time.sleep(1.5)  # the watchdog has seen the raylet and its agent
        raylet.kill()
        raylet.wait()
    time.sleep(120)
""")

_STARTED: list = []


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    yield
    for pid in _STARTED:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _STARTED.clear()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids, seconds: float) -> float:
    t0 = time.monotonic()
    while any(_running(p) for p in pids):
        assert time.monotonic() - t0 < seconds, f"still running after {seconds}s: {[p for p in pids if _running(p)]}"
        time.sleep(0.05)
    return time.monotonic() - t0


def _start(tmp_path, end_raylet: bool):
    ray_dir = tmp_path / "site-packages" / "ray"
    ray_dir.mkdir(parents=True)
    (ray_dir / "raylet.py").write_text(RAYLET)
    (ray_dir / "gcs_server.py").write_text("import time\ntime.sleep(120)\n")
    pid_file = tmp_path / "agent.pid"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(ray_dir), str(pid_file), "1" if end_raylet else "0"],
                              stdout=subprocess.PIPE, text=True)
    watchdog, raylet, other = (int(p) for p in driver.stdout.readline().split())
    _STARTED.extend([driver.pid, watchdog, raylet, other])
    deadline = time.monotonic() + 30
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the stand-in raylet did not start its agent"
        time.sleep(0.05)
    agent = int(pid_file.read_text())
    _STARTED.append(agent)
    # a raylet this driver did not start (say, of a cluster built with `ray start`): never the watchdog's
    stranger = subprocess.Popen([sys.executable, str(ray_dir / "gcs_server.py")])
    _STARTED.append(stranger.pid)
    return driver, watchdog, raylet, agent, other, stranger


def test_driver_killed_alone_takes_its_ray_and_nothing_else(tmp_path):
    driver, watchdog, raylet, agent, other, stranger = _start(tmp_path, end_raylet=False)
    time.sleep(1.5)  # the watchdog records every 0.5 s
    driver.kill()  # kill -9 of the driver alone
    driver.wait()
    took = _gone_within([raylet, agent, watchdog], 10)
    assert took < 5, took
    assert _running(other) and stranger.poll() is None  # not that Ray's


def test_watchdog_exits_once_the_ray_it_saw_has_ended(tmp_path):
    driver, watchdog, raylet, agent, other, stranger = _start(tmp_path, end_raylet=True)
    _gone_within([raylet, agent, watchdog], 10)  # the raylet's orphaned agent goes with it; the watchdog exits
    assert driver.poll() is None and _running(other) and stranger.poll() is None


QUICK_RAYLET = textwrap.dedent("""
    import os, subprocess, sys
    session = f"session_2026-12-04_07-00-00_123456_{os.getppid()}"  # Ray's name for the driver's session
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"--session-dir=/tmp/{session}"])
    with open(sys.argv[1], "w") as fh:
        fh.write(str(agent.pid))
""")  # ends at once: before the watchdog's first poll, so the agent is an orphan it never recorded


def test_an_agent_orphaned_before_the_first_poll_goes_too(tmp_path):
    """A raylet that ends right after starting its agents (a Ctrl-C while Ray starts) leaves orphans the watchdog
    never saw below the driver (its first poll is 0.5 s after it starts): the session name in their arguments
    (``..._<driver pid>``) gives them away. A process naming another driver's session is left alone."""
    ray_dir = tmp_path / "site-packages" / "ray"
    ray_dir.mkdir(parents=True)
    (ray_dir / "raylet.py").write_text(QUICK_RAYLET)
    pid_file = tmp_path / "agent.pid"
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    driver_code = DRIVER.replace("raylet = subprocess.Popen", "raylet = subprocess.run").replace("raylet.pid", "0")
    driver = subprocess.Popen([sys.executable, "-c", driver_code, str(ray_dir), str(pid_file), "0"],
                              stdout=subprocess.PIPE, text=True)
    watchdog, _, other = (int(p) for p in driver.stdout.readline().split())
    _STARTED.extend([driver.pid, watchdog, other])
    agent = int(pid_file.read_text())
    _STARTED.append(agent)
    stranger = subprocess.Popen(sleeper + [f"--session-name=session_2026-12-04_07-00-00_123456_{driver.pid + 1}"])
    _STARTED.append(stranger.pid)
    assert _running(agent)
    driver.kill()
    driver.wait()
    took = _gone_within([agent, watchdog], 10)
    assert took < 5, took
    assert _running(other) and stranger.poll() is None


def test_session_processes_are_this_drivers_and_started_since():
    from portrl.workers.ray_watchdog import _stat, session_processes

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                             "--session_dir=/tmp/ray/session_2026-12-04_07-00-00_123456_99999999/"])
    _STARTED.append(proc.pid)
    started = _stat(proc.pid)[1]
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 10
    while b"--session_dir" not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)  # until the child has exec'd: before that its arguments are pytest's
    assert session_processes(99999999, started) == {proc.pid: started}
    assert session_processes(9999999, 0) == {}  # another driver's (a suffix of this one's pid is not a match)
    assert session_processes(99999999, started + 1) == {}  # started before the watchdog


SECOND_RAY_DRIVER = textwrap.dedent("""
    import os, subprocess, sys, time
    from portrl.workers import ray_watchdog
    ray_dir = sys.argv[1]
    first = ray_watchdog.start(ray_dir)
    raylet = subprocess.Popen([sys.executable, ray_dir + "/gcs_server.py"])
    time.sleep(1.5)  # the first watchdog has seen its Ray
    raylet.kill()  # the first Ray ends (ray.shutdown) ...
    raylet.wait()
    second = ray_watchdog.start(ray_dir)  # ... and a second one starts at once
    session = f"session_2026-12-05_02-00-00_123456_{os.getpid()}"
    # the new GCS as the first watchdog's sweep would see it: it names a session of this driver
    gcs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"--session-name={session}"])
    print(first.pid, second.pid, gcs.pid, first.poll() is not None, flush=True)
    time.sleep(120)
""")


def test_a_second_ray_of_the_same_driver_survives_the_first_watchdog(tmp_path):
    """A driver that shuts its Ray down and starts another (a pytest process, module after module): the first
    watchdog is retired before the second Ray starts, so its sweep by session name does not reach the new Ray's
    processes (CI: the new GCS was killed and ``ray.init`` timed out waiting for its port file)."""
    ray_dir = tmp_path / "site-packages" / "ray"
    ray_dir.mkdir(parents=True)
    (ray_dir / "gcs_server.py").write_text("import time\ntime.sleep(120)\n")
    driver = subprocess.Popen([sys.executable, "-c", SECOND_RAY_DRIVER, str(ray_dir)], stdout=subprocess.PIPE,
                              text=True)
    _STARTED.append(driver.pid)
    first, second, gcs, first_ended = driver.stdout.readline().split()
    _STARTED.extend([int(first), int(second), int(gcs)])
    assert first_ended == "True"  # retired before the second start returned
    time.sleep(2.0)  # more than a poll and a sweep of the first watchdog
    assert _running(int(gcs)) and _running(int(second))
    driver.kill()
    driver.wait()
    _gone_within([int(gcs), int(second)], 10)  # the second watchdog still does its job
