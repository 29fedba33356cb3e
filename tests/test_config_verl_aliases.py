"""verl's names of the mesh sizes and memory levers (portrl/config/verl_aliases.py): accepted in overrides and in a user's YAML as
their portrl keys, listed in the configuration reference, and every other verl key is still refused."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from portrl.config import ConfigError, compose
from portrl.config.composition import explicit_keys
from portrl.config.reference_text import VERL_NAMES
from portrl.config.verl_aliases import ALIASES, rewrite


#: a value of each alias's type (2 elsewhere)
VALUES = {"model.gradient_checkpointing": True, "rollout.gpu_memory_utilization": 0.4,
          **{key: True for key in ALIASES.values() if "offload" in key}}


@pytest.mark.parametrize("alias, key", ALIASES.items())
def test_each_verl_name_sets_its_portrl_key(alias, key):
    value = VALUES.get(key, 2)
    cfg = compose(overrides=[f"{alias}={str(value).lower()}"], check=False)
    assert OmegaConf.select(cfg, key) == value
    assert key in explicit_keys(cfg)  # the user set it: later steps tell it from a preset's value
    assert VERL_NAMES[key] == alias  # the reference's verl column names it


def test_a_yaml_file_in_verls_layout(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    ulysses_sequence_parallel_size: 2\n    fsdp_config:\n"
                    "      fsdp_size: 2\n    megatron:\n      tensor_model_parallel_size: 2\ncritic:\n"
                    "  ulysses_sequence_parallel_size: 2\n  model:\n    fsdp_config:\n      fsdp_size: 4\n")
    cfg = compose(config_file=path, overrides=["trainer.num_workers=8"])
    a, c = cfg.actor, cfg.critic
    assert (a.tensor_parallel_size, a.sequence_parallel_size, a.fsdp_size) == (2, 2, 2)
    assert (c.sequence_parallel_size, c.fsdp_size) == (2, 4)


def test_the_same_value_twice_is_accepted_and_a_later_layer_wins(tmp_path):
    cfg = compose(overrides=["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                             "actor.sequence_parallel_size=2"])
    assert cfg.actor.sequence_parallel_size == 2
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  sequence_parallel_size: 4\n")  # an override over the file, as for any key
    cfg = compose(config_file=path, overrides=["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    assert cfg.actor.sequence_parallel_size == 2


def test_two_values_for_one_key_are_one_line_of_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        compose(overrides=["critic.megatron.tensor_model_parallel_size=2", "critic.tensor_parallel_size=1"])
    assert str(info.value) == ("override critic.megatron.tensor_model_parallel_size=2 (verl's name for "
                               "critic.tensor_parallel_size) and override critic.tensor_parallel_size=1 set it to two "
                               "values; give one of them")
    path = tmp_path / "both.yaml"
    path.write_text("reward_model:\n  model:\n    fsdp_size: 2\n    fsdp_config:\n      fsdp_size: 4\n")
    with pytest.raises(ConfigError, match=r"both\.yaml: reward_model\.model\.fsdp_config\.fsdp_size=4 \(verl's name "
                                          r"for reward_model\.model\.fsdp_size\) and reward_model\.model\.fsdp_size=2 "
                                          r"set it to two values; give one of them$"):
        compose(config_file=path)


def test_other_verl_keys_are_still_unknown(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'actor_rollout_ref'"):
        compose(overrides=["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"])
    path = tmp_path / "mixed.yaml"  # a known alias beside an unknown key of the same group
    path.write_text("critic:\n  ulysses_sequence_parallel_size: 2\n  model:\n    fsdp_config:\n      wrap_policy: {}\n")
    with pytest.raises(ConfigError, match="unknown config key 'critic.model'"):
        compose(config_file=path)


def test_rewrite_leaves_its_input_alone():
    data = {"actor_rollout_ref": {"actor": {"ulysses_sequence_parallel_size": 2}}, "trainer": {"total_steps": 3}}
    out, moved = rewrite(data, "x.yaml")
    assert out == {"trainer": {"total_steps": 3}, "actor": {"sequence_parallel_size": 2}}
    assert moved == {"actor.sequence_parallel_size": "actor_rollout_ref.actor.ulysses_sequence_parallel_size"}
    assert data["actor_rollout_ref"]["actor"]["ulysses_sequence_parallel_size"] == 2
    assert rewrite([1, 2], "x.yaml") == ([1, 2], {})  # not a mapping: check_keys reports it
