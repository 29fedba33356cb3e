"""Rollout placements are registered records (portrl/config/placement.py): the config checks, the device count,
the worker group, the actor and the trainer read the record that ``rollout.placement`` names."""

from __future__ import annotations

import pytest

from portrl.config import compose
from portrl.config.checks import CHOICES
from portrl.errors import UserError
from portrl.config.placement import (
    COLOCATED,
    SEPARATED,
    Placement,
    get_placement,
    placement_names,
    placement_needs_ray,
    placement_of,
    register_placement,
)


def test_the_builtin_placements():
    assert placement_names()[:2] == ("colocated", "separated")
    assert CHOICES["rollout.placement"] == placement_names()  # the checks accept what is registered
    cfg = compose(overrides=["rollout.placement=separated", "rollout.num_rollout_workers=3"])
    assert placement_of(cfg) is SEPARATED and not SEPARATED.actor_holds_engine and SEPARATED.needs_ray
    assert SEPARATED.devices_taken(cfg) == (3, "rollout.num_rollout_workers=3")
    colocated = compose(overrides=[])
    assert placement_of(colocated) is COLOCATED and COLOCATED.actor_holds_engine and not COLOCATED.needs_ray
    assert COLOCATED.devices_taken(colocated) == (0, "")
    assert COLOCATED.rollout_side(colocated, None, None) == (None, None)  # the actor's own engine
    assert placement_needs_ray(cfg) and not placement_needs_ray(colocated)


def test_a_tensor_parallel_rollout_worker_takes_that_many_devices():
    """Each separated rollout worker's engine spreads over rollout.tensor_model_parallel_size devices: the device
    count leaves them out of the trainer's, and the worker's Ray bundle asks for them (a trainer worker for one)."""
    from portrl.device import get_backend
    from portrl.workers.actor import ActorRolloutWorker
    from portrl.workers.ray_env import ResourcePool
    from portrl.workers.ray_launcher import devices_per_worker
    from portrl.workers.rollout_worker import RolloutWorker

    cfg = compose(overrides=["rollout.placement=separated", "rollout.num_rollout_workers=3",
                             "rollout.tensor_model_parallel_size=2"])
    assert SEPARATED.devices_taken(cfg) == (6, "rollout.num_rollout_workers=3 x rollout.tensor_model_parallel_size=2")
    assert devices_per_worker(RolloutWorker, cfg) == 2.0 and devices_per_worker(ActorRolloutWorker, cfg) == 1.0

    class Accelerator(type(get_backend("cpu"))):  # a backend whose devices Ray schedules as GPUs
        ray_resource = "GPU"

    pool = ResourcePool("rollout", 3, Accelerator(), devices_per_worker=devices_per_worker(RolloutWorker, cfg))
    assert pool.bundle() == {"CPU": 1.0, "GPU": 2.0}


def test_an_unknown_placement_is_one_line():
    with pytest.raises(UserError) as err:
        get_placement("remote")
    assert str(err.value).startswith("rollout.placement='remote' is not a rollout placement; valid: colocated, "
                                     "separated")
    with pytest.raises(UserError) as err:
        compose(overrides=["rollout.placement=remote"])
    assert "rollout.placement='remote' is not one of 'colocated', 'separated'" in str(err.value)


def test_register_placement_refuses_a_clash_and_an_actor_without_a_rollout_side():
    assert register_placement(SEPARATED) is SEPARATED  # the same record again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_placement(Placement("separated", "other", True, False, lambda cfg: (0, "")))
    with pytest.raises(ValueError, match="needs build_rollout"):
        register_placement(Placement("nowhere", "no engine anywhere", False, False, lambda cfg: (0, "")))
    assert "nowhere" not in placement_names()
