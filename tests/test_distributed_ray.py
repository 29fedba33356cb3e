"""Distributed layer on a local Ray (one module-scoped cluster, few actors): data-parallel equivalence over gloo
(FSDP2 and DDP), weight broadcast in buckets between Ray actors, what each worker sees (env, devices), and a
killed worker stopping the caller with a named error."""

import copy
import os
import signal
import sys

import pytest
import torch

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ray = pytest.importorskip("ray")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.device import get_backend  # noqa: E402
from portrl.workers.batch import Batch  # noqa: E402
from portrl.workers.group import WorkerDiedError, WorkerGroup  # noqa: E402
from portrl.workers.parallel import clip_grad_norm, dp_world_size, full_state_dict, wrap_model  # noqa: E402
from portrl.workers import ray_env  # noqa: E402
from portrl.workers.ray_env import ResourcePool, init_ray  # noqa: E402
from portrl.workers.weight_sync import WeightSyncLink  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test worker classes travel by value


class TinyLMWorker:
    """A self-contained DP worker: a tiny Qwen2, AdamW, and a token-mean NLL over the response mask whose
    denominator is the *global* token count (so N ranks give the update of one rank on the whole batch)."""

    def __init__(self, cfg, rank=0, world_size=1):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                             tie_word_embeddings=False))
        self.backend = get_backend("cpu")
        self.model = wrap_model(model, cfg.actor.strategy, self.backend)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def update(self, batch):
        import torch.distributed as dist

        ids, mask = batch["input_ids"], batch["loss_mask"]
        logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").view_as(mask[:, 1:])
        tokens = mask[:, 1:].sum().double()
        local = tokens.clone()
        if dp_world_size() > 1:
            dist.all_reduce(tokens)
        loss = (nll * mask[:, 1:]).sum() / tokens.float() * dp_world_size()  # the wrapper averages over ranks
        loss.backward()
        norm = clip_grad_norm(self.model, 0.5)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"loss": float(loss.detach()) / dp_world_size(), "grad_norm": norm, "num_tokens": float(local),
                "rows": [len(batch)]}

    def named_weights(self):
        return full_state_dict(self.model).items()

    def wrapper(self):
        return type(self.model).__name__, [type(p).__name__ for p in self.model.parameters()][0]

    def update_weights(self, named):
        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in named:
                own[name].copy_(t)
        self.seen = True

    def env(self, names):
        return {n: os.environ.get(n) for n in names}


class EnvWorker:
    """Reports what its process sees; builds nothing."""

    def __init__(self, cfg, rank=0, world_size=1):
        import torch.distributed as dist

        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def env(self, names):
        return {**{n: os.environ.get(n) for n in names}, "world": self.world}


def make_batch(n=6, length=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (n, length), generator=g)
    mask = (torch.rand(n, length, generator=g) > 0.3).float()
    mask[:, 0] = 0
    return Batch({"input_ids": ids, "loss_mask": mask})


@pytest.fixture(scope="module")
def cfg():
    c = default_config()
    c.device.env = {"PORTRL_TEST_FLAG": "on"}
    init_ray(c, get_backend("cpu"), num_cpus=6, num_gpus=2)
    yield c
    ray.shutdown()


def test_local_ray_binds_loopback_without_dashboard(cfg):
    nodes = ray.nodes()
    assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"]
    assert not ray.get_runtime_context().get_node_id() == ""
    assert ray.worker.global_worker.node.address_info.get("webui_url") in (None, "")


def test_a_local_ray_waits_longer_for_its_gcs_unless_the_user_set_the_wait(monkeypatch):
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)
    ray_env._patient_local_start()
    assert os.environ["RAY_gcs_server_port_wait_time_s"] == str(ray_env.LOCAL_START_WAIT_S)  # not Ray's 30 s
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "7")
    ray_env._patient_local_start()
    assert os.environ["RAY_gcs_server_port_wait_time_s"] == "7"


@pytest.fixture(scope="module")
def dp_group(cfg):
    g = WorkerGroup(TinyLMWorker, cfg, 2, get_backend("cpu"), role="actor")  # strategy auto
    yield g
    g.shutdown()


@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_two_ray_workers_match_one_worker(cfg, dp_group, strategy):
    batch = make_batch()
    ref = TinyLMWorker(cfg)  # in-process, one rank, the whole batch
    ref_metrics = ref.update(batch)
    if strategy == "auto":
        group = dp_group
    else:
        c = cfg.copy()
        c.actor.strategy = "ddp"
        group = WorkerGroup(TinyLMWorker, c, 2, get_backend("cpu"), role="actor_ddp")
    try:
        wrapper, param_type = group.rank0("wrapper")
        assert (wrapper, param_type) == (("FSDPQwen2ForCausalLM", "DTensor") if strategy == "auto"
                                         else ("DistributedDataParallel", "Parameter"))
        metrics = group.metrics("update", batch)
        assert metrics["rows"] == [3, 3] and metrics["num_tokens"] == float(batch["loss_mask"][:, 1:].sum())
        assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
        assert ref_metrics["grad_norm"] > 0.5  # clipping was active on both sides
        got = dict(group.rank0("named_weights"))
        want = dict(ref.named_weights())
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    finally:
        if group is not dp_group:
            group.shutdown()


