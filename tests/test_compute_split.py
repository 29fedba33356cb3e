"""The split of a node's compute between a separated run's trainer workers and rollout workers: the CPU backend's
core rule (backends/cpu/cores.py), the accelerators' devices, and which Ray groups a run pins
(portrl/workers/placement.py). The pinned workers themselves: tests/test_distributed_separated.py."""

from __future__ import annotations

import itertools
import os

import pytest

from backends.cpu.cores import split_cores
from portrl.config import compose
from portrl.device import get_backend
from portrl.device.split import ComputeSplit, describe_cores
from portrl.errors import UserError
from portrl.workers.critic import CriticWorker
from portrl.workers.placement import compute_split, group_pinning, trainer_groups
from portrl.workers.rollout_worker import RolloutWorker


def test_in_proportion_to_the_workers():
    two = split_cores([0, 1], 1, 1)  # this machine: one core each
    assert (two.unit, two.trainer, two.rollout, two.disjoint) == ("cores", ((0,),), ((1,),), True)
    eight = split_cores(range(8), 1, 1)
    assert eight.trainer == ((0, 1, 2, 3),) and eight.rollout == ((4, 5, 6, 7),)
    five = split_cores(range(8), 2, 1)  # 8 // 3 = 2 each; cores 6 and 7 go to no worker
    assert five.trainer == ((0, 1), (2, 3)) and five.rollout == ((4, 5),)
    assert "2 core(s) per worker" in five.why and "0-7" in five.why
    sparse = split_cores([7, 2, 5, 3], 1, 1)  # the process's affinity need not start at 0 nor be contiguous
    assert sparse.trainer == ((2, 3),) and sparse.rollout == ((5, 7),)
    assert sparse.cores("trainer", 0) == (2, 3) and sparse.cores("rollout", 0) == (5, 7)
    assert sparse.cores("rollout", 1) is None


def test_rollout_cpu_cores_sets_the_rollout_side():
    s = split_cores(range(8), 1, 2, rollout_cores=6)
    assert s.trainer == ((0, 1),) and s.rollout == ((2, 3, 4), (5, 6, 7))
    s = split_cores(range(8), 1, 2, rollout_cores=5)  # 5 // 2: two each; the trainer keeps all of its 3
    assert s.trainer == ((0, 1, 2),) and s.rollout == ((3, 4), (5, 6))
    s = split_cores(range(2), 1, 1, rollout_cores=1)
    assert s.trainer == ((0,),) and s.rollout == ((1,),) and s.why.startswith("rollout.cpu_cores=1 of the 2 cores")


@pytest.mark.parametrize("cores, t, r, k, phrase", [
    (2, 1, 1, 3, "rollout.cpu_cores=3 is more than the 2 cores this process may use (0-1, os.sched_getaffinity); "
                 "set rollout.cpu_cores<=1"),
    (8, 1, 3, 2, "rollout.cpu_cores=2 gives no core to some of the rollout.num_rollout_workers=3 rollout workers; "
                 "set rollout.cpu_cores>=3"),
    (8, 3, 1, 6, "rollout.cpu_cores=6 leaves 2 of the 8 cores this process may use (0-7, os.sched_getaffinity) to "
                 "the trainer.num_workers=3 trainer workers; set rollout.cpu_cores<=5"),
])
def test_rollout_cpu_cores_that_cannot_be_met_is_one_line(cores, t, r, k, phrase):
    with pytest.raises(UserError) as err:
        split_cores(range(cores), t, r, rollout_cores=k)
    assert str(err.value).startswith(phrase) and "\n" not in str(err.value)


def test_too_few_cores_pins_nothing():
    s = split_cores([0, 1], 2, 1)
    assert (s.trainer, s.rollout, s.disjoint) == ((), (), False)
    assert s.cores("trainer", 0) is None and s.why.startswith("not pinned: 2 trainer + 1 rollout workers")


