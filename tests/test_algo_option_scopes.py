"""Plugin options are scoped by their owner, and algorithms declare the batch inputs they read (issue 59 item 2).

Two installed plugins (real distributions with entry points in ``portrl.algorithms``) that declare one option name
differently no longer break every run: each one's key lives under its owner's name (``algorithm.<name>.<field>``),
typed, range-checked and passed to its own function only. Plugins that declare a name the same way share the plain
key. An estimator's extra batch inputs come from its record (``EstimatorSpec.inputs``: GDPO's reward components), an
objective's mini-batch counts from its record (``ObjectiveSpec.counts``: online DPO's valid pairs), so the generic
code names no algorithm.
"""

from __future__ import annotations

import pickle
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import portrl.algo.registry as algo_registry
from portrl.algo import EstimatorSpec, ObjectiveSpec, algorithm_spec, option, register_estimator, register_objective
from portrl.algo.advantages_gdpo import gdpo_inputs
from portrl.algo.objectives import estimator_advantages
from portrl.algo.registry import ADV_ESTIMATORS, OBJECTIVES
from portrl.algo.spec import estimator_spec
from portrl.config import ConfigError, compose

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = """
from dataclasses import dataclass

from portrl.algo import EstimatorSpec, option, register_estimator


@dataclass
class Options:
    horizon: {type} = option({default!r}{rule})


def fn(token_level_rewards, response_mask, horizon={default!r}):
    scale = horizon if isinstance(horizon, float) else float(len(horizon))
    return token_level_rewards * scale, token_level_rewards


register_estimator(EstimatorSpec({name!r}, fn, options=Options))
"""


