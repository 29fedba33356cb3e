"""The agentic recipes (docs/agent_recipes.md): their tool configs exist, parse and ship in the wheel, and each
recipe's multi-turn overrides compose into the config they name (tests/test_examples_compose.py composes every
example as a whole)."""

from __future__ import annotations

import fnmatch
import re
from importlib import resources
from pathlib import Path

import pytest
import yaml

from portrl.config import compose

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted((ROOT / "configs" / "tools").glob("*.yaml"))
RECIPES = {"retool_dapo_qwen2.5-32b-instruct.sh": "python", "search_r1_grpo_qwen2.5-7b.sh": "search"}


def _overrides(script: Path) -> list[str]:
    """The key=value overrides of the script's `portrl train` call (shell variables left out)."""
    call = re.search(r"^portrl train (.*?)(?<!\\)$", script.read_text(), flags=re.M | re.S).group(1)
    return [a for a in call.replace("\\\n", " ").split() if "=" in a and not a.startswith(("--", '"'))
            and "$" not in a]


def test_tool_configs_are_verl_tool_lists():
    assert {p.stem for p in TOOLS} == {"calculator", "python", "search"}
    for path in TOOLS:
        tools = yaml.safe_load(path.read_text())["tools"]
        assert [t["name"] for t in tools] == [path.stem]
        assert all(isinstance(t.get("config", {}), dict) for t in tools)


def test_tool_configs_ship_in_the_wheel():
    """configs/ is installed as portrl.configs (setup.py) and its package data takes */*.yaml (pyproject)."""
    patterns = re.search(r'^"portrl\.configs" = \[(.*)\]$', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert '"portrl.configs": "configs"' in (ROOT / "setup.py").read_text()
    for path in TOOLS:
        name = f"tools/{path.name}"
        assert any(fnmatch.fnmatch(name, p.strip().strip('"')) for p in patterns.group(1).split(","))
        assert resources.files("portrl.configs").joinpath(name).is_file()


@pytest.mark.parametrize("script, tool", sorted(RECIPES.items()))
def test_recipe_runs_its_tool_through_the_agent_loop(script, tool):
    path = ROOT / "examples" / script
    overrides = _overrides(path)
    cfg = compose(device="cuda", preset="h100", overrides=overrides + ["model.path=/models/m",
                                                                       "data.train_files=[/data/train.parquet]"])
    mt = cfg.rollout.multi_turn
    assert mt.enable and mt.format == "hermes" and mt.max_assistant_turns >= 4
    assert mt.tool_config_path == f"configs/tools/{tool}.yaml" and (ROOT / mt.tool_config_path).is_file()
    assert "Expected" in path.read_text().split("set -euo pipefail")[0]


def test_docs_name_each_recipe_and_its_papers_figures():
    text = (ROOT / "docs" / "agent_recipes.md").read_text()
    for script in RECIPES:
        assert f"examples/{script}" in text
    for figure in ("2504.11536", "67.0%", "40.0%", "2503.09516", "0.431", "0.304", "arith_tool"):
        assert figure in text
    listed = (ROOT / "examples" / "README.md").read_text()
    assert all(script in listed for script in RECIPES)


def test_arith_tool_preset_runs_the_calculator():
    cfg = compose(data="arith_tool")
    mt = cfg.rollout.multi_turn
    assert cfg.data.name == "arith_tool" and mt.enable and mt.tool_config_path == "configs/tools/calculator.yaml"
    assert cfg.data.max_response_length >= 200  # the whole trajectory: call, tool result, answer
