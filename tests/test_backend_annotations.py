"""Every parameter named ``backend`` in portrl/ and backends/ is typed as the Backend (issue 34, item 4): the checker
(`python -m mypy`, .ci/run) then sees each call against the contract. ``Any`` there would switch that off silently."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def untyped_backends(root: Path = ROOT) -> list[str]:
    """``path:line function`` of every ``backend`` parameter annotated ``Any`` (or not annotated at all)."""
    found = []
    for folder in ("portrl", "backends"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                a = node.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                    if arg.arg == "backend" and (arg.annotation is None or ast.unparse(arg.annotation) == "Any"):
                        found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name}")
    return found


def test_every_backend_parameter_has_the_backend_type():
    assert untyped_backends() == []


def test_the_rule_sees_an_untyped_backend(tmp_path):
    (tmp_path / "portrl").mkdir()
    (tmp_path / "backends").mkdir()
    (tmp_path / "portrl" / "m.py").write_text("from typing import Any\ndef f(cfg, backend: Any):\n    pass\n")
    assert untyped_backends(tmp_path) == ["portrl/m.py:2 f"]