@pytest.fixture
def two_plugins(tmp_path, monkeypatch):
    """``plug_a`` (horizon: float 0.5, >= 0) and ``plug_b`` (horizon: str 'short', a choice), installed."""
    info = tmp_path / "portrl_two_horizons-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: portrl-two-horizons\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[portrl.algorithms]\na = portrl_test_plug_a\nb = portrl_test_plug_b\n")
    (tmp_path / "portrl_test_plug_a.py").write_text(textwrap.dedent(PLUGIN.format(
        type="float", default=0.5, rule=", ge=0.0", name="plug_a")))
    (tmp_path / "portrl_test_plug_b.py").write_text(textwrap.dedent(PLUGIN.format(
        type="str", default="short", rule=", choices=('short', 'long')", name="plug_b")))
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in ("portrl_test_plug_a", "portrl_test_plug_b"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    monkeypatch.setattr(ADV_ESTIMATORS, "_fns", dict(ADV_ESTIMATORS._fns))
    algo_registry.PLUGINS.reset()
    yield tmp_path
    algo_registry.PLUGINS.reset()


def _advantages(cfg) -> torch.Tensor:
    tensors = {"token_level_rewards": torch.ones(2, 3), "response_mask": torch.ones(2, 3)}
    out, _ = estimator_advantages(cfg.algorithm, tensors, ["u0", "u0"], 2)
    return out["advantages"]


def test_two_plugins_declaring_one_name_differently_each_keep_theirs(two_plugins):
    cfg = compose()  # neither chosen: the run is not broken by them
    assert cfg.algorithm.plug_a.horizon == 0.5 and cfg.algorithm.plug_b.horizon == "short"
    cfg = compose(overrides=["algorithm.adv_estimator=plug_a", "algorithm.plug_a.horizon=0.25"])
    assert torch.equal(_advantages(cfg), torch.full((2, 3), 0.25))  # its own value reaches its function
    assert pickle.loads(pickle.dumps(cfg)).algorithm.plug_a.horizon == 0.25  # to a Ray worker and back
    cfg = compose(overrides=["algorithm.adv_estimator=plug_b", "algorithm.plug_b.horizon=long"])
    assert torch.equal(_advantages(cfg), torch.full((2, 3), 4.0))
    with pytest.raises(ConfigError, match=r"algorithm.plug_b.horizon only applies to the estimators that take it "
                                          r"\(plug_b\), not 'plug_a'"):
        compose(overrides=["algorithm.adv_estimator=plug_a", "algorithm.plug_b.horizon=long"])
    with pytest.raises(ConfigError, match=r"algorithm.plug_a.horizon=-1.0 must be >= 0 \(an option of adv_estimator "
                                          r"'plug_a'\)"):
        compose(overrides=["algorithm.adv_estimator=plug_a", "algorithm.plug_a.horizon=-1"])
    with pytest.raises(ConfigError, match="algorithm.horizon"):  # no plain key: it would be ambiguous
        compose(overrides=["algorithm.adv_estimator=plug_a", "algorithm.horizon=0.25"])


def test_plugins_declaring_one_name_the_same_way_share_the_plain_key(monkeypatch):
    monkeypatch.setattr(ADV_ESTIMATORS, "_fns", dict(ADV_ESTIMATORS._fns))

    @dataclass
    class Shared:
        shared_scale: float = option(1.0, gt=0.0)

    def fn(token_level_rewards, response_mask, shared_scale=1.0):
        return token_level_rewards * shared_scale, token_level_rewards

    for name in ("shared_one", "shared_two"):
        register_estimator(EstimatorSpec(name, fn, options=Shared))
    cfg = compose(overrides=["algorithm.adv_estimator=shared_two", "algorithm.shared_scale=3"])
    assert torch.equal(_advantages(cfg), torch.full((2, 3), 3.0))
    with pytest.raises(ConfigError, match=r"algorithm.shared_scale only applies to the estimators that take it "
                                          r"\(shared_one, shared_two\), not 'grpo'"):
        compose(overrides=["algorithm.shared_scale=3"])


def test_an_estimator_declares_its_batch_inputs(monkeypatch):
    """``EstimatorSpec.inputs`` builds the extra arguments from its options and the batch; GDPO declares its own."""
    monkeypatch.setattr(ADV_ESTIMATORS, "_fns", dict(ADV_ESTIMATORS._fns))

    def with_bonus(token_level_rewards, response_mask, bonus):
        return token_level_rewards + bonus[:, None], token_level_rewards

    register_estimator(EstimatorSpec("with_bonus", with_bonus,
                                     inputs=lambda options, tensors: {"bonus": tensors["my_bonus"]}))
    cfg = compose(overrides=["algorithm.adv_estimator=with_bonus"])
    tensors = {"token_level_rewards": torch.zeros(2, 3), "response_mask": torch.ones(2, 3),
               "my_bonus": torch.tensor([1.0, 2.0])}
    out, _ = algorithm_spec(cfg.algorithm).advantages(cfg.algorithm, tensors, ["u0", "u0"], 2)
    assert torch.equal(out["advantages"], torch.tensor([[1.0] * 3, [2.0] * 3]))
    assert estimator_spec("gdpo").inputs is gdpo_inputs
    extra = {"reward_extra/fmt": torch.tensor([1.0, 0.0])}
    assert gdpo_inputs({"gdpo_reward_keys": ["fmt"], "gdpo_reward_weights": [0.5]}, extra) == {
        "reward_components": {"fmt": extra["reward_extra/fmt"]}, "reward_weights": [0.5]}


def test_an_objective_declares_its_counts(monkeypatch):
    """``ObjectiveSpec.counts``: online DPO's valid pairs; an objective without counts has none."""
    dpo = algorithm_spec(compose(overrides=["algorithm=online_dpo"]).algorithm)
    assert dpo.counts({"dpo_valid": torch.tensor([True, True, False, False, True, True])}) == {"num_pairs": 2.0}
    assert algorithm_spec(compose().algorithm).counts({}) == {}
    monkeypatch.setattr(OBJECTIVES, "_fns", dict(OBJECTIVES._fns))
    pg = OBJECTIVES.get("policy_gradient")
    register_objective(ObjectiveSpec("counted", pg.advantages, pg.loss, uses_estimator=True,
                                     counts=lambda t: {"positive": float((t["advantages"] > 0).sum())}))
    spec = algorithm_spec(compose(overrides=["algorithm.objective=counted"]).algorithm)
    assert spec.counts({"advantages": torch.tensor([1.0, -1.0, 2.0])}) == {"positive": 2.0}


@pytest.mark.parametrize("path, names", [
    ("portrl/algo/objectives.py", ("gdpo", "reward_extra")),
    ("portrl/workers/actor.py", ("dpo_valid", "num_pairs", "preference")),
])
def test_the_generic_code_names_no_algorithm_for_its_inputs(path, names):
    text = (ROOT / path).read_text().lower()
    assert not [n for n in names if n in text]
