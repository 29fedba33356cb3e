"""The project's size rule: no file in portrl/ or backends/ over 400 lines, no function over 80 lines."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _sources():
    for folder in ("portrl", "backends"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def oversized() -> list[str]:
    """``path (N lines)`` and ``path:function (N lines)`` of every file and function over the limits."""
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{rel} ({lines} lines)")
        for node in ast.walk(ast.parse(text, filename=rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - start + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.name} ({length} lines)")
    return found


def test_no_file_or_function_over_the_limits():
    offenders = oversized()
    assert not offenders, (f"over {MAX_FILE_LINES} lines per file / {MAX_FUNCTION_LINES} per function (split along "
                           "a seam, one purpose per file): " + "; ".join(offenders))


def test_the_rule_sees_a_long_function(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "portrl").mkdir()
    (tmp_path / "backends").mkdir()
    (tmp_path / "portrl" / "long.py").write_text(f"def long():\n{body}\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert oversized() == [f"portrl/long.py:long ({MAX_FUNCTION_LINES + 1} lines)"]
