"""Preset precedence (portrl/config/preset_layers.py): a later preset replaces an earlier one's value except for
the keys a preset keeps (SPIN's, online DPO's and PRIME's rollout.n over the model preset's), the command line
always wins, and `portrl config show` says where a key set by several layers came from."""

import pytest

from portrl.config import compose
from portrl.config.composition import key_origins
from portrl.config.preset_layers import Origins
from portrl.config.presets import ConfigError


@pytest.mark.parametrize("algorithm,n", [("spin", 2), ("online_dpo", 2), ("prime", 4)])
def test_an_algorithms_kept_rollout_n_wins_over_the_model_preset(algorithm, n):
    assert compose(algorithm=algorithm).rollout.n == n  # the tiny model preset sets 8
    assert compose(algorithm=algorithm, overrides=["rollout.n=6"]).rollout.n == 6  # the command line wins


def test_a_preset_without_keep_is_replaced_by_a_later_one():
    assert compose(algorithm="grpo").rollout.n == 8  # grpo's 5 is the recipe's; the tiny default run's 8 holds
    assert compose(algorithm="dapo").rollout.n == 8


def test_config_show_names_where_rollout_n_came_from(capsys):
    from portrl.cli import main

    assert main(["config", "show", "algorithm=spin"]) == 0
    out = capsys.readouterr().out
    assert ("#   rollout.n: 2 (configs/algorithm/spin.yaml, keep); configs/model/tiny.yaml set 8 (held off by keep)"
            in out)
    assert main(["config", "show", "algorithm=grpo"]) == 0
    assert "#   rollout.n: 8 (configs/model/tiny.yaml); configs/algorithm/grpo.yaml set 5" in capsys.readouterr().out
    origins = key_origins(compose(algorithm="prime", overrides=["rollout.n=6"]))
    assert [s for s, _, _ in origins.entries["rollout.n"]] == [
        "configs/algorithm/prime.yaml", "configs/model/tiny.yaml", "override rollout.n=6"]


def test_keep_must_name_keys_the_preset_sets():
    with pytest.raises(ConfigError, match="keep names rollout.n, which the preset does not set"):
        Origins().preset({"actor": {"clip_ratio": 0.2}, "keep": ["rollout.n"]}, "mine.yaml")
    origins = Origins()
    origins.preset({"rollout": {"n": 2, "temperature": 1.0}, "keep": "rollout.n"}, "a.yaml")
    assert origins.preset({"rollout": {"n": 8, "top_p": 0.9}}, "b.yaml") == {"rollout": {"top_p": 0.9}}
