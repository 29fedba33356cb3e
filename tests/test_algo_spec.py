"""The algorithm spec (portrl/algo/spec.py): the built-in records say what each estimator / objective needs, the
config checks and the trainer read them, and an estimator registered from outside the package trains."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from portrl.algo import (EstimatorSpec, UnknownNameError, algorithm_spec, compute_advantage, critic_enabled,
                         estimator_spec, get_adv_estimator, objective_spec, online_dpo_preference, reference_enabled,
                         register_estimator, registered, sppo_advantage)
from portrl.algo.registry import ADV_ESTIMATORS
from portrl.cli import main
from portrl.config import ConfigError, compose
from portrl.config.options_schema import default_config
from portrl.trainer.advantage_phase import compute_batch_advantages
from portrl.workers.batch import Batch

# tests/test_cli_commands.py SMALL: the tiny model and batch shape
SMALL = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=64", "data.arith.num_test=8",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
         "model.sft_steps=4", "model.sft_batch_size=8", "trainer.progress_bar=false"]

GAE_FAMILY = {"gae", "vcppo_gae", "vapo_gae"}
GROUPED = {"grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline", "grpo_vectorized",
           "rloo_vectorized", "gdpo", "prime"}
OLD_LOG_PROBS = {"optimal_token_baseline", "tir_optimal_token_baseline"}


def _cfg(**over):
    cfg = default_config()
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def test_builtin_estimator_records():
    names = set(registered("adv_estimator"))
    assert names >= GAE_FAMILY | GROUPED | OLD_LOG_PROBS | {"reinforce_plus_plus", "remax"}
    for name in names:
        spec = estimator_spec(name)
        assert spec.name == name and get_adv_estimator(name) is spec.fn
        assert spec.needs_critic == (name in GAE_FAMILY), name
        assert spec.needs_groups == (name in GROUPED), name
        assert spec.needs_greedy_baseline == (name == "remax"), name
        assert spec.needs_old_log_probs == (name in OLD_LOG_PROBS), name
        assert spec.needs_sum_pi_squared == (name in OLD_LOG_PROBS), name  # the optimal-token baselines
        assert not spec.needs_reference
        assert spec.needs_implicit_rewards == (name == "prime"), name
    assert estimator_spec("gae").per_token_rewards and not estimator_spec("grpo").per_token_rewards
    assert estimator_spec("gae").takes("lam_actor") and not estimator_spec("vapo_gae").takes("lam_actor")


def test_resolved_algorithm_records():
    grpo = algorithm_spec(_cfg().algorithm)
    assert grpo.estimator.name == "grpo" and grpo.needs_groups and not grpo.needs_critic
    assert not (grpo.needs_reference or grpo.needs_old_log_probs or grpo.needs_pairs or grpo.needs_greedy_baseline)
    assert algorithm_spec(_cfg(**{"algorithm.adv_estimator": "gae"}).algorithm).needs_critic
    assert algorithm_spec(_cfg(**{"algorithm.adv_estimator": "remax"}).algorithm).needs_greedy_baseline
    kl = algorithm_spec(_cfg(**{"algorithm.use_kl_in_reward": True}).algorithm)
    assert kl.needs_reference and kl.needs_old_log_probs
    # dpo: its own advantages (pairs); the estimator does not count, not even a critic one
    dpo = algorithm_spec(_cfg(**{"algorithm.objective": "dpo", "algorithm.adv_estimator": "gae"}).algorithm)
    assert dpo.estimator is None and dpo.needs_pairs and dpo.needs_reference and not dpo.needs_critic
    free = _cfg(**{"algorithm.objective": "dpo", "algorithm.dpo_reference_free": True})
    assert not algorithm_spec(free.algorithm).needs_reference and not reference_enabled(free)
    sppo = algorithm_spec(_cfg(**{"algorithm.objective": "sppo", "algorithm.adv_estimator": "remax"}).algorithm)
    assert not sppo.needs_groups and not sppo.needs_greedy_baseline and not sppo.needs_pairs  # n=1: batch-wide
    # the explicit switches win over the record; the KL loss needs the reference
    assert critic_enabled(_cfg(**{"algorithm.adv_estimator": "gae"}))
    assert not critic_enabled(_cfg(**{"algorithm.adv_estimator": "gae", "critic.enable": False}))
    assert critic_enabled(_cfg(**{"critic.enable": True}))
    assert reference_enabled(_cfg(**{"actor.use_kl_loss": True})) and not reference_enabled(_cfg())
    assert not reference_enabled(_cfg(**{"actor.use_kl_loss": True, "ref.enable": False}))


def test_unknown_names_are_one_line_listing_the_registered_ones():
    with pytest.raises(UnknownNameError) as e:
        estimator_spec("nosuch")
    assert str(e.value) == f"unknown adv_estimator 'nosuch'; registered: {', '.join(registered('adv_estimator'))}"
    with pytest.raises(UnknownNameError, match=r"^unknown objective 'ppo'; registered: dpo, policy_gradient, sppo$"):
        objective_spec("ppo")
    with pytest.raises(ConfigError) as e:
        compose(overrides=["algorithm.adv_estimator=nosuch", "algorithm.objective=nosuch"])
    text = str(e.value)
    assert (f"algorithm.adv_estimator='nosuch' is not a registered adv_estimator; registered: "
            f"{', '.join(registered('adv_estimator'))}\n") in text + "\n"
    assert "algorithm.objective='nosuch' is not a registered objective; registered: dpo, policy_gradient, sppo" in text


def test_unknown_estimator_through_the_cli(capsys):
    assert main(["--log-level", "WARNING", "train", "algorithm.adv_estimator=nosuch"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.adv_estimator='nosuch' is not a registered adv_estimator; registered: gae, " in err
    assert "Traceback" not in err


@pytest.mark.parametrize("over, message", [
    (["algorithm=rloo", "rollout.n=1"], "algorithm.adv_estimator='rloo' compares responses within a prompt group"),
    (["algorithm=online_dpo", "rollout.n=3"], "algorithm.objective='dpo' pairs sampled responses: rollout.n must be "
                                              "even (got 3)"),
    (["algorithm.adv_estimator=vapo_gae", "algorithm.lam_actor=0.9"],
     "algorithm.lam_actor only applies to the estimators that take it (gae, vcppo_gae), not 'vapo_gae'"),
    (["algorithm.lam_critic=1.0"], "algorithm.lam_critic only applies to the estimators that take it "
                                   "(gae, vapo_gae, vcppo_gae), not 'grpo'"),
    (["algorithm=ppo", "critic.enable=false"], "critic.enable=false, but algorithm.adv_estimator='gae' reads the "
                                               "critic's values"),
    (["algorithm=online_dpo", "ref.enable=false"], "ref.enable=false, but the reference policy is needed"),
    (["critic.pretrain_steps=3"], "pretrains a critic, but none runs: set critic.enable=true or use an estimator "
                                  "with a critic (gae, vapo_gae, vcppo_gae)"),
])
def test_config_checks_read_the_records(over, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides=over)
    assert message in str(e.value)


def _phase_batch(n_prompts=3, n=2, length=4):
    g = torch.Generator().manual_seed(0)
    rows = n_prompts * n
    mask = torch.ones(rows, length)
    mask[0, 3:] = 0
    rewards = torch.zeros(rows, length)
    rewards[:, 2] = torch.randint(0, 3, (rows,), generator=g).float()
    uid = [f"p{i // n}" for i in range(rows)]
    return Batch({"token_level_rewards": rewards, "response_mask": mask}, meta={"uid": uid})


def test_advantage_phase_keeps_the_numbers():
    """The phase through the records gives exactly what the algorithm functions give."""
    b = _phase_batch()
    t = b.tensors
    cfg = _cfg(**{"rollout.n": 2})
    compute_batch_advantages(cfg, b)
    want, _ = compute_advantage("grpo", token_level_rewards=t["token_level_rewards"], response_mask=t["response_mask"],
                                index=b.meta["uid"])
    assert torch.equal(t["advantages"], want.float()) and torch.equal(t["returns"], want.float())

    b = _phase_batch()
    compute_batch_advantages(_cfg(**{"algorithm.objective": "sppo", "algorithm.sppo_eta": 0.5, "rollout.n": 2}), b)
    t = b.tensors
    adv = sppo_advantage(t["token_level_rewards"].sum(-1), beta=0.5, index=b.meta["uid"]).float()
    assert torch.equal(t["advantages"], adv[:, None] * t["response_mask"])
    # one response per prompt (verl's SPPO recipe): the soft mean over the whole batch, not groups of one
    b = _phase_batch()
    b.meta["uid"] = [str(i) for i in range(len(b))]
    compute_batch_advantages(_cfg(**{"algorithm.objective": "sppo", "algorithm.sppo_eta": 0.5, "rollout.n": 1}), b)
    t = b.tensors
    adv = sppo_advantage(t["token_level_rewards"].sum(-1), beta=0.5).float()
    assert torch.equal(t["advantages"], adv[:, None] * t["response_mask"]) and bool(adv.abs().sum() > 0)

    b = _phase_batch()
    m = compute_batch_advantages(_cfg(**{"algorithm.objective": "dpo", "rollout.n": 2}), b)
    t = b.tensors
    assert torch.equal(t["dpo_chosen"], online_dpo_preference(t["token_level_rewards"], t["response_mask"]))
    s = (t["token_level_rewards"] * t["response_mask"]).sum(-1).reshape(-1, 2)
    assert torch.equal(t["dpo_valid"], (s[:, 0] != s[:, 1]).repeat_interleave(2))
    assert m == {"actor/dpo_valid_pairs": float(t["dpo_valid"].float().mean())}


def test_registering_is_explicit_and_safe(monkeypatch):
    monkeypatch.setattr(ADV_ESTIMATORS, "_fns", dict(ADV_ESTIMATORS._fns))  # this test's registrations go away
    spec = estimator_spec("grpo")
    assert register_estimator(spec) is spec  # the same record again: a no-op
    with pytest.raises(ValueError, match="'grpo' is already registered to portrl.algo.advantages_outcome"):
        register_estimator(EstimatorSpec("grpo", spec.fn, needs_critic=True))
    with pytest.raises(TypeError, match="takes an EstimatorSpec"):
        register_estimator(spec.fn)


# -------------------------------------------------------------- an estimator from outside the package
CALLS: list = []


def td0_advantage(token_level_rewards, values, response_mask, gamma=1.0):
    """TD(0): ``A_t = r_t + γ V_{t+1} − V_t`` over the valid tokens, target ``r_t + γ V_{t+1}``."""
    m = response_mask.to(values.dtype)
    v = values * m
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    returns = (token_level_rewards + gamma * next_v) * m
    CALLS.append((tuple(values.shape), gamma))
    return (returns - v) * m, returns


def test_an_outside_estimator_with_a_critic_trains(tmp_path, monkeypatch, capsys):
    """One registration call, no change inside portrl: the config check accepts the name, the trainer starts
    the critic because the record says so, and two steps train with it."""
    monkeypatch.setattr(ADV_ESTIMATORS, "_fns", dict(ADV_ESTIMATORS._fns))
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    register_estimator(EstimatorSpec("td0", td0_advantage, needs_critic=True, per_token_rewards=True))
    CALLS.clear()
    out = tmp_path / "run"
    assert main(["--log-level", "WARNING", "train", *SMALL, "algorithm.adv_estimator=td0", "algorithm.gamma=0.9",
                 "trainer.total_steps=2", "trainer.test_freq=0", "trainer.val_before_train=false",
                 "model.sft_warm_start=false", "trainer.export_hf=false", "trainer.plot=false",
                 f"trainer.output_dir={out}"]) == 0, capsys.readouterr().err
    assert CALLS == [((8, 4), 0.9), ((8, 4), 0.9)]  # 4 prompts x 2 samples, 4 response tokens; once a step
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in ("critic/vf_loss", "critic/values/mean", "timing_s/values", "timing_s/update_critic",
                    "actor/pg_loss"):
            assert key in r, key


def test_a_record_gets_what_it_declares(monkeypatch):
    """An estimator that declares the reference gets ``ref_log_probs``; the run starts the reference for it."""
    monkeypatch.setattr(ADV_ESTIMATORS, "_fns", dict(ADV_ESTIMATORS._fns))
    seen = {}

    def ref_gap(token_level_rewards, response_mask, ref_log_probs):
        seen["ref"] = ref_log_probs
        return token_level_rewards - ref_log_probs, token_level_rewards

    register_estimator(EstimatorSpec("ref_gap", ref_gap, needs_reference=True))
    cfg = _cfg(**{"algorithm.adv_estimator": "ref_gap", "rollout.n": 2})
    assert reference_enabled(cfg) and not critic_enabled(cfg)
    b = _phase_batch()
    b["ref_log_probs"] = -torch.ones(len(b), 4)
    compute_batch_advantages(cfg, b)
    assert seen["ref"] is b.tensors["ref_log_probs"]
    assert torch.equal(b.tensors["advantages"], b.tensors["token_level_rewards"] + 1)