def test_weight_broadcast_in_buckets_between_ray_actors(cfg, dp_group):
    one_on_ray = copy.deepcopy(cfg)
    one_on_ray.trainer.use_ray = True  # one worker runs in-process unless the config asks for Ray
    rollout = WorkerGroup(TinyLMWorker, one_on_ray, 1, get_backend("cpu"), role="rollout",
                          pool=ResourcePool("rollout", 1, get_backend("cpu"), cpus_per_worker=0.5))
    try:
        trained = dict(dp_group.rank0("named_weights"))  # FSDP2 shards, updated by the test above
        before = dict(rollout.rank0("named_weights"))
        assert any(not torch.equal(before[k], trained[k]) for k in trained)
        link = WeightSyncLink(dp_group, rollout, bucket_mb=1536 / 2**20, transport="broadcast")  # 1.5 KiB buckets
        stats = link.sync()
        sizes = sorted(t.numel() * 4 for t in trained.values())
        assert sizes[-1] > 1536 and sizes[0] < 768  # some tensors span a bucket alone, small ones share
        assert stats["tensors"] == len(trained) and len(trained) > stats["buckets"] > 2
        assert stats["bytes"] == sum(sizes)
        after = dict(rollout.rank0("named_weights"))
        for k in trained:
            torch.testing.assert_close(after[k], trained[k], rtol=0, atol=0, msg=k)
        assert link.sync()["buckets"] == stats["buckets"]  # the link is reusable step after step
    finally:
        rollout.shutdown()


def test_workers_see_env_presets_and_their_own_devices(cfg):
    class FakeGPU(type(get_backend("cpu"))):
        """CPU compute, but Ray's GPU resource and its visible-devices variable (Ray fakes 2 GPUs here)."""
        ray_resource = "GPU"
        visible_devices_env = "CUDA_VISIBLE_DEVICES"
        ray_noset_env = ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",)

    names = ["TORCH_DEVICE_BACKEND_AUTOLOAD", "PORTRL_TEST_FLAG", "CUDA_VISIBLE_DEVICES", "LOCAL_RANK",
             "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]
    pool = ResourcePool("gpu", 2, FakeGPU(), cpus_per_worker=0.5, devices_per_worker=1)
    own = WorkerGroup(EnvWorker, cfg, 2, FakeGPU(), role="own", pool=pool, share=2)
    shared = WorkerGroup(EnvWorker, cfg, 2, FakeGPU(), role="shared", pool=pool, share=2, share_devices=True)
    try:
        seen = own.gather("env", names)
        assert [e["TORCH_DEVICE_BACKEND_AUTOLOAD"] for e in seen] == ["0", "0"]  # backend presets
        assert [e["PORTRL_TEST_FLAG"] for e in seen] == ["on", "on"]  # device.env
        ids = [i["accelerator_ids"] for i in own.info]
        assert [e["CUDA_VISIBLE_DEVICES"] for e in seen] == [x[0] for x in ids]  # each sees only its own device
        assert sorted(x[0] for x in ids) == ["0", "1"] and [e["world"] for e in seen] == [2, 2]
        assert [e["LOCAL_RANK"] for e in seen] == ["0", "0"]
        sh = shared.gather("env", names)
        assert all(e["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1" for e in sh)
        assert all(e["CUDA_VISIBLE_DEVICES"] is None for e in sh)  # Ray left it as the node had it (unset)
        # colocated: the two groups' rank r share a bundle, so they were given the same device id
        assert [i["accelerator_ids"] for i in shared.info] == ids
        assert [e["LOCAL_RANK"] for e in sh] == [x[0] for x in ids]  # picked by Ray's id
    finally:
        own.shutdown()
        shared.shutdown()
        pool.remove()


def test_killed_worker_raises_error_naming_it(cfg, dp_group):
    rank1 = dp_group.info[1]
    os.kill(rank1["pid"], signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as err:
        dp_group.metrics("update", make_batch())
    msg = str(err.value)
    assert "actor rank 1 on node 127.0.0.1" in msg and f"pid {rank1['pid']}" in msg
    assert "global_step_3" in str(err.value.with_checkpoint("/run/global_step_3"))
    assert dp_group.launcher.actors == []  # the group was shut down
