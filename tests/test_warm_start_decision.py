"""The SFT warm start runs only on a built-in task's own generated rows (portrl.trainer.data_fit.warm_start_task):
a run of the default tiny model with data.train_files does not warm-start on arith."""

import pytest

from portrl.config import compose
from portrl.errors import UserError
from portrl.trainer.data_fit import fit_warm_start, warm_start_task
from portrl.trainer.data_cache import generated_files


def _arith_files(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_bytes(b"")  # the decision reads the config only; no file is opened
    return str(path)


def test_the_default_run_warm_starts_and_a_run_with_files_does_not(tmp_path):
    default = compose()
    assert default.model.sft_warm_start and warm_start_task(default).name == "arith"
    cfg = compose(overrides=[f"data.train_files=[{_arith_files(tmp_path)}]"])
    assert cfg.data.name == "arith" and cfg.model.sft_warm_start  # the tiny model preset's, under the default name
    assert warm_start_task(cfg) is None
    fit_warm_start(cfg)  # the preflight's: a preset's warm start off, with a note
    assert cfg.model.sft_warm_start is False


def test_a_users_warm_start_with_files_is_refused_with_the_key(tmp_path):
    cfg = compose(overrides=[f"data.train_files=[{_arith_files(tmp_path)}]", "model.sft_warm_start=true"])
    with pytest.raises(UserError, match="set model.sft_warm_start=false"):
        fit_warm_start(cfg)


def test_a_settled_default_run_still_warm_starts(tmp_path):
    """settle_config writes the generated split's cache path into data.train_files: that is the task's own data."""
    cfg = compose(overrides=[f"trainer.output_dir={tmp_path}"])
    cfg.data.train_files = [str(generated_files(cfg)[0])]
    assert warm_start_task(cfg).name == "arith"
    fit_warm_start(cfg)
    assert cfg.model.sft_warm_start
