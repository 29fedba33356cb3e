"""The mini-batch sizes follow a data.train_batch_size the user set (portrl/config/batch_follow.py); sizes the
user set that conflict are refused with the key to set and a valid value."""

import pytest

from portrl.config import compose
from portrl.config.batch_follow import batch_problem, mini_batch_for
from portrl.config.composition import key_origins
from portrl.config.presets import ConfigError


def test_the_mini_batch_follows_the_users_batch():
    cfg = compose(overrides=["data.train_batch_size=4"])  # the default run: tiny model, 64 / 64
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size) == (4, 4)
    assert any(s.startswith("following data.train_batch_size=4") for s, _, _ in
               key_origins(cfg).entries["actor.ppo_mini_batch_size"])
    gsm = compose(model="qwen2.5-0.5b", data="gsm8k", overrides=["data.train_batch_size=32"])  # 1024 / 256: 4 steps
    assert gsm.actor.ppo_mini_batch_size == 8
    assert compose(overrides=["data.train_batch_size=96"]).actor.ppo_mini_batch_size == 96  # one step, as the preset
    assert compose().actor.ppo_mini_batch_size == 64  # no batch set: the presets' sizes unchanged


def test_a_prm_mini_batch_follows_and_a_users_mini_batch_is_kept():
    cfg = compose(algorithm="prime", overrides=["reward_model.mini_batch_size=32", "actor.ppo_mini_batch_size=16"])
    assert cfg.reward_model.mini_batch_size == 32  # no batch of the user's: nothing follows
    kept = compose(overrides=["data.train_batch_size=8", "actor.ppo_mini_batch_size=2"])
    assert kept.actor.ppo_mini_batch_size == 2


def test_conflicting_sizes_the_user_set_name_the_key_and_a_valid_value():
    with pytest.raises(ConfigError) as err:
        compose(overrides=["data.train_batch_size=4", "actor.ppo_mini_batch_size=3"])
    assert "set actor.ppo_mini_batch_size=2 (a divisor of 4) or data.train_batch_size=6" in str(err.value)
    with pytest.raises(ConfigError, match="actor.ppo_mini_batch_size=48 .* or data.train_batch_size=128"):
        compose(overrides=["data.train_batch_size=96", "actor.ppo_mini_batch_size=64"])


def test_batch_problem_and_mini_batch_for():
    assert batch_problem(8, 4) is None and batch_problem(4, 64) is not None
    assert "actor.ppo_mini_batch_size=4 (a divisor of 4) or data.train_batch_size=64" in batch_problem(4, 64)
    assert mini_batch_for(4, 1) == 4 and mini_batch_for(32, 4) == 8
    assert mini_batch_for(45, 4) == 15  # 3 or 5 steps are as close to 4: the larger mini-batch


def test_train_with_a_small_batch_is_not_refused_for_its_mini_batch(tmp_path):
    from portrl.cli import main

    # the config part of `portrl train data.train_batch_size=4`: config show composes and validates the same way
    assert main(["config", "show", "data.train_batch_size=4", f"trainer.output_dir={tmp_path}"]) == 0
