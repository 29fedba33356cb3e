"""Algorithm options declared next to their function (portrl/algo/options.py) become typed config keys.

The end-to-end case is a plugin estimator with its own option, installed as a real distribution (a dist-info with an
entry point in ``portrl.algorithms`` on the path of a fresh ``portrl`` process): ``algorithm.adv_scale=...`` trains
2 steps and the value reaches the function; a value outside the declared range, or a misspelt key, is one line on
stderr with exit code 2. In-process cases: the built-in options keep their verl paths, and a declaration that
clashes is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

import portrl.algo.options as algo_options
from portrl.algo import EstimatorSpec, option, register_estimator
from portrl.algo.registry import ADV_ESTIMATORS
from portrl.config import ConfigError, compose
from portrl.config.options_schema import run_schema

PLUGIN = """
import os
from dataclasses import dataclass

import torch

from portrl.algo import EstimatorSpec, option, register_estimator


@dataclass
class ScaledOptions:
    adv_scale: float = option(1.0, gt=0.0, le=10.0, doc="factor on the group-centred advantage")


def scaled_grpo(token_level_rewards, response_mask, index, adv_scale=1.0):
    with open(os.environ["PORTRL_TEST_OPTION_LOG"], "a") as fh:
        fh.write(f"{adv_scale!r}\\n")
    scores = token_level_rewards.sum(-1)
    adv = torch.zeros_like(scores)
    rows = {}
    for i, group in enumerate(index):
        rows.setdefault(group, []).append(i)
    for members in rows.values():
        adv[members] = scores[members] - scores[members].mean()
    adv = adv_scale * adv[:, None] * response_mask
    return adv, adv


register_estimator(EstimatorSpec("scaled_grpo", scaled_grpo, needs_groups=True, options=ScaledOptions))
"""
SMALL = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=64", "data.arith.num_test=8",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
         "trainer.progress_bar=false", "trainer.total_steps=2", "trainer.test_freq=0",
         "trainer.val_before_train=false", "model.sft_warm_start=false", "trainer.export_hf=false",
         "trainer.plot=false"]


@pytest.fixture
def installed(tmp_path):
    """The plugin as an installed distribution in ``tmp_path/site`` (module, dist-info, entry point)."""
    site = tmp_path / "site"
    info = site / "portrl_scaled_adv-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: portrl-scaled-adv\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[portrl.algorithms]\nscaled = portrl_scaled_adv\n")
    (info / "RECORD").write_text("portrl_scaled_adv.py,,\n")
    (site / "portrl_scaled_adv.py").write_text(textwrap.dedent(PLUGIN))
    return site


def portrl(site: Path, cwd: Path, *args: str, log: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PORTRL_TEST_OPTION_LOG": str(log)}
    env.pop("PORTRL_DEBUG", None)
    exe = Path(sys.executable).parent / "portrl"
    return subprocess.run([str(exe), "--log-level", "WARNING", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_a_plugin_option_reaches_its_function_in_training(installed, tmp_path):
    """2 steps with ``algorithm.adv_scale=2.5``: the estimator gets 2.5 once a step (a fresh process: the entry
    point is found by the distribution, not by an import in the test)."""
    log = tmp_path / "calls.log"
    run = portrl(installed, tmp_path, "train", *SMALL, "algorithm.adv_estimator=scaled_grpo",
                 "algorithm.adv_scale=2.5", f"trainer.output_dir={tmp_path / 'run'}", log=log)
    assert run.returncode == 0, run.stderr[-3000:]
    assert log.read_text().split() == ["2.5", "2.5"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2]


@pytest.mark.parametrize("override, message", [
    ("algorithm.adv_scale=-1", "algorithm.adv_scale=-1.0 must be > 0 and <= 10 (an option of adv_estimator "
                               "'scaled_grpo')"),
    ("algorithm.adv_scael=2", "unknown config key 'algorithm.adv_scael'. Did you mean 'algorithm.adv_scale'?"),
])
def test_a_bad_plugin_option_is_one_line(installed, tmp_path, override, message):
    log = tmp_path / "calls.log"
    run = portrl(installed, tmp_path, "train", *SMALL, "algorithm.adv_estimator=scaled_grpo", override, log=log)
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.strip().splitlines() if " WARNING " not in line]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in run.stderr, run.stderr
    assert not log.exists()  # refused before any training


def test_builtin_options_keep_their_verl_paths():
    """Declared options live where verl has them; their defaults and types are the declarations'."""
    cfg = compose(overrides=["algorithm=ppo", "algorithm.lam_actor=0.9", "actor.policy_loss.clip_cov_ratio=0.001",
                             "actor.tau_pos=2", "actor.sppo_eta=0.5", "algorithm.reward_dpo_coef=1"],
                  check=False)  # options of several algorithms at once: only the paths and types are asked here
    assert cfg.algorithm.lam_actor == 0.9 and cfg.actor.policy_loss.clip_cov_ratio == 0.001
    assert cfg.actor.tau_pos == 2.0 and cfg.actor.sppo_eta == 0.5 and cfg.algorithm.reward_dpo_coef == 1.0
    assert cfg.algorithm.dpo_beta == 0.1 and cfg.actor.policy_loss.dro_beta is None
    with pytest.raises(ConfigError, match="actor.policy_loss.kl_cov_ratio=2.0 must be >= 0 and <= 1"):
        compose(overrides=["actor.policy_loss.kl_cov_ratio=2"])
    with pytest.raises(ConfigError, match="algorithm.lam_actor only applies to the estimators that take it"):
        compose(overrides=["algorithm.lam_actor=0.9"])  # grpo would ignore it


