"""Measurement logs live in docs/performance.md, not in code: no comment or docstring in portrl/ or backends/ (Python,
C++) and no comment in configs/ (the YAML presets) cites a date (YYYY-MM-DD). A figure measured on a day, a machine
or a run goes to docs/performance.md with where it came from; the comment keeps only the why."""

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")
CPP_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
YAML_COMMENT = re.compile(r"(?:^|\s)#.*$", re.M)


def _python_comments(text: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each comment and docstring."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def _comments(path: Path, text: str) -> list[tuple[int, str]]:
    if path.suffix == ".py":
        return _python_comments(text)
    pattern = YAML_COMMENT if path.suffix in (".yaml", ".yml") else CPP_COMMENT
    return [(text.count("\n", 0, m.start()) + 1, m.group()) for m in pattern.finditer(text)]


def dated_comments() -> list[str]:
    """``path:line: date`` of each date in a comment of portrl/, backends/ or configs/."""
    found = []
    for folder, suffixes in (("portrl", (".py",)), ("backends", (".py", ".cpp", ".h")), ("configs", (".yaml", ".yml"))):
        for path in sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in suffixes):
            text = path.read_text(encoding="utf-8")
            for line, comment in _comments(path, text):
                for m in DATE.finditer(comment):
                    found.append(f"{path.relative_to(ROOT).as_posix()}:{line + comment.count(chr(10), 0, m.start())}: "
                                 f"{m.group()}")
    return sorted(found)


def test_no_comment_cites_a_date():
    found = dated_comments()
    assert not found, ("a dated measurement in a comment (move it to docs/performance.md with where it came from, "
                       "keep the why): " + "; ".join(found))


def test_the_rule_sees_each_kind_of_comment(tmp_path, monkeypatch):
    for rel, text in {"portrl/a.py": '"""Fast since 2026-11-03."""\nx = "2026-11-04"  # measured 2026-11-05\n',
                      "backends/cpu/k.cpp": "// 2026-11-06: 12 ms\nint x = 1; /* a\n 2026-11-07 */\n",
                      "backends/cpu/k.h": 'const char* d = "2026-11-08";\n',
                      "configs/p.yaml": "lr: 1e-6  # 2026-11-09 run\nname: '2026-11-10'\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert dated_comments() == ["backends/cpu/k.cpp:1: 2026-11-06", "backends/cpu/k.cpp:3: 2026-11-07",
                                "configs/p.yaml:1: 2026-11-09", "portrl/a.py:1: 2026-11-03",
                                "portrl/a.py:2: 2026-11-05"]
