"""The trained-model component (portrl/workers/trained_model.py) and PRIME's mode records (portrl/workers/prm_modes.py):
actor, critic and implicit PRM are built on one TrainedModel and round-trip their state; the update / loss records
decide what the phase runs. The PRM's sharded checkpoint over two FSDP2 Ray workers is tested with the others, in
tests/test_checkpoint_shards.py."""

import os

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.workers.prm_modes import PRM_LOSSES, PRM_UPDATES, prm_mode  # noqa: E402


def test_the_records_are_the_config_choices_and_decide_the_phase():
    from portrl.config.checks import CHOICES

    assert tuple(PRM_UPDATES) == CHOICES["reward_model.model.update"]
    assert tuple(PRM_LOSSES) == CHOICES["reward_model.model.loss_type"]
    # (update, loss) -> scored before the update, trains, scored after (verl's orders)
    want = {("before", "ce"): (False, True, True), ("before", "dpo"): (True, True, True),
            ("after", "ce"): (True, True, False), ("after", "dpo"): (True, True, False),
            ("none", "ce"): (True, False, False), ("none", "dpo"): (True, False, False)}
    for (update, loss), expected in want.items():
        mode = prm_mode({"update": update, "loss_type": loss})
        assert (mode.scores_before_update, mode.update.trains, mode.update.score_last) == expected, (update, loss)
    assert prm_mode({"update": "after", "loss_type": "dpo"}).loss.metric == "reward_model/dpo_loss"
    with pytest.raises(ValueError, match=r"reward_model.model.update='sometimes' is unknown; valid: \['before'"):
        prm_mode({"update": "sometimes", "loss_type": "ce"})
    with pytest.raises(ValueError, match=r"loss_type='mse' is unknown; valid: \['ce', 'dpo'\]"):
        prm_mode({"update": "before", "loss_type": "mse"})


def test_the_dpo_record_reads_the_groups_other_side():
    """The loss records compute what portrl.algo.implicit_prm's functions compute, from a micro-batch's tensors."""
    from portrl.algo.implicit_prm import prm_ce_loss, prm_dpo_loss

    g = torch.Generator().manual_seed(0)
    q, mask = torch.randn(4, 3, generator=g), torch.ones(4, 3)
    acc, others = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.randn(4, generator=g)
    dpo, ce = PRM_LOSSES["dpo"], PRM_LOSSES["ce"]
    assert torch.equal(dpo.row_loss(q, acc, {"prm_dpo_others": others}, mask, 0.5),
                       prm_dpo_loss(q, acc, others, mask, 0.5))
    assert torch.equal(ce.row_loss(q, acc, {}, mask, 0.5), prm_ce_loss(q, acc, mask, 0.5))
    assert dpo.needs_prior_scores and not ce.needs_prior_scores


def test_one_worker_of_each_kind_trains_one_trained_model(tmp_path):
    """Actor, critic and PRM hold a TrainedModel (masters, optimizer, schedule from their own optim section) and
    answer the same checkpoint methods; a state written by one loads into a fresh one exactly."""
    from portrl.models import write_tiny_model
    from portrl.workers.actor import ActorRolloutWorker
    from portrl.workers.critic import CriticWorker
    from portrl.workers.implicit_prm import ImplicitPRMWorker
    from portrl.workers.trained_model import TrainedModel

    path = str(write_tiny_model(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                intermediate_size=64, seed=0))
    cfg = default_config()
    for k, v in {"device.name": "cpu", "device.num_threads": 1, "model.path": path, "actor.optim.lr": 1e-3,
                 "critic.optim.lr": 2e-3, "reward_model.model.optim.lr": 3e-3, "trainer.total_steps": 5}.items():
        OmegaConf.update(cfg, k, v)
    for cls, lr in ((ActorRolloutWorker, 1e-3), (CriticWorker, 2e-3), (ImplicitPRMWorker, 3e-3)):
        w = cls(cfg)
        assert isinstance(w.trained, TrainedModel) and w.module is w.trained.module and w.train_module is w.module
        assert w.optimizer.param_groups[0]["lr"] == lr and not w.sharded_checkpoint() and w.weights_finite()
        with torch.no_grad():
            w.master.masters[0].add_(1.0)
        w.master.masters_to_params()
        state = w.state_dict()
        assert {"model", "optimizer", "scheduler"} <= set(state)
        fresh = cls(cfg)
        fresh.load_state_dict(state)
        assert all(torch.equal(a, b) for a, b in zip(fresh.master.masters, w.master.masters))
