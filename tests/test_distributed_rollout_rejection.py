"""Rollout correction's rejection sampling over 2 Ray workers (gloo, FSDP2): each rank masks its own rows, the
loss's global token counts leave the rejected tokens out on every rank, and the ``rollout_corr/*`` metrics are
the ones of 1 worker on the whole batch (partial sums and extremes combined over the ranks)."""

import os

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ray = pytest.importorskip("ray")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.device import get_backend  # noqa: E402
from portrl.workers.actor import ActorRolloutWorker  # noqa: E402
from portrl.workers.batch import Batch, build_rollout_batch  # noqa: E402
from portrl.workers.group import WorkerGroup  # noqa: E402
from portrl.workers.ray_env import init_ray  # noqa: E402


def _cfg(path):
    cfg = default_config()
    for k, v in {"device.name": "cpu", "device.num_threads": 1, "model.path": path, "rollout.n": 4,
                 "data.max_response_length": 6, "actor.ppo_mini_batch_size": 4,
                 "actor.ppo_micro_batch_size_per_device": 3, "actor.optim.lr": 1e-2, "actor.optim.eps": 1.0,
                 "algorithm.rollout_correction.rollout_rs": "token",
                 "algorithm.rollout_correction.rollout_rs_threshold": 2.0,
                 "algorithm.rollout_correction.rollout_token_veto_threshold": 1e-3}.items():
        OmegaConf.update(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from portrl.models import write_tiny_model

    p = str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=2, num_heads=2,
                             num_kv_heads=1, intermediate_size=64, seed=0, initializer_range=0.2))
    init_ray(_cfg(p), get_backend("cpu"), num_cpus=4)
    yield p
    ray.shutdown()


def _batch(ref: ActorRolloutWorker) -> Batch:
    """Random tokens, the proximal log-probs of ``ref``, and rollout log-probs that differ on chosen tokens: the first
    response token of every row is e times likelier under the rollout policy (ratio e^-1: rejected by [1/2, 2]),
    and row 5's last token is 10^4 times likelier (below the veto 10^-3: row 5 rejected whole)."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 30, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(4)]
    resp = [torch.randint(3, 30, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
            for _ in range(16)]
    b = build_rollout_batch(prompts, resp, n=4)
    b["advantages"] = torch.randn(len(b), 1, generator=g) * b["response_mask"]
    b.union(Batch({"old_log_probs": ref.compute_log_probs(b)["old_log_probs"]}))
    bump = torch.zeros_like(b["old_log_probs"])
    bump[:, 0] = 1.0
    bump[5, len(resp[5]) - 1] = 4 * float(torch.log(torch.tensor(10.0)))
    b["rollout_log_probs"] = (b["old_log_probs"] + bump) * b["response_mask"]
    return b


@pytest.mark.slow  # 2 Ray workers and gloo (~35 s)
def test_two_workers_reject_and_measure_as_one(path):
    cfg = _cfg(path)
    ref = ActorRolloutWorker(cfg)
    b = _batch(ref)
    group = WorkerGroup(ActorRolloutWorker, cfg, 2, get_backend("cpu"), role="actor")
    try:
        m2 = group.metrics("update_actor", b)
        got = group.full_weights()
    finally:
        group.shutdown()
    m1 = ref.update_actor(b)
    keys = sorted(k for k in m1 if k.startswith("rollout_corr/"))
    assert keys and keys == sorted(k for k in m2 if k.startswith("rollout_corr/"))
    for k in keys:
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    n = float(b["response_mask"].sum())
    rejected = 16 + int(b["response_mask"][5].sum()) - 1  # every first token, and the rest of row 5
    assert m1["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected / n)
    assert m1["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(1 / 16)
    assert m2["actor/pg_loss"] == pytest.approx(m1["actor/pg_loss"], rel=1e-4, abs=1e-6)
    for k, v in ref.named_weights():
        torch.testing.assert_close(got[k], v.detach(), rtol=1e-5, atol=1e-5, msg=k)
