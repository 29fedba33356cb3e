"""Composition order, overrides, shorthand preset selection and error messages of portrl.config."""

import os
import warnings

import pytest

from portrl.config import ConfigError, compose, list_presets, save_yaml, to_yaml


def test_defaults_compose_and_validate():
    cfg = compose()
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.device.name == "auto"


def test_order_presets_then_user_yaml_then_overrides(tmp_path):
    user = tmp_path / "run.yaml"
    user.write_text("actor:\n  clip_ratio_high: 0.3\n  kl_loss_coef: 0.01\ndata:\n  max_response_length: 32\n")
    cfg = compose(preset="h100", algorithm="dapo", model="qwen2.5-0.5b", config_file=user,
                  overrides=["actor.kl_loss_coef=0.002"], check=False)
    assert cfg.actor.clip_ratio_low == 0.2  # algorithm preset
    assert cfg.actor.clip_ratio_high == 0.3  # user YAML beats the preset's 0.28
    assert cfg.actor.kl_loss_coef == 0.002  # override beats the YAML
    assert cfg.model.gradient_checkpointing is True  # the device preset's: the 0.5b model preset leaves it to the device
    assert cfg.actor.optim.lr == 1e-6  # the model preset sets learning rates
    assert cfg.device.preset == "h100" and cfg.device.name == "cuda" and cfg.algorithm.name == "dapo"
    assert cfg.reward.overlong_buffer.len == int(32 * 0.2)  # interpolation resolved after the YAML


def test_shorthand_overrides_select_presets():
    cfg = compose(algorithm="ppo", overrides=["algorithm=grpo", "data=gsm8k", "model=qwen2.5-7b", "device=mi300x"],
                  check=False)
    assert cfg.algorithm.name == "grpo" and cfg.actor.use_kl_loss is True
    assert cfg.data.name == "gsm8k" and cfg.data.train_files == [os.path.expanduser("~/data/gsm8k/train.parquet")]
    assert cfg.model.path == os.path.expanduser("~/models/Qwen2.5-7B")
    assert cfg.device.name == "rocm" and cfg.device.attn_impl == "aiter"


def test_tp_from_model_size_unless_set():
    assert compose(preset="a100", model="qwen2.5-7b", check=False).rollout.tensor_model_parallel_size == 2
    assert compose(preset="h200", model="qwen2.5-7b", check=False).rollout.tensor_model_parallel_size == 1
    cfg = compose(preset="a100", model="qwen2.5-7b", overrides=["rollout.tensor_model_parallel_size=4"], check=False)
    assert cfg.rollout.tensor_model_parallel_size == 4


def test_dotted_values_parse_as_yaml():
    cfg = compose(overrides=["algorithm.kl_ctrl.kl_coef=1e-3", "actor.optim.betas=[0.9,0.95]", "model.path=null",
                             "data.val_files=~/v.parquet", "device.kernels.rms_norm=native",
                             "device.tp_by_model_size.0.5b=2", "trainer.loggers=[console]"], check=False)
    assert cfg.algorithm.kl_ctrl.kl_coef == pytest.approx(1e-3)
    assert list(cfg.actor.optim.betas) == [0.9, 0.95] and cfg.model.path is None
    assert cfg.data.val_files == [os.path.expanduser("~/v.parquet")]
    assert cfg.device.kernels == {"rms_norm": "native"} and cfg.device.tp_by_model_size == {"0.5b": 2}


@pytest.mark.parametrize("override,expect", [
    ("algorithm.kl_ctrl.kl_cof=0.1", "Did you mean 'algorithm.kl_ctrl.kl_coef'"),
    ("actor.clip_ratio_hgh=0.3", "Did you mean 'actor.clip_ratio_high'"),
    ("trainer.totl_steps=3", "Did you mean 'trainer.total_steps'"),
])
def test_unknown_key_suggests_closest(override, expect):
    with pytest.raises(ConfigError, match=expect):
        compose(overrides=[override], check=False)


