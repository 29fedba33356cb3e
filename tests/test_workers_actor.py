"""ActorRolloutWorker / CriticWorker on a tiny model: rollout layout, exact old-log-prob skip,
micro-batching invariance, critic values and update, state round trip, HF export."""

import copy
import logging

import pytest
import torch
from omegaconf import OmegaConf

from portrl.config.options_schema import default_config
from portrl.workers.actor import ActorRolloutWorker, old_log_probs_needed
from portrl.workers.batch import Batch


def _cfg(path, **over):
    cfg = default_config()
    cfg.device.name = "cpu"
    cfg.device.num_threads = 1
    cfg.model.path = path
    cfg.rollout.n = 4
    cfg.data.max_response_length = 6
    cfg.actor.ppo_mini_batch_size = 4
    cfg.actor.optim.lr = 1e-2
    cfg.actor.optim.eps = 1.0  # Adam's first step is ~lr*sign(g); a large eps makes it ~lr*g, so float noise stays small
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _rollout(worker, n_prompts=4, for_update=False):
    prompts = [worker.tokenizer(f"{i}+{i}=")["input_ids"] for i in range(n_prompts)]
    b = worker.generate(prompts, {"n": 4, "temperature": 1.0, "max_new_tokens": 6, "seed": 1},
                        meta={"uid": [f"p{i}" for i in range(n_prompts)]}, for_update=for_update)
    g = torch.Generator().manual_seed(0)
    b["advantages"] = torch.randn(b["response_mask"].shape, generator=g) * b["response_mask"]
    return b


def _params(w):
    return torch.cat([p.detach().flatten() for p in w.module.parameters()])


def test_generate_layout(tiny_model):
    w = ActorRolloutWorker(_cfg(tiny_model))
    b = _rollout(w)
    assert len(b) == 16 and b["uid"][:5] == ["p0"] * 4 + ["p1"]
    T = b["responses"].shape[1]
    assert 1 <= T <= 6 and b["input_ids"].shape[1] == b["prompts"].shape[1] + T
    lens = b["response_mask"].sum(-1)
    assert torch.equal(b["attention_mask"][:, -T:], b["response_mask"])
    # rollout log-probs of the engine equal the trainer's forward (same weights, same temperature)
    old = w.compute_log_probs(b)["old_log_probs"]
    assert torch.allclose(old * b["response_mask"], b["rollout_log_probs"], atol=1e-4)
    assert (lens > 0).all()


def test_old_log_prob_skip_is_exact(tiny_model):
    cfg = _cfg(tiny_model)
    assert not old_log_probs_needed(cfg, 16)
    assert old_log_probs_needed(cfg, 17)
    assert old_log_probs_needed(_cfg(tiny_model, **{"actor.ppo_epochs": 2}), 16)
    a = ActorRolloutWorker(cfg)
    b = _rollout(a)
    other = ActorRolloutWorker(cfg)
    other.load_state_dict(a.state_dict())
    with_old = Batch(dict(b.tensors), b.meta).union(other.compute_log_probs(b))
    with_old.pop("entropys")
    ma = a.update_actor(b)
    mb = other.update_actor(with_old)
    assert torch.allclose(_params(a), _params(other), atol=1e-6, rtol=0)
    assert ma["actor/pg_loss"] == pytest.approx(mb["actor/pg_loss"], abs=1e-6)
    assert ma["actor/grad_norm"] > 0


def test_micro_batching_does_not_change_the_update(tiny_model):
    base = ActorRolloutWorker(_cfg(tiny_model, **{"actor.ppo_micro_batch_size_per_device": 16}))
    b = _rollout(base)
    for mode in ("token-mean", "seq-mean-token-mean"):
        one = ActorRolloutWorker(_cfg(tiny_model, **{"actor.ppo_micro_batch_size_per_device": 16,
                                                     "actor.loss_agg_mode": mode}))
        many = ActorRolloutWorker(_cfg(tiny_model, **{"actor.ppo_micro_batch_size_per_device": 3,
                                                      "actor.loss_agg_mode": mode}))
        m1, m2 = one.update_actor(b), many.update_actor(b)
        assert torch.allclose(_params(one), _params(many), atol=1e-6), mode
        for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6), (mode, k)


