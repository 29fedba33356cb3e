"""An algorithm option set away from its default for an algorithm that does not take it is refused (issue 59 item 2).

``algorithm.sppo_eta``, ``algorithm.dpo_beta``, ``algorithm.lam`` or ``actor.policy_loss.dro_beta`` with GRPO, or a
plugin's option with another estimator, would train without a word and be recorded in the run's identity as if it
mattered: ``portrl train`` stops at the config check, one line naming the option, the chosen algorithm and the ones
that take it, exit code 2. A value equal to the default passes (verl's full YAML files carry every key), and so does
every shipped preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from portrl.algo import EstimatorSpec, option, register_estimator
from portrl.algo.registry import ADV_ESTIMATORS
from portrl.cli import main
from portrl.config import ConfigError, compose

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs" / "algorithm").glob("*.yaml"))


@pytest.fixture
def no_heavy_work(monkeypatch, tmp_path):
    """A model load fails the test: a refused option must stop the run before any."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("heavy work started: a model load was reached")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PORTRL_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("overrides, phrase", [
    (["algorithm.sppo_eta=2.0"], "algorithm.sppo_eta only applies to the objectives that take it (sppo), not "
                                 "'policy_gradient': its value 2.0 would be ignored (leave it at its default, 1.0"),
    (["algorithm.dpo_beta=0.3"], "algorithm.dpo_beta only applies to the objectives that take it (dpo), not "
                                 "'policy_gradient'"),
    (["algorithm.lam=0.5"], "algorithm.lam only applies to the estimators that take it (gae, vapo_gae, vcppo_gae), "
                            "not 'grpo'"),
    (["algorithm.gamma=0.9"], "algorithm.gamma only applies to the estimators that take it (gae, reinforce_plus_plus, "
                              "vapo_gae, vcppo_gae), not 'grpo'"),
    (["algorithm=rloo", "algorithm.norm_adv_by_std_in_grpo=false"],
     "algorithm.norm_adv_by_std_in_grpo only applies to the estimators that take it (gdpo, grpo, grpo_passk, "
     "grpo_vectorized), not 'rloo'"),
    (["actor.policy_loss.dro_beta=0.1"], "actor.policy_loss.dro_beta only applies to the policy losses that take it "
                                         "(dro), not 'vanilla': its value 0.1 would be ignored (leave it at its "
                                         "default, null"),
    (["actor.tau_neg=2"], "actor.tau_neg only applies to the policy losses that take it (sapo), not 'vanilla'"),
    (["algorithm=sppo", "algorithm.lam=0.5"], "algorithm.lam only applies to the estimators that take it (gae, "
                                              "vapo_gae, vcppo_gae), and algorithm.objective='sppo' uses none"),
    (["algorithm=online_dpo", "actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta=0.1"],
     "actor.policy_loss.dro_beta only applies to the policy losses that take it (dro), and algorithm.objective='dpo' "
     "uses none"),
    (["algorithm=ppo", "algorithm.reward_gt_coef=1"], "algorithm.reward_gt_coef only applies to the estimators that "
                                                      "take it (prime), not 'gae'"),
])
def test_an_option_the_algorithm_does_not_take_stops_the_run(overrides, phrase, no_heavy_work, capsys):
    rc = main(["--log-level", "WARNING", "train", *overrides, "device.num_threads=1", "trainer.progress_bar=false"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip() and " WARNING " not in line]
    assert len(lines) == 1 and lines[0].startswith("portrl train: error: ") and "Traceback" not in err, err
    assert phrase in err, err


@pytest.mark.parametrize("overrides", [
    # every option at its default, with GRPO (verl's full YAML files carry them all)
    ["algorithm.sppo_eta=1.0", "algorithm.dpo_beta=0.1", "algorithm.lam=1", "algorithm.gamma=1.0",
     "actor.policy_loss.dro_beta=null", "actor.tau_pos=1.0", "actor.sppo_eta=1.0", "algorithm.reward_dpo_coef=5",
     "algorithm.lam_actor=null", "algorithm.gdpo_reward_keys=null", "actor.policy_loss.clip_cov_ratio=0.0002"],
    # set away from the default for the algorithm that takes it
    ["algorithm=sppo", "algorithm.sppo_eta=2.0", "actor.sppo_eta=0.5"],
    ["algorithm=online_dpo", "algorithm.dpo_beta=0.3"],
    ["algorithm=ppo", "algorithm.lam=0.95", "algorithm.gamma=0.99", "algorithm.lam_actor=0.9"],
    ["actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta=0.1"],
    ["algorithm=sapo", "actor.tau_neg=2"],
    ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.9"],
    ["algorithm=dr_grpo"],  # norm_adv_by_std_in_grpo=false with grpo
])
def test_defaults_and_the_taken_options_pass(overrides):
    compose(overrides=overrides)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_algorithm_preset_passes(preset, capsys):
    """``portrl config show algorithm=X``: no preset sets an option its algorithm does not take."""
    assert main(["--log-level", "WARNING", "config", "show", f"algorithm={preset}"]) == 0, capsys.readouterr().err


def test_a_plugin_option_of_an_estimator_not_chosen_is_refused(monkeypatch):
    """A plugin's option counts as the built-ins' do: refused with grpo, its default passes, its estimator takes it."""
    monkeypatch.setattr(ADV_ESTIMATORS, "_fns", dict(ADV_ESTIMATORS._fns))

    @dataclass
    class HorizonOptions:
        horizon_decay: float = option(0.5, ge=0.0, le=1.0)

    def decayed(token_level_rewards, response_mask, horizon_decay=0.5):
        return token_level_rewards * horizon_decay, token_level_rewards

    register_estimator(EstimatorSpec("decayed_for_apply", decayed, options=HorizonOptions))
    with pytest.raises(ConfigError, match=r"algorithm.horizon_decay only applies to the estimators that take it "
                                          r"\(decayed_for_apply\), not 'grpo'"):
        compose(overrides=["algorithm.horizon_decay=0.25"])
    compose(overrides=["algorithm.horizon_decay=0.5"])
    cfg = compose(overrides=["algorithm.adv_estimator=decayed_for_apply", "algorithm.horizon_decay=0.25"])
    assert cfg.algorithm.horizon_decay == 0.25
