"""The config settles once (issue 34 item 3): composed, checked by the preflight, its resources resolved into a
read-only copy (portrl.trainer.resources.settle_config), which is what RLTrainer takes; and the data tasks are
one registry (portrl.tasks) that every caller reads."""

import pytest
from omegaconf.errors import ReadonlyConfigError

from portrl.config import compose
from portrl.trainer.preflight import TRAIN, preflight
from portrl.trainer.data_cache import generated_files
from portrl.trainer.resources import is_settled, settle_config
from portrl.trainer.run_identity import run_identity

SMALL = ["device=cpu", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_heads=2",
         "model.tiny.num_kv_heads=1", "data.arith.num_train=8", "data.arith.num_test=4", "data.train_batch_size=4",
         "actor.ppo_mini_batch_size=4", "model.sft_warm_start=false"]


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    c = compose(overrides=[*SMALL, f"trainer.output_dir={tmp_path / 'run'}"])
    preflight(c, TRAIN)
    return c


def test_settled_config_holds_the_resolved_resources_and_is_read_only(cfg, tmp_path):
    settled = settle_config(cfg)
    assert is_settled(settled) and not is_settled(cfg)
    train, test = generated_files(cfg)
    assert list(settled.data.train_files) == [str(train)] and train.is_file()  # the generated arith rows
    assert list(settled.data.val_files) == [str(test)] and test.is_file()
    assert settled.trainer.num_workers == 1 and str(settled.model.path).startswith(str(tmp_path / "cache"))
    # the caller's config is left as it was
    assert cfg.trainer.num_workers is None and not cfg.model.path and list(cfg.data.train_files) == []
    with pytest.raises(ReadonlyConfigError, match="data.val_files"):  # a later write names the key
        settled.data.val_files = []
    with pytest.raises(ReadonlyConfigError, match="trainer.num_workers"):
        settled.trainer.num_workers = 2
    assert settle_config(settled) is settled  # settling twice changes nothing
    # the run is the one the preflight saw: generated files and the tiny model's cache path are not its identity
    assert run_identity(settled) == run_identity(cfg)


def test_the_trainer_takes_only_a_settled_config(cfg):
    from portrl.trainer.rl_trainer import RLTrainer

    with pytest.raises(TypeError, match="settle_config"):
        RLTrainer(cfg)


def test_one_task_list():
    from portrl.cli import preprocess as cli_preprocess
    from portrl.data.preprocess import preprocess
    from portrl.errors import UserError
    from portrl.tasks import TASK_NAMES, TASKS, get_task

    assert set(TASK_NAMES) >= {"gsm8k", "math", "dapo_math", "arith", "code", "qa", "geo3k"}
    assert cli_preprocess.TASK_NAMES is TASK_NAMES  # the command's choices are the registry's
    for task in TASKS.values():  # every record's functions resolve
        assert task.generated != (task.converter is not None)
        if task.converter:
            assert callable(task.convert())
        if task.generated:
            rows = task.generate(2, 0, 1, "train")
            assert len(rows) == 2 and rows[0]["data_source"] == task.name
    with pytest.raises(UserError, match="unknown task 'nope'; valid: gsm8k"):
        get_task("nope")
    with pytest.raises(UserError, match="unknown task"):
        preprocess("nope", "out")


def test_generated_files_are_keyed_by_their_own_generators_version(monkeypatch, tmp_path):
    """A changed word-problem generator rebuilds its cached files; arith's version does not key them."""
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    c = compose(overrides=["device=cpu", "data=wordprob"])
    before = generated_files(c)[0]
    monkeypatch.setattr("portrl.data.arith.GENERATOR_VERSION", 99)
    assert generated_files(c)[0] == before
    monkeypatch.setattr("portrl.data.wordprob.GENERATOR_VERSION", 99)
    assert generated_files(c)[0] != before
