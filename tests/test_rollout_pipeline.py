"""The schedule of generation requests (portrl/trainer/rollout_pipeline.py): how many are in flight per mode, the
generation seeds (depth 0 samples what sync samples), the data position a checkpoint keeps, the staleness bound
with stale_samples=drop, and the config checks of the asynchronous modes."""

import os

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from portrl.config.checks_async import check_async  # noqa: E402
from portrl.config.options_schema import default_config  # noqa: E402
from portrl.trainer.generation import generation_seed  # noqa: E402
from portrl.trainer.rollout_pipeline import RolloutPipeline, async_plan, batch_index  # noqa: E402
from portrl.workers.batch import Batch, build_rollout_batch  # noqa: E402


class Done:
    def __init__(self, batch):
        self._batch = batch

    def batch(self):
        return self._batch


class RolloutGroup:
    """Records every generate call; each answers with one response token per row of policy version ``self.version``
    (the version its worker holds when the call runs: here, when it is asked), or ``min_version`` when newer (a
    rollout worker waits for the version it is asked for)."""

    def __init__(self):
        self.calls, self.version = [], 0

    def submit(self, method, prompts, sampling, **kwargs):
        self.calls.append((method, prompts.meta["uid"], sampling["seed"], kwargs))
        b = build_rollout_batch(prompts.meta["prompt_ids"], [[1]] * len(prompts.meta["uid"]), [[0.0]] * len(prompts.meta["uid"]))
        b["rollout_versions"] = torch.full((len(b), 1), max(self.version, kwargs.get("min_version", 0)))
        return Done(b)


class Prompts:
    """A dataset stream of batches of 2 prompts over 6 rows (3 batches per epoch)."""

    def __init__(self):
        self.epoch, self.position = 0, 0

    def state(self):
        return {"epoch": self.epoch, "position": self.position, "num_rows": 6}

    def draw(self):
        if self.position + 2 > 6:
            self.epoch, self.position = self.epoch + 1, 0
        uids = [f"e{self.epoch}-r{self.position + i}" for i in range(2)]
        self.position += 2
        return Batch(meta={"prompt_ids": [[3, 4]] * 2, "uid": uids})


def _cfg(**over):
    cfg = default_config()
    OmegaConf.update(cfg, "data.train_batch_size", 2)
    for k, v in over.items():
        OmegaConf.update(cfg, k.replace("__", "."), v)
    return cfg


def _pipeline(cfg):
    group, data = RolloutGroup(), Prompts()
    return RolloutPipeline(cfg, group, data.draw, data.state), group, data


@pytest.mark.parametrize("mode,staleness,stale,depth", [("sync", 5, "wait", 0), ("one_step_off", 5, "drop", 1),
                                                        ("async", 0, "wait", 0), ("async", 2, "wait", 2),
                                                        ("async", 2, "drop", 3)])
def test_requests_in_flight_follow_the_mode(mode, staleness, stale, depth):
    cfg = _cfg(trainer__mode=mode, async_training__max_staleness=staleness, async_training__stale_samples=stale)
    p, group, _ = _pipeline(cfg)
    assert p.plan.depth == depth
    for step in range(1, 5):
        _, batch, index = p.take(step, version=step - 1)
        assert index == step - 1 and len(p.queue) == depth
    # drop: the rollout here is as fast as can be, so the request asked for at step 1 for step 4 (one more than the
    # bound allows ahead) lags 3 > 2 versions when taken, and is asked for again
    assert p.dropped == (2 if stale == "drop" and mode == "async" else 0)
    assert len(group.calls) == 4 + depth + p.dropped // 2
    kwargs = group.calls[0][3]
    assert ("min_version" in kwargs) == (mode != "sync")


def test_without_prefetch_the_seeds_are_the_synchronous_ones():
    cfg = _cfg(trainer__mode="async", async_training__max_staleness=0)
    p, group, _ = _pipeline(cfg)
    for step in (1, 2):
        p.take(step, step - 1)
        p.take(step, step - 1)  # a second batch in the step (dynamic sampling)
    assert [c[2] for c in group.calls] == [generation_seed(cfg, s, k) for s in (1, 2) for k in (0, 1)]


def test_a_prefetched_request_is_seeded_for_the_step_that_trains_it():
    cfg = _cfg(trainer__mode="async", async_training__max_staleness=2)
    p, group, _ = _pipeline(cfg)
    p.take(1, 0)
    p.take(2, 1)
    assert [c[2] for c in group.calls] == [generation_seed(cfg, s, 0) for s in (1, 2, 3, 4)]


def test_a_checkpoint_keeps_the_position_before_the_oldest_request_in_flight():
    cfg = _cfg(trainer__mode="async", async_training__max_staleness=2)
    p, group, data = _pipeline(cfg)
    p.take(1, 0)  # batch 0 trained; batches 1, 2 in flight
    assert p.data_state() == {"epoch": 0, "position": 2, "num_rows": 6} and data.position == 6
    p.take(2, 1)  # batch 1 trained; batches 2, 3 (the next epoch's first) in flight
    assert batch_index(p.data_state(), 2) == 2
    p.discard()
    assert p.data_state() == data.state()


def test_drop_asks_again_for_a_request_older_than_the_bound():
    cfg = _cfg(trainer__mode="async", async_training__max_staleness=1, async_training__stale_samples="drop")
    p, group, _ = _pipeline(cfg)
    p.take(1, 0)  # requests for steps 2 and 3 in flight, both generated with version 0
    group.version = 2
    _, batch, index = p.take(2, 1)  # lag 1: kept
    assert index == 1 and int(batch["rollout_versions"].min()) == 0
    _, batch, index = p.take(3, 2)  # lag 2 > 1: its prompts generated again, with version 2
    assert index == 2 and int(batch["rollout_versions"].min()) == 2
    assert [c[1] for c in group.calls].count(group.calls[2][1]) == 2  # the same prompts, asked for twice
    m = p.step_metrics(batch, 2)
    assert m["async/dropped_samples"] == 2 and m["async/staleness_max"] == 0 and "rollout_versions" not in batch


def test_async_plan_of_each_mode():
    assert async_plan(_cfg(trainer__mode="one_step_off")).partial is False
    plan = async_plan(_cfg(trainer__mode="async", async_training__max_staleness=3))
    assert (plan.max_staleness, plan.depth, plan.drop, plan.partial) == (3, 3, False, True)


def test_config_checks_of_the_asynchronous_modes():
    assert check_async(_cfg(trainer__mode="async", rollout__placement="separated")) == []
    problems = check_async(_cfg(trainer__mode="async"))
    assert len(problems) == 1 and "set rollout.placement=separated" in problems[0]
    problems = check_async(_cfg(trainer__mode="later", async_training__stale_samples="keep",
                                async_training__max_staleness=-1))
    assert len(problems) == 3 and "'sync', 'one_step_off', 'async'" in problems[0] and "'wait', 'drop'" in problems[1]