def test_every_split_is_disjoint_and_within_the_cores():
    for c, t, r in itertools.product(range(2, 13), range(1, 4), range(1, 4)):
        for k in [None, *range(r, c - t + 1)]:
            s = split_cores(range(c), t, r, rollout_cores=k)
            sets = [set(x) for x in s.trainer + s.rollout]
            if c < t + r and k is None:
                assert not sets
                continue
            assert len(sets) == t + r and all(sets), (c, t, r, k)
            assert sum(map(len, sets)) == len(set().union(*sets)) and set().union(*sets) <= set(range(c))
            assert len({len(x) for x in s.trainer}) == 1 and len({len(x) for x in s.rollout}) == 1  # one bundle size
            if k is not None:
                assert sum(len(x) for x in s.rollout) == k - k % r


def test_the_accelerators_split_devices_and_the_cpu_splits_its_cores(monkeypatch):
    for name in ("cuda", "rocm", "npu"):
        s = get_backend(name).split_compute(2, 2, rollout_cores=3)  # rollout.cpu_cores is the CPU's alone
        assert (s.unit, s.trainer, s.rollout, s.disjoint) == ("devices", (), (), True)
        assert s.cores("rollout", 0) is None and "Ray bundle" in s.why
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    s = get_backend("cpu").split_compute(1, 1)
    assert (s.unit, s.trainer, s.rollout) == ("cores", ((4, 5),), ((6, 7),))
    with pytest.raises(ValueError, match="compute side 'critic'"):
        ComputeSplit("cores").cores("critic", 0)


def test_describe_cores():
    assert describe_cores([0, 1, 2, 5]) == "0-2,5" and describe_cores([3]) == "3" and describe_cores([]) == ""
    assert describe_cores({9, 8, 1}) == "1,8-9"


def _cfg(*overrides):
    return compose(overrides=["trainer.num_workers=1", *overrides])


def test_which_runs_and_groups_are_pinned(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    cpu = get_backend("cpu")
    assert compute_split(_cfg(), cpu) is None  # colocated: as before, nothing pinned
    assert group_pinning(_cfg(), cpu, RolloutWorker, 1) is None
    separated = _cfg("rollout.placement=separated")
    assert compute_split(separated, cpu).rollout == ((4, 5, 6, 7),)
    assert compute_split(_cfg("rollout.placement=separated", "trainer.ray_address=10.0.0.1:6379"), cpu) is None
    rollout = group_pinning(separated, cpu, RolloutWorker, 1)
    assert (rollout.side, rollout.cores, rollout.ray_cpus) == ("rollout", ((4, 5, 6, 7),), 4.0)
    actor = group_pinning(separated, cpu, object, 1)  # a worker class that names no side: the trainer's
    assert (actor.side, actor.cores, actor.ray_cpus) == ("trainer", ((0, 1, 2, 3),), 4.0)
    assert group_pinning(separated, cpu, object, 2) is None  # more workers than the trainer side has core sets
    assert group_pinning(separated, get_backend("cuda"), RolloutWorker, 1) is None  # devices: Ray's bundles


def test_trainer_groups_share_their_cores_in_rays_count(monkeypatch):
    """The actor and the critic (and PRIME's PRM) of rank r run on rank r's trainer cores, taking turns: Ray
    counts those cores once, split among the groups."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    ppo = _cfg("rollout.placement=separated", "algorithm=ppo")
    assert trainer_groups(ppo) == 2 and trainer_groups(_cfg("rollout.placement=separated")) == 1
    critic = group_pinning(ppo, get_backend("cpu"), CriticWorker, 1)
    assert critic.cores == ((0, 1, 2, 3),) and critic.ray_cpus == 2.0
    three = _cfg("rollout.placement=separated", "algorithm=ppo", "reward_model.enable=true")
    assert trainer_groups(three) == 3 and group_pinning(three, get_backend("cpu"), CriticWorker, 1).ray_cpus == 1.3333
