"""Algorithm plugins: an installed distribution declares an estimator in the entry-point group
``portrl.algorithms``; its name then works in the config checks, the spec and `portrl config show` with no import
in the user's code. A broken plugin is recorded with its error, the others still load, and an unknown name's
error names the broken plugin. The plugins are real installed distributions (dist-info on sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import portrl.algo.registry as algo_registry
from portrl.algo import UnknownNameError, algorithm_spec, compute_advantage, registered
from portrl.algo.registry import ADV_ESTIMATORS
from portrl.config import compose

TD0 = """
import torch

from portrl.algo import EstimatorSpec, register_estimator


def td0(token_level_rewards, response_mask, values, gamma=1.0):
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    adv = (token_level_rewards + gamma * next_values - values) * response_mask
    return adv, adv + values


register_estimator(EstimatorSpec("td0_plugin", td0, needs_critic=True))
"""


def write_plugin(root: Path) -> None:
    info = root / "portrl_td0-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: portrl-td0\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[portrl.algorithms]\ntd0 = portrl_test_td0\n"
                                           "broken = portrl_test_broken_algo\n")
    (root / "portrl_test_td0.py").write_text(textwrap.dedent(TD0))
    (root / "portrl_test_broken_algo.py").write_text("raise ImportError('no module named fancy_math')\n")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    write_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in ("portrl_test_td0", "portrl_test_broken_algo"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    monkeypatch.setattr(ADV_ESTIMATORS, "_fns", dict(ADV_ESTIMATORS._fns))  # the plugin's entry goes away after
    algo_registry.PLUGINS.reset()
    yield tmp_path
    algo_registry.PLUGINS.reset()


def test_a_plugin_estimator_is_found_by_name(plugin):
    assert "td0_plugin" in registered("adv_estimator")
    broken = algo_registry.load_plugins()
    assert broken == {"broken": ("portrl_test_broken_algo", "ImportError: no module named fancy_math")}
    assert broken["broken"].message == ("plugin portrl_test_broken_algo failed to load: ImportError: no module named "
                                        "fancy_math")
    cfg = compose(overrides=["algorithm=ppo", "algorithm.adv_estimator=td0_plugin"])  # the checks accept it
    assert algorithm_spec(cfg.algorithm).needs_critic
    r = torch.tensor([[0.0, 1.0]])
    adv, ret = compute_advantage("td0_plugin", token_level_rewards=r, response_mask=torch.ones(1, 2),
                                 values=torch.tensor([[0.5, 0.25]]), gamma=1.0)
    assert torch.allclose(adv, torch.tensor([[-0.25, 0.75]])) and torch.allclose(ret, adv + torch.tensor([[0.5, 0.25]]))


def test_a_lookup_loads_the_plugins_once(plugin):
    """A process that never listed the registry (a Ray worker) finds the plugin's name on first lookup."""
    assert "td0_plugin" not in ADV_ESTIMATORS._fns
    assert ADV_ESTIMATORS.get("td0_plugin").name == "td0_plugin"
    with pytest.raises(UnknownNameError) as err:
        ADV_ESTIMATORS.get("nosuch")
    assert "broken algorithm plugins: broken: plugin portrl_test_broken_algo failed to load: ImportError" in str(err.value)


def test_the_cli_sees_an_installed_plugin(plugin):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")]),
           "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("PORTRL_DEBUG", None)
    portrl = Path(sys.executable).parent / "portrl"
    run = subprocess.run([str(portrl), "config", "show", "algorithm=ppo", "algorithm.adv_estimator=td0_plugin"],
                         capture_output=True, text=True, env=env, cwd=plugin, timeout=120)
    assert run.returncode == 0, run.stderr
    assert OmegaConf.create(run.stdout).algorithm.adv_estimator == "td0_plugin"
    run = subprocess.run([str(portrl), "config", "show", "algorithm.adv_estimator=td1"], capture_output=True,
                         text=True, env=env, cwd=plugin, timeout=120)
    assert run.returncode == 2 and "td1" in run.stderr and "Traceback" not in run.stderr
    assert "td0_plugin" in run.stderr  # the valid names listed include the plugin's
