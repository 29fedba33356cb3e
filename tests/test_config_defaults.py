"""Default presets of compose(): grpo / arith / tiny unless the user selects or points the group elsewhere."""

from portrl.config import compose
from portrl.config.composition import DEFAULT_PRESETS


def test_no_argument_is_the_builtin_demo():
    cfg = compose()
    assert DEFAULT_PRESETS == {"algorithm": "grpo", "data": "arith", "model": "tiny"}
    assert cfg.algorithm.name == "grpo" and cfg.actor.use_kl_loss  # the grpo preset, not just the schema
    assert cfg.data.name == "arith" and cfg.model.size == "tiny" and cfg.model.path is None
    assert cfg.model.sft_warm_start is True and cfg.actor.optim.lr > 1e-6  # the tiny preset's SFT and lr


def test_own_model_path_skips_the_tiny_preset(tmp_path):
    cfg = compose(overrides=[f"model.path={tmp_path}"], check=False)
    assert cfg.model.size is None and cfg.model.sft_warm_start is False and cfg.actor.optim.lr == 1e-6
    user = tmp_path / "run.yaml"
    user.write_text(f"model:\n  path: {tmp_path}\n")
    assert compose(config_file=user, check=False).model.sft_warm_start is False
    assert compose(overrides=["model.path=null"]).model.size == "tiny"  # null = the built-in model


def test_explicit_selection_wins_and_own_data_skips_arith():
    assert compose(overrides=["model=qwen2.5-0.5b"], check=False).model.size == "0.5b"
    assert compose(algorithm="ppo").algorithm.adv_estimator == "gae"
    cfg = compose(overrides=["data.name=gsm8k", "data.train_files=/x/train.parquet"], check=False)
    assert cfg.data.name == "gsm8k" and cfg.data.train_files == ["/x/train.parquet"]


def test_yaml_booleans_stay_strings_for_string_fields():
    cfg = compose(overrides=["trainer.resume=off", "trainer.experiment_name=123", "model.path=null"], check=False)
    assert cfg.trainer.resume == "off" and cfg.trainer.experiment_name == "123" and cfg.model.path is None
    assert compose(overrides=["trainer.plot=off"], check=False).trainer.plot is False  # bool fields still parse