def test_unknown_key_in_user_yaml_names_file(tmp_path):
    user = tmp_path / "u.yaml"
    user.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"u\.yaml: unknown config key 'rollout.temprature'.*'rollout.temperature'"):
        compose(config_file=user)


def test_wrong_type_names_key_and_type():
    with pytest.raises(ConfigError, match=r"data.max_prompt_length expects int, got 'abc'"):
        compose(overrides=["data.max_prompt_length=abc"])
    with pytest.raises(ConfigError, match=r"actor.use_kl_loss expects bool"):
        compose(overrides=["actor.use_kl_loss=maybe"])


def test_unknown_preset_lists_available():
    with pytest.raises(ConfigError, match=r"unknown algorithm preset 'grpx'; available: .*grpo.*Did you mean 'grpo'"):
        compose(algorithm="grpx")
    with pytest.raises(ConfigError, match=r"unknown device preset 'h300'; available: a100"):
        compose(preset="h300")


def test_device_and_preset_must_agree():
    with pytest.raises(ConfigError, match="is for device 'cuda', not 'rocm'"):
        compose(device="rocm", preset="h100")
    assert compose(device="cuda", preset="h100", check=False).device.name == "cuda"
    assert compose(device="h100", check=False).device.preset == "h100"  # --device accepts a preset name
    assert compose(device="cpu").device.preset == "cpu"  # cpu is a backend and a preset


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="not key=value"):
        compose(overrides=["algorithm.gamma"])


def test_validation_collects_problems():
    with pytest.raises(ConfigError) as err:
        compose(overrides=["rollout.n=1", "actor.loss_agg_mode=token-avg", "data.truncation=middle",
                           "model.attn_impl=flash_attn", "device.name=cpu"])
    text = str(err.value)
    assert "needs rollout.n > 1" in text and "token-avg" in text and "registered: " in text
    assert "data.truncation='middle'" in text and "flash_attn" in text and "sdpa" in text


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.2"])
def test_sft_target_answer_p_is_a_probability(value):
    assert compose(overrides=["model.sft_target_answer_p=0.3"]).model.sft_target_answer_p == 0.3
    with pytest.raises(ConfigError, match=r"model.sft_target_answer_p=.* must be in \(0, 1\)"):
        compose(overrides=[f"model.sft_target_answer_p={value}"])


def test_yaml_roundtrip_and_atomic_save(tmp_path):
    cfg = compose(algorithm="dapo")
    path = tmp_path / "sub" / "config.yaml"
    save_yaml(cfg, path)
    again = compose(algorithm="dapo", config_file=path)
    assert to_yaml(again) == to_yaml(cfg)
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temp file left


def test_every_preset_group_is_listed():
    assert set(list_presets("algorithm")) == {"ppo", "grpo", "dapo", "gspo", "sapo", "reinforce_pp", "rloo", "remax",
                                              "gpg", "dr_grpo", "vapo", "sppo", "online_dpo", "spin",
                                              "prime"}
    assert set(list_presets("device")) == {"cpu", "a100", "h100", "h200", "mi300x", "mi325x", "ascend-910b",
                                           "ascend-910c"}
    assert set(list_presets("data")) == {"arith", "arith_tool", "gsm8k", "math", "dapo_math", "geo3k", "wordprob",
                                         "code"}
    assert {"tiny", "qwen2.5-0.5b", "qwen2.5-7b-instruct"} <= set(list_presets("model"))


def test_cli_config_show(capsys):
    from portrl.cli import main

    assert main(["config", "show", "--preset", "h200", "algorithm=gspo", "actor.ppo_epochs=2"]) == 0
    out = capsys.readouterr().out
    assert "loss_mode: gspo" in out and "ppo_epochs: 2" in out and "preset: h200" in out
    assert main(["config", "show", "actor.clip_ratio_hgh=1"]) == 2
    assert "actor.clip_ratio_high" in capsys.readouterr().err