def test_an_in_process_declaration_extends_the_schema(monkeypatch):
    """A record registered after the first config was composed adds its key; the schema is rebuilt."""
    monkeypatch.setattr(ADV_ESTIMATORS, "_fns", dict(ADV_ESTIMATORS._fns))
    before = run_schema()

    @dataclass
    class Opts:
        horizon_decay: float = option(0.5, ge=0.0, le=1.0)

    def fn(token_level_rewards, response_mask, horizon_decay=0.5):
        return token_level_rewards * horizon_decay, token_level_rewards

    register_estimator(EstimatorSpec("decayed", fn, options=Opts))
    cfg = compose(overrides=["algorithm.adv_estimator=decayed", "algorithm.horizon_decay=0.25"])
    assert cfg.algorithm.horizon_decay == 0.25 and run_schema() is not before
    with pytest.raises(ConfigError, match=r"algorithm.horizon_decay=1.5 must be >= 0 and <= 1 \(an option of "
                                          r"adv_estimator 'decayed'\)"):
        compose(overrides=["algorithm.adv_estimator=decayed", "algorithm.horizon_decay=1.5"])
    with pytest.raises(ConfigError, match="algorithm.horizon_decay expects float"):
        compose(overrides=["algorithm.adv_estimator=decayed", "algorithm.horizon_decay=big"])


@pytest.mark.parametrize("declare, message", [
    ("gamma", "already a key of the config schema"),  # a shared key of AlgorithmConfig
    ("lam_actor", "is declared twice, differently"),  # gae's, with another default
])
def test_a_clashing_declaration_is_refused(monkeypatch, declare, message):
    monkeypatch.setattr(ADV_ESTIMATORS, "_fns", dict(ADV_ESTIMATORS._fns))
    Opts = dataclass(type("Opts", (), {"__annotations__": {declare: float}, declare: option(0.3)}))
    register_estimator(EstimatorSpec("clash", lambda token_level_rewards, response_mask: None, options=Opts))
    with pytest.raises(ConfigError, match=message):
        compose()


def test_a_bad_declaration_is_refused_at_registration(monkeypatch):
    monkeypatch.setattr(algo_options, "POLICY_LOSS_OPTIONS", dict(algo_options.POLICY_LOSS_OPTIONS))

    @dataclass
    class Elsewhere:
        SECTION: ClassVar[str] = "rollout"
        x: float = 1.0

    with pytest.raises(TypeError, match="SECTION='rollout' is not one of algorithm, actor, actor.policy_loss"):
        algo_options.register_policy_loss_options("vanilla", Elsewhere)

    @dataclass
    class NoDefault:
        x: float

    with pytest.raises(TypeError, match="needs a default"):
        register_estimator(EstimatorSpec("nodefault", lambda token_level_rewards, response_mask: None,
                                         options=NoDefault))


def test_a_policy_loss_option_reaches_the_loss(monkeypatch):
    """``@policy_loss(name, options=...)``: the key lives at its SECTION and the loss finds it in ``config``."""
    import torch

    from portrl.algo import algorithm_spec, policy_loss
    from portrl.algo.registry import POLICY_LOSSES

    monkeypatch.setattr(POLICY_LOSSES, "_fns", dict(POLICY_LOSSES._fns))
    monkeypatch.setattr(algo_options, "POLICY_LOSS_OPTIONS", dict(algo_options.POLICY_LOSS_OPTIONS))
    seen = []

    @dataclass
    class MyLossOptions:
        SECTION: ClassVar[str] = "actor.policy_loss"
        my_coef: float = option(0.1, ge=0.0)

    @policy_loss("my_loss", options=MyLossOptions)
    def my_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        seen.append(config["my_coef"])
        return (log_prob * advantages).mean(), {}

    cfg = compose(overrides=["actor.policy_loss.loss_mode=my_loss", "actor.policy_loss.my_coef=0.25"])
    x = torch.zeros(2, 3)
    tensors = {"response_mask": torch.ones(2, 3), "advantages": torch.ones(2, 3)}
    algorithm_spec(cfg.algorithm).loss(cfg.actor, cfg.algorithm, tensors, x, x, {})
    assert seen == [0.25]
    with pytest.raises(ConfigError, match=r"actor.policy_loss.my_coef=-1.0 must be >= 0 \(an option of policy_loss "
                                          r"'my_loss'\)"):
        compose(overrides=["actor.policy_loss.loss_mode=my_loss", "actor.policy_loss.my_coef=-1"])