def test_kl_loss_entropy_and_state_roundtrip(tiny_model, tmp_path):
    cfg = _cfg(tiny_model, **{"actor.use_kl_loss": True, "actor.kl_loss_coef": 0.1, "actor.entropy_coeff": 0.01,
                              "actor.ppo_epochs": 2, "actor.optim.warmup_steps": 2})
    w = ActorRolloutWorker(cfg)
    w.init_reference()
    b = _rollout(w)
    b.union(w.compute_log_probs(b)).pop("entropys")
    b.union(w.compute_ref_log_probs(b))
    assert torch.equal(b["ref_log_probs"], b["old_log_probs"])
    m = w.update_actor(b)
    assert 0.0 < m["actor/kl_loss"] < 1e-2  # 0 in epoch 1 (at the reference), small in epoch 2
    assert m["actor/lr"] == pytest.approx(1e-2)  # warm-up step 2 of 2 after one scheduler step
    after = w.compute_ref_log_probs(b)["ref_log_probs"]
    assert torch.equal(after, b["ref_log_probs"])  # the reference is frozen
    state = copy.deepcopy(w.state_dict())
    w2 = ActorRolloutWorker(cfg)
    w2.load_state_dict(state)
    assert torch.equal(_params(w), _params(w2))
    out = w.export_hf(str(tmp_path / "hf"))
    from transformers import AutoModelForCausalLM

    re = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(re.state_dict()["model.embed_tokens.weight"], w.module.state_dict()["model.embed_tokens.weight"])


def test_critic_values_and_update(tiny_model):
    from portrl.workers.critic import CriticWorker

    cfg = _cfg(tiny_model, **{"critic.optim.lr": 1e-2})
    actor = ActorRolloutWorker(cfg)
    b = _rollout(actor)
    c = CriticWorker(cfg)
    v = c.compute_values(b)["values"]
    assert v.shape == b["response_mask"].shape and (v[b["response_mask"] == 0] == 0).all()
    packed_cfg = _cfg(tiny_model, **{"model.use_packing": False})
    c2 = CriticWorker(packed_cfg)
    c2.module.load_state_dict(c.module.state_dict())
    assert torch.allclose(c2.compute_values(b)["values"], v, atol=1e-5)
    b["values"] = v
    b["returns"] = torch.ones_like(v) * b["response_mask"]
    losses = [c.update_critic(b)["critic/vf_loss"] for _ in range(5)]
    assert losses[-1] < losses[0]


def test_update_same_with_and_without_shared_prompts(tiny_model):
    """model.share_prompts only changes how the forward is laid out: the update moves the weights the same."""
    params, metrics = [], []
    for share in (True, False):
        w = ActorRolloutWorker(_cfg(tiny_model, **{"model.share_prompts": share}))
        b = _rollout(w)
        metrics.append(w.update_actor(b))
        params.append(_params(w))
    torch.testing.assert_close(params[0], params[1], atol=1e-6, rtol=1e-5)
    assert metrics[0]["actor/pg_loss"] == pytest.approx(metrics[1]["actor/pg_loss"], abs=1e-6)


@pytest.mark.parametrize("mini", [4, 2], ids=["one-minibatch", "two-minibatches"])
def test_update_same_with_and_without_replayed_rollout_forward(tiny_model, monkeypatch, mini):
    """model.reuse_rollout_forward replays the rollout's matmuls in the first training forward (the weights are
    the rollout's); later mini-batches (after an optimizer step) run the ordinary forward. Same update either way."""
    import portrl.models.forward_tape as forward_tape

    replays = []
    real = forward_tape.replay_hidden_states
    monkeypatch.setattr(forward_tape, "replay_hidden_states", lambda *a: replays.append(1) or real(*a))
    params, metrics = [], []
    for reuse in (True, False):
        w = ActorRolloutWorker(_cfg(tiny_model, **{"model.reuse_rollout_forward": reuse, "actor.ppo_mini_batch_size": mini}))
        b = _rollout(w, for_update=True)
        assert (w._tape is not None) == reuse
        metrics.append(w.update_actor(b))
        assert w._tape is None
        params.append(_params(w))
    assert replays == [1]  # the first mini-batch only: its optimizer step changes the weights
    torch.testing.assert_close(params[0], params[1], atol=1e-6, rtol=1e-5)
    assert metrics[0]["actor/pg_loss"] == pytest.approx(metrics[1]["actor/pg_loss"], abs=1e-6)