def test_composes_with_the_resolver_api_of_omegaconf_2_3_and_2_4(monkeypatch):
    """omegaconf 2.3 (the floor in pyproject.toml) has a legacy ``register_resolver`` without ``replace`` (an H200
    image with 2.3.0 failed on it); 2.4 deprecates ``register_new_resolver`` with a warning that would be a second
    line of every one-line error. Compose registers through whichever of the two takes ``replace``."""
    from omegaconf import OmegaConf

    from portrl.config import composition

    called = []

    def legacy_register_resolver(name, resolver):
        raise AssertionError("the legacy register_resolver was called")

    def register_new_resolver(name, resolver, *, replace=False, use_cache=False):
        called.append(name)

    monkeypatch.setattr(OmegaConf, "register_resolver", legacy_register_resolver)  # as in omegaconf 2.3
    monkeypatch.setattr(OmegaConf, "register_new_resolver", register_new_resolver)
    monkeypatch.setattr(composition, "_RESOLVERS_DONE", False)
    composition._register_resolvers()
    assert called == ["portrl.scale"]
    monkeypatch.undo()
    monkeypatch.setattr(composition, "_RESOLVERS_DONE", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the installed omegaconf: no deprecation warning
        cfg = compose(overrides=["data.max_response_length=100"])
    assert cfg.data.max_response_length == 100


@pytest.mark.parametrize("value", [
    "${oc.env:PORTRL_TEST_TOKEN}",
    "${ oc.env : PORTRL_TEST_TOKEN,default}",  # omegaconf's grammar allows the spaces
    "run-${oc.env:PORTRL_TEST_TOKEN}",
    "${oc.decode:${oc.env:PORTRL_TEST_TOKEN}}",  # inside another resolver's arguments
    "\\${oc.env:PORTRL_TEST_TOKEN}",  # escaped: left as text by compose, read by the next resolve (to_yaml)
])
def test_an_environment_variable_in_a_value_is_refused_naming_the_key(tmp_path, monkeypatch, value):
    """``${oc.env:NAME}`` would copy a variable (a token) into the config a run saves and logs: an override, the
    user YAML (a list item too) is refused with one line naming where and which key, and the value is not in it."""
    monkeypatch.setenv("PORTRL_TEST_TOKEN", "s3cret-t0ken")
    with pytest.raises(ConfigError) as err:
        compose(overrides=[f"trainer.experiment_name={value}"])
    msg = str(err.value)
    assert msg.startswith(f"override trainer.experiment_name={value}: trainer.experiment_name reads an environment "
                          f"variable (${{oc.env:...}}), which portrl refuses")
    assert "write the value itself" in msg and "s3cret" not in msg and "\n" not in msg
    user = tmp_path / "run.yaml"
    user.write_text(f"data:\n  train_files:\n    - a.parquet\n    - '{value}'\n")
    with pytest.raises(ConfigError, match=rf"^{user}: data.train_files reads an environment variable") as err:
        compose(config_file=user)
    assert "s3cret" not in str(err.value)


def test_other_interpolations_still_resolve(monkeypatch):
    """Keys that refer to other keys and portrl's own resolver are unaffected; text that names oc.env without
    calling it is a plain value."""
    monkeypatch.setenv("PORTRL_TEST_TOKEN", "s3cret-t0ken")
    cfg = compose(overrides=["trainer.project_name=${trainer.experiment_name}-x", "data.max_response_length=100",
                             "trainer.experiment_name=see oc.env:PORTRL_TEST_TOKEN", "reward.overlong_buffer.len="
                             "${portrl.scale:${data.max_response_length},0.5}"])
    assert cfg.trainer.project_name == "see oc.env:PORTRL_TEST_TOKEN-x" and cfg.reward.overlong_buffer.len == 50
    assert "s3cret" not in to_yaml(cfg)
