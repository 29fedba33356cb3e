"""``ActorRolloutWorker.update_reference`` (SPIN's moving reference, portrl/workers/actor.py): after it, the reference
scores tokens as the current policy does, and later updates of the policy leave it alone. One worker in this
process (plain and LoRA), and 2 Ray workers under FSDP2 with LoRA (the merged, gathered weights), where Σπ² of the
old-log-prob pass is checked too."""

import os

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.workers.actor import ActorRolloutWorker  # noqa: E402
from portrl.workers.batch import build_rollout_batch  # noqa: E402


def _cfg(path, **over):
    cfg = default_config()
    base = {"device.name": "cpu", "device.num_threads": 1, "model.path": path, "rollout.n": 4,
            "data.max_response_length": 6, "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size_per_device": 8,
            "actor.optim.lr": 5e-2, "actor.use_kl_loss": False}
    base.update(over)
    for k, v in base.items():
        OmegaConf.update(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from portrl.models import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=2, num_heads=2,
                                num_kv_heads=1, intermediate_size=64, seed=0, initializer_range=0.2))


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 30, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(4)]
    resp = [torch.randint(3, 30, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
            for _ in range(16)]
    b = build_rollout_batch(prompts, resp, n=4)
    b["advantages"] = torch.randn(len(b), 1, generator=g) * b["response_mask"]
    return b


def _check(update, ref_lp, policy_lp, init, update_reference, b1, b2):
    """init -> update(b1) -> the reference is still the start; update_reference -> it is the policy;
    update(b2) -> the policy moves on, the reference stays."""
    init()
    start = ref_lp(b1)
    update(b1)
    torch.testing.assert_close(ref_lp(b1), start, rtol=0, atol=0)
    assert float((policy_lp(b1) - start).abs().max()) > 1e-3  # the update moved the policy
    update_reference()
    # LoRA: the reference holds W + s·BA merged, the policy applies the adapters apart (float32 rounding, ~3e-6)
    torch.testing.assert_close(ref_lp(b1), policy_lp(b1), rtol=0, atol=1e-5)
    moved = ref_lp(b1)
    update(b2)
    torch.testing.assert_close(ref_lp(b1), moved, rtol=0, atol=0)
    assert float((policy_lp(b1) - moved).abs().max()) > 1e-3


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_update_reference_in_process(path, lora):
    over = {"actor.lora_rank": 4, "actor.lora_alpha": 8} if lora else {}
    w = ActorRolloutWorker(_cfg(path, **over))
    b1, b2 = _batch(1), _batch(2)
    _check(w.update_actor, lambda b: w.compute_ref_log_probs(b)["ref_log_probs"],
           lambda b: w.compute_log_probs(b)["old_log_probs"], w.init_reference, w.update_reference, b1, b2)
    assert all(not p.requires_grad for p in w.ref_module.parameters())  # still a frozen copy, not the policy


@pytest.mark.slow  # two Ray workers under FSDP with LoRA (~35 s)
def test_two_ray_workers_fsdp_lora_update_reference_and_sum_pi_squared(path):
    """The reference update under FSDP2 with LoRA; then Σπ² of the old-log-prob pass (optimal_token_baseline), which
    runs inside the FSDP2 root forward, equals one worker's on the same weights."""
    ray = pytest.importorskip("ray")
    from portrl.device import get_backend
    from portrl.workers.group import WorkerGroup
    from portrl.workers.ray_env import init_ray

    cfg = _cfg(path, **{"actor.lora_rank": 4, "actor.lora_alpha": 8, "actor.lora_target_modules": ["q_proj", "v_proj"],
                        "algorithm.adv_estimator": "optimal_token_baseline"})
    init_ray(cfg, get_backend("cpu"), num_cpus=2)
    group = WorkerGroup(ActorRolloutWorker, cfg, 2, get_backend("cpu"), role="actor_ref_update")
    try:
        assert group.gather("__getattribute__", "strategy") == ["fsdp", "fsdp"]
        b1, b2 = _batch(3), _batch(4)
        _check(lambda b: group.metrics("update_actor", b),
               lambda b: group.concat("compute_ref_log_probs", b)["ref_log_probs"],
               lambda b: group.concat("compute_log_probs", b)["old_log_probs"],
               lambda: group.run("init_reference"),
               lambda: group.run("update_reference"),  # a collective: both ranks gather the shards
               b1, b2)
        one = ActorRolloutWorker(cfg)
        one.load_state_dict(group.rank0("state_dict"))
        got, want = group.concat("compute_log_probs", b1), one.compute_log_probs(b1)
        assert float(want["sum_pi_squared"][b1["response_mask"].bool()].min()) > 0
        torch.testing.assert_close(got["sum_pi_squared"], want["sum_pi_squared"], rtol=1e-5, atol=1e-7)
    finally:
        group.shutdown()
        ray.shutdown()
