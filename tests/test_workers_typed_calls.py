"""Typed worker calls (portrl/workers/group.py): the caller names the worker method itself (mypy checks it against
the group's worker class, its arguments and its result); the group dispatches by the method's name, so a base
class's or a protocol's method runs as the worker's own, and a method set on the class under another name (a
test's spy) is found by identity. portrl/ calls its workers so; the one call left by name is listed here."""

import ast
from pathlib import Path
from typing import Protocol

import pytest
from omegaconf import OmegaConf

from portrl.config.options_schema import default_config
from portrl.device import get_backend
from portrl.workers.group import WorkerGroup, method_name

ROOT = Path(__file__).resolve().parents[1]
GROUP_CALLS = ("run", "gather", "metrics", "rank0", "concat", "submit")
#: by name on purpose: tests/test_agent_traces.py's stand-in generation group compares the name it is given
BY_NAME = {"portrl/trainer/validation.py": 1}


class Base:
    config_sections = ("trainer",)

    def __init__(self, cfg, rank=0, world_size=1):
        self.rank = rank

    def who(self, x: int) -> str:
        return f"base {x}"


class Sub(Base):
    def who(self, x: int) -> str:
        return f"sub {x}"


class Says(Protocol):
    def who(self, x: int) -> str: ...


def _group():
    cfg = default_config()
    OmegaConf.update(cfg, "trainer.use_ray", False)
    return WorkerGroup(Sub, cfg, 1, get_backend("cpu"))


def test_a_base_class_or_protocol_method_runs_as_the_workers_own():
    group = _group()
    assert group.rank0(Base.who, 1) == "sub 1"
    assert group.gather(Says.who, 2) == ["sub 2"]
    assert group.rank0(Sub.who, 3) == "sub 3"
    assert group.rank0("who", 4) == "sub 4"  # the untyped form still works


def test_a_method_set_under_another_name_is_found_by_identity(monkeypatch):
    def spy(self, x):
        return f"spy {x}"

    monkeypatch.setattr(Sub, "who", spy)
    assert method_name(Sub, Sub.who) == "who"
    assert _group().rank0(Sub.who, 5) == "spy 5"
    with pytest.raises(AttributeError, match=r"^Sub has no method '<lambda>'$"):
        method_name(Sub, lambda self: None)


def calls_by_name(root: Path = ROOT) -> dict:
    """``path: count`` of the worker-group calls in portrl/ whose method is a string (``group.run("name", ...)``)."""
    found: dict = {}
    for path in sorted((root / "portrl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in GROUP_CALLS
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                key = path.relative_to(root).as_posix()
                found[key] = found.get(key, 0) + 1
    return found


def test_portrl_names_the_worker_methods_it_calls():
    assert calls_by_name() == BY_NAME


def test_the_rule_sees_a_call_by_name(tmp_path):
    (tmp_path / "portrl").mkdir()
    (tmp_path / "portrl" / "m.py").write_text("def f(group, b):\n    group.concat('compute_values', b)\n"
                                              "    group.concat(len, b)\n")
    assert calls_by_name(tmp_path) == {"portrl/m.py": 1}