def test_checkpointed_update_replays_the_rollout_forward_within_its_byte_budget(tiny_model, monkeypatch):
    """Under gradient checkpointing the rollout is recorded while its tape is at most TAPE_PARAM_MULTIPLE x the
    policy's parameter bytes and TAPE_FREE_FRACTION of the free memory, and the update replays it (same update as
    recomputing); over either budget nothing is recorded and the update recomputes."""
    import portrl.models.forward_tape as forward_tape
    import portrl.workers.tape_budget as budget_module

    replays = []
    real = forward_tape.replay_hidden_states
    monkeypatch.setattr(forward_tape, "replay_hidden_states", lambda *a: replays.append(1) or real(*a))
    params, metrics = [], []
    for reuse in (True, False):
        w = ActorRolloutWorker(_cfg(tiny_model, **{"model.reuse_rollout_forward": reuse, "model.gradient_checkpointing": True}))
        assert w.checkpointing
        b = _rollout(w, for_update=True)
        assert (w._tape is not None) == reuse
        metrics.append(w.update_actor(b))
        params.append(_params(w))
    assert replays == [1]
    torch.testing.assert_close(params[0], params[1], atol=1e-6, rtol=1e-5)
    assert metrics[0]["actor/pg_loss"] == pytest.approx(metrics[1]["actor/pg_loss"], abs=1e-6)
    w = ActorRolloutWorker(_cfg(tiny_model, **{"model.gradient_checkpointing": True}))
    with monkeypatch.context() as m:
        m.setattr(budget_module, "TAPE_PARAM_MULTIPLE", 1e-9)  # a budget below any tape
        _rollout(w, for_update=True)
        assert w._tape is None
    with monkeypatch.context() as m:  # a device with almost no free memory left
        m.setattr(type(w.backend), "memory_available", lambda self: 1000)
        _rollout(w, for_update=True)
        assert w._tape is None
    _rollout(w, for_update=True)
    assert w._tape is not None
    # the free memory counts less what the update will allocate: gradients, and AdamW's moments while the optimizer
    # holds no state (build_optimizer allocates them with the optimizer)
    params = sum(p.numel() * p.element_size() for p in w.module.parameters())
    monkeypatch.setattr(type(w.backend), "memory_available", lambda self: 5 * params)
    assert len(w.optimizer.state) == len(list(w.module.parameters()))
    assert w._tape_budget() == int(min(2 * params, 0.5 * (5 * params - params))) == 2 * params
    w.optimizer.state.clear()
    assert w._tape_budget() == int(min(2 * params, 0.5 * (5 * params - 3 * params))) == params


def test_device_kernels_choose_the_models_op_implementations(tiny_model, caplog):
    """``device.kernels`` is applied when a worker starts: the model's log-prob op is the one named; a name that
    cannot run here is one warning and the backend's order continues (a GPU preset's choice on another host)."""
    from portrl.ops import registry

    try:
        assert ActorRolloutWorker(_cfg(tiny_model)).module.portrl_kernels["logprobs_entropy"] == "vocab_blocks"
        w = ActorRolloutWorker(_cfg(tiny_model, **{"device.kernels": {"logprobs_entropy": "native"}}))
        assert w.module.portrl_kernels["logprobs_entropy"] == "native"
        registry.choose({"logprobs_entropy": "triton"})  # not runnable on this CPU without a GPU
        registry._logged.discard(("cpu", "logprobs_entropy", "triton"))  # warned once per process: maybe earlier
        logger = logging.getLogger("portrl.ops.registry")
        logger.addHandler(caplog.handler)  # directly: an earlier test may have stopped "portrl" propagating
        with caplog.at_level("WARNING", logger="portrl.ops.registry"):
            assert registry.select("logprobs_entropy", backend="cpu")[0] == "vocab_blocks"
        assert "device.kernels.logprobs_entropy=triton cannot run here" in caplog.text
    finally:
        logging.getLogger("portrl.ops.registry").removeHandler(caplog.handler)
        registry.choose({})
