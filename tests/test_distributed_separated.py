"""rollout.placement=separated across Ray actors: the trainer's actor worker trains without an engine, a
RolloutWorker in its own resource pool generates, and after an update the bucketed weight sync (over the CPU's
first weight transport, shared memory; tests/test_distributed_ray.py runs the gloo broadcast between Ray actors,
tests/test_weight_transport.py both in every mode) leaves the rollout worker with the trainer's exact weights and
log-probs; the two sides run on disjoint cores (portrl/workers/placement.py, the split rule:
tests/test_compute_split.py). One module-scoped local Ray."""

import json
import logging
import os

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ray = pytest.importorskip("ray")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.device import get_backend  # noqa: E402
from portrl.device.split import describe_cores  # noqa: E402
from portrl.workers.batch import Batch  # noqa: E402
from portrl.workers.ray_env import init_ray  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from portrl.models import write_tiny_model

    path = str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, intermediate_size=64, seed=0, initializer_range=0.2))
    yield path
    if ray.is_initialized():
        ray.shutdown()


def _cfg(path, out):
    cfg = default_config()
    for k, v in {"device.name": "cpu", "device.num_threads": 1, "model.path": path, "trainer.output_dir": str(out),
                 "rollout.placement": "separated", "rollout.num_rollout_workers": 1,
                 "rollout.weight_sync_bucket_mb": 1,
                 "data.arith.num_train": 64, "data.arith.num_test": 8, "data.train_batch_size": 4,
                 "data.max_response_length": 5, "rollout.n": 4, "actor.ppo_mini_batch_size": 4,
                 "actor.optim.lr": 1e-2, "trainer.total_steps": 2, "trainer.test_freq": 2,
                 "trainer.progress_bar": False, "trainer.loggers": ["jsonl"], "trainer.plot": False,
                 "trainer.save_final": False}.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _same(got, want):
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


@pytest.mark.slow  # a training and a rollout Ray worker group, several updates (~30 s)
def test_separated_rollout_worker_gets_the_policy_after_each_update(tiny_model, tmp_path, monkeypatch):
    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tiny_model, tmp_path / "run")
    init_ray(cfg, get_backend("cpu"), num_cpus=3)
    trainer = RLTrainer(settle_config(cfg))
    try:
        actor, rollout = trainer.actor, trainer.rollout
        assert rollout is not None and rollout.launcher.pool is not actor.launcher.pool  # a resource pool of its own
        assert {i["pid"] for i in actor.info}.isdisjoint(i["pid"] for i in rollout.info)
        assert actor.gather("__getattribute__", "engine") == [None]  # the actor generates nothing
        summary = trainer.fit()  # generation (train and validation) went through the rollout worker
        rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert summary["steps"] == 2 and "val/acc/mean" in rows[-1] and rows[-1]["timing_s/sync"] > 0
        assert trainer.weight_link.transport.name == "shared_memory"  # the CPU's first, all on one node
        assert rows[-1]["perf/weight_sync_bytes"] > 0 and rows[-1]["perf/weight_sync_s"] > 0
        assert rows[-1]["perf/weight_sync_tensors"] == len(actor.full_weights())
        _same(rollout.full_weights(), actor.full_weights())

        # one more update with random advantages (the policy surely moves), then one sync
        prompts = Batch(meta={"prompt_ids": [[5, 6, 7], [8, 9]], "uid": ["a", "b"]})
        sampling = {"n": 4, "temperature": 1.0, "max_new_tokens": 5, "seed": 1}
        b = rollout.concat("generate_from", prompts, sampling)
        b["advantages"] = torch.randn(b["response_mask"].shape, generator=torch.Generator().manual_seed(0))
        b["advantages"] *= b["response_mask"]
        before = actor.full_weights()
        assert actor.metrics("update_actor", b)["actor/grad_norm"] > 0
        after = actor.full_weights()
        assert any(not torch.equal(before[k], after[k]) for k in after)
        stats = trainer.weight_link.sync()
        assert stats["tensors"] == len(after) and stats["buckets"] >= 1  # bucket splitting: test_distributed_ray
        assert stats["version"] == 3 and stats["mode"] == "bucketed"  # after the 2 steps' versions
        _same(rollout.full_weights(), after)
        b2 = rollout.concat("generate_from", prompts, sampling)
        lp = actor.concat("compute_log_probs", b2)["old_log_probs"]
        torch.testing.assert_close(lp * b2["response_mask"], b2["rollout_log_probs"], atol=1e-4, rtol=0)
    finally:
        trainer.rollout.shutdown()
        trainer.actor.shutdown()


def test_separated_workers_run_on_disjoint_cores(tiny_model, tmp_path, monkeypatch, caplog):
    """The trainer's and the rollout's Ray workers are pinned to disjoint cores, each with one torch thread per
    core (``device.num_threads=2`` is the driver's; a pinned worker's core count wins), as read back from the
    workers; the group's info and Ray's bundles say the same. On a 2-core machine: trainer 1 core, rollout 1."""
    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to split")
    each = len(cores) // 2  # one trainer and one rollout worker: in proportion
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tiny_model, tmp_path / "run")
    OmegaConf.update(cfg, "device.num_threads", 2)
    init_ray(cfg, get_backend("cpu"), num_cpus=3)
    threads = torch.get_num_threads()
    caplog.set_level(logging.INFO, logger="portrl.workers.ray_launcher")
    trainer = RLTrainer(settle_config(cfg))
    try:
        actor, rollout = trainer.actor, trainer.rollout
        (t,), (r,) = (ray.get([a.compute_info.remote() for a in g.launcher.actors]) for g in (actor, rollout))
        assert t == {"cores": cores[:each], "threads": each} and r == {"cores": cores[each:2 * each], "threads": each}
        assert set(t["cores"]).isdisjoint(r["cores"])
        assert actor.info[0]["cores"] == t["cores"] and rollout.info[0]["cores"] == r["cores"]
        assert actor.launcher.pool.bundle()["CPU"] == rollout.launcher.pool.bundle()["CPU"] == each  # Ray agrees
        assert sorted(os.sched_getaffinity(0)) == cores  # the driver is not pinned
        for role, group, got in (("ActorRolloutWorker", actor, t), ("rollout", rollout, r)):  # logged once each
            line = f"{role} rank 0 (pid {group.info[0]['pid']}) pinned to cores {describe_cores(got['cores'])}, "
            assert caplog.text.count(line + f"{each} torch thread(s)") == 1
        prompts = Batch(meta={"prompt_ids": [[5, 6, 7]], "uid": ["a"]})
        b = rollout.concat("generate_from", prompts, {"n": 2, "temperature": 1.0, "max_new_tokens": 3, "seed": 1})
        assert len(b) == 2  # the pinned rollout worker generates
    finally:
        trainer.rollout.shutdown()
        trainer.actor.shutdown()
        torch.set_num_threads(threads)
