"""WorkerGroup without Ray: the one rule for Ray, the in-process launcher (direct calls, no copies), explicit
collection (gather / concat / metrics / rank0 / run), and workers built with only the config sections they
declare (a real CriticWorker and ActorRolloutWorker on a tiny model)."""

import pytest
import torch
from omegaconf import OmegaConf

from portrl.config.options_schema import default_config
from portrl.device import get_backend
from portrl.errors import UserError
from portrl.workers.actor import ActorRolloutWorker
from portrl.workers.batch import Batch
from portrl.workers.critic import CriticWorker
from portrl.workers.group import WorkerGroup, use_ray, worker_config


class Recorder:
    """Keeps what it was given and hands back the very objects it holds."""

    config_sections = ("trainer",)

    def __init__(self, cfg, rank=0, world_size=1):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.state = {"count": torch.tensor([3.0]), "nested": {"a": 1}}
        self.seen = None

    def take(self, batch):
        self.seen = batch
        return batch

    def stats(self, batch):
        return {"loss": 1.5, "num_tokens": len(batch)}

    def state_dict(self):
        return self.state

    def load(self, state):
        self.state = state
        return "ignored"


def _cfg(**over):
    cfg = default_config()
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def test_one_rule_decides_where_workers_run():
    assert use_ray(_cfg(), 1) is False
    assert use_ray(_cfg(), 2) is True
    assert use_ray(_cfg(**{"trainer.ray_address": "10.0.0.1:6379"}), 1) is True
    assert use_ray(_cfg(**{"rollout.placement": "separated"}), 1) is True
    assert use_ray(_cfg(**{"trainer.use_ray": True}), 1) is True
    assert use_ray(_cfg(**{"trainer.use_ray": False}), 1) is False
    with pytest.raises(UserError, match="trainer.use_ray=false, but 2 workers run as Ray actors"):
        use_ray(_cfg(**{"trainer.use_ray": False}), 2)
    with pytest.raises(UserError, match="rollout.placement=separated"):
        use_ray(_cfg(**{"trainer.use_ray": False, "rollout.placement": "separated"}), 1)


def test_in_process_group_calls_directly_and_collects_what_is_asked():
    group = WorkerGroup(Recorder, _cfg(), 1, get_backend("cpu"))
    worker = group.local_worker
    assert not group.use_ray and group.num_workers == 1 and group.role == "Recorder"
    b = Batch({"x": torch.arange(4).view(4, 1)})
    assert group.concat("take", b) is b and worker.seen is b  # no split, no copy
    assert group.gather("take", b) == [b]
    assert group.metrics("stats", b) == {"loss": 1.5, "num_tokens": 4}
    state = group.rank0("state_dict")
    assert state is worker.state and state["nested"] == {"a": 1}  # never a metrics reduction
    assert group.run("load", {"k": 1}) is None and worker.state == {"k": 1}
    with pytest.raises(TypeError, match="Recorder.state_dict returned dict, not a Batch"):
        group.concat("state_dict")
    with pytest.raises(TypeError, match="not a metrics dict"):
        group.metrics("take", b)
    assert group.describe(0).startswith("Recorder rank 0 on node local")
    weightless = WorkerGroup(Recorder, _cfg(), 1, get_backend("cpu"), role="r")
    weightless.shutdown()
    assert weightless.local_worker is None


def test_worker_config_holds_only_declared_sections():
    cfg = _cfg()
    trimmed = worker_config(Recorder, cfg)
    assert list(trimmed.keys()) == ["trainer"] and trimmed.trainer.seed == cfg.trainer.seed
    trimmed.trainer.seed = 99
    assert cfg.trainer.seed != 99  # a copy: a worker cannot change the run's config
    with pytest.raises(Exception, match="reward"):
        trimmed.reward

    class Undeclared:
        pass

    assert worker_config(Undeclared, cfg) is cfg

    class Asks:
        config_sections = ("trainer", "nope")

    with pytest.raises(ValueError, match=r"Asks reads config sections \['nope'\]"):
        worker_config(Asks, cfg)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from portrl.models import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, intermediate_size=64, seed=0))


def test_workers_built_by_a_group_see_only_their_sections(tiny_model):
    cfg = _cfg(**{"device.name": "cpu", "device.num_threads": 1, "model.path": tiny_model,
                  "data.max_response_length": 4, "rollout.n": 2, "actor.ppo_mini_batch_size": 2})
    critic = WorkerGroup(CriticWorker, cfg, 1, get_backend("cpu")).local_worker
    assert set(critic.cfg.keys()) == set(CriticWorker.config_sections)
    for section in ("reward", "algorithm", "ref"):
        assert section not in critic.cfg
        with pytest.raises(Exception, match=section):
            getattr(critic.cfg, section)
    actor = WorkerGroup(ActorRolloutWorker, cfg, 1, get_backend("cpu")).local_worker
    assert set(actor.cfg.keys()) == set(ActorRolloutWorker.config_sections)
    assert "reward" not in actor.cfg and "critic" not in actor.cfg
    # the trimmed workers still do their whole job: generate, log-probs, values, both updates
    prompts = [actor.tokenizer(f"{i}+1=")["input_ids"] for i in range(2)]
    b = actor.generate(prompts, {"n": 2, "temperature": 1.0, "max_new_tokens": 4, "seed": 0})
    b["advantages"] = torch.ones(b["response_mask"].shape) * b["response_mask"]
    b.union(critic.compute_values(b))
    b["returns"] = b["advantages"].clone()
    assert critic.update_critic(b)["critic/grad_norm"] > 0
    assert actor.update_actor(b)["actor/grad_norm"] > 0
