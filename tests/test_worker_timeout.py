"""A worker that stops answering (SIGSTOP) is detected within the group's time limit and named (role, rank, pid);
the trainer's limit follows trainer.worker_timeout_s and the slowest step (portrl.trainer.interrupts)."""

import os
import signal
import sys
import time

import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ray = pytest.importorskip("ray")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.device import get_backend  # noqa: E402
from portrl.workers.group import WorkerDiedError, WorkerGroup, WorkerTimeoutError  # noqa: E402
from portrl.workers.ray_calls import process_state  # noqa: E402
from portrl.workers.ray_env import init_ray  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test worker class travels by value


class EchoWorker:
    def __init__(self, cfg, rank=0, world_size=1):
        self.rank = rank

    def echo(self, x):
        return (self.rank, x)

    def wait(self, seconds):
        time.sleep(seconds)
        return self.rank


@pytest.fixture(scope="module")
def cfg():
    c = default_config()
    init_ray(c, get_backend("cpu"), num_cpus=2)
    yield c
    ray.shutdown()


def _gone(pid, within_s=20.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if process_state(pid) in (None, "Z"):
            return True
        time.sleep(0.2)
    return False


def test_frozen_worker_is_named_within_the_timeout(cfg):
    group = WorkerGroup(EchoWorker, cfg, 2, get_backend("cpu"), role="actor")
    group.timeout_s = 3.0
    assert group.gather("echo", 1) == [(0, 1), (1, 1)]
    pid = group.info[1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as err:
            group.gather("echo", 2)
        waited = time.monotonic() - t0
        assert 3.0 <= waited < 8.0, waited
        msg = str(err.value)
        assert msg.startswith("worker actor rank 1 on node 127.0.0.1") and "rank 0" not in msg, msg  # rank 0 answered
        assert f"pid {pid}) stopped answering: its process is stopped" in msg, msg
        assert "stopped answering" in msg and "`echo`" in msg and "3s" in msg and "worker_timeout_s" in msg
        assert isinstance(err.value, WorkerDiedError)  # the trainer adds the last checkpoint the same way
        named = str(err.value.with_checkpoint("/run/checkpoints/global_step_4"))
        assert "actor rank 1" in named and named.endswith("resume from the last good checkpoint "
                                                          "/run/checkpoints/global_step_4")
        assert group.launcher.actors == []  # shut down
        assert _gone(pid), f"the frozen worker {pid} was left behind ({process_state(pid)})"
    finally:
        if process_state(pid) == "T":
            os.kill(pid, signal.SIGCONT)


def test_a_local_run_listens_on_loopback_only(cfg):
    """Two workers joined in a gloo process group (rank 0 serves the TCP store) plus Ray's own processes: every
    listening socket is on 127.0.0.1."""
    psutil = pytest.importorskip("psutil")
    group = WorkerGroup(EchoWorker, cfg, 2, get_backend("cpu"), role="actor")
    try:
        assert group.gather("echo", 0) == [(0, 0), (1, 0)]
        node = ray._private.worker._global_node
        pids = [i["pid"] for i in group.info] + [p.process.pid for ps in node.all_processes.values() for p in ps]
        listening = {}
        for pid in pids:
            for c in psutil.Process(pid).net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listening.setdefault(pid, []).append(c.laddr.ip)
        assert group.info[0]["pid"] in listening  # rank 0 serves the store
        wide = {pid: ips for pid, ips in listening.items()
                if any(ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip in ips)}
        assert not wide, f"listening beyond loopback: {wide}"
    finally:
        group.shutdown()
