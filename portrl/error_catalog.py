"""Every error message a user can meet, read from the source: ``python -m portrl.error_catalog``.

A mistake in what the user gave raises :class:`portrl.errors.UserError` or a subclass (portrl/errors.py), and
``portrl`` prints its message as one line, exit code 2. This module finds, in the source of the ``portrl`` package
and of the backends installed with it (``portrl.backends``), every construction of such an error (``raise
ConfigError(...)``, or an error built and returned) whose message is written there, and prints them grouped by
area, each message with the parts filled in at run time shown as ``{expression}``, and the problem lines of the
config checks (portrl/config/: ``problems.append(...)``, ``p.need(ok, key, rule)``), which one ``invalid config``
error lists together. The message is the whole explanation: what is wrong, then what is valid or what to run.

The committed page is docs/reference/errors.md; tests/test_error_catalog.py regenerates it and fails when the two
differ.
"""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import portrl

COMMAND = "python -m portrl.error_catalog > docs/reference/errors.md"
BASE = "UserError"
#: the error of the config checks' problem lines, all raised together as one ConfigError (portrl/config/checks.py)
CHECK_ERROR = "ConfigError (invalid config)"
#: area title by the first folder under the package (a module directly in the package: "Commands and files")
AREAS = {
    "cli": "Commands", "config": "Config", "data": "Data", "models": "Models", "rewards": "Rewards",
    "trainer": "Runs, checkpoints and training", "workers": "Workers", "rollout": "Rollout", "agent": "Agents and tools",
    "device": "Devices", "backends": "Devices", "parity": "Parity", "algo": "Algorithms", "ops": "Ops",
}


@dataclass(frozen=True)
class Message:
    """One error message: the area, the source file (relative to the package's parent) and the message's template."""

    area: str
    path: str
    error: str
    text: str


def _roots() -> List[Path]:
    """The package folders to read: portrl and the backends installed as portrl.backends (a folder of its own in a
    checkout, linked in by setup.py)."""
    roots = [Path(portrl.__file__).resolve().parent]
    backends = Path(importlib.import_module("portrl.backends").__file__ or "").resolve().parent
    if roots[0] not in backends.parents:
        roots.append(backends)
    return roots


def _files() -> Iterator[Tuple[str, Path]]:
    """(path as shown, file) of every module, sorted; backends/ files are shown as portrl/backends/..."""
    package, *others = _roots()
    seen = []
    for path in sorted(package.rglob("*.py")):
        seen.append((str(path.relative_to(package.parent)), path))
    for root in others:
        for path in sorted(root.rglob("*.py")):
            seen.append(("portrl/backends/" + str(path.relative_to(root)), path))
    yield from sorted(seen)


def _error_classes(trees: Dict[str, ast.Module]) -> set:
    """Names of UserError and of every class that derives from it, through any number of steps, in these trees."""
    names = {BASE}
    grew = True
    while grew:
        grew = False
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in names:
                    bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                    if bases & names:
                        names.add(node.name)
                        grew = True
    return names


def _slot(node: ast.expr) -> str:
    """A run-time part of a message: ``{name}`` or ``{cfg.data.name}`` for a name, ``{...}`` for anything else."""
    if isinstance(node, (ast.Name, ast.Attribute)):
        return "{" + ast.unparse(node) + "}"
    if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)):
        return "{" + ast.unparse(node) + "}"
    return "{...}"


def _template(node: ast.expr) -> Optional[str]:
    """The message an expression builds, run-time parts as ``{expression}``; None when no text is written there."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                parts.append(_slot(value.value))
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else _slot(node.left)) + (right if right is not None else _slot(node.right))
    return None


def _area(path: str) -> str:
    parts = path.split("/")
    return AREAS.get(parts[1], "Commands and files") if len(parts) > 2 else "Commands and files"


def _config_check(shown: str, node: ast.Call) -> Optional[str]:
    """A problem line of the config checks (portrl/config/): ``problems.append(MESSAGE)``, or ``p.need(ok, KEY,
    RULE)``, which reports ``KEY=<value> RULE``; each is one line of the ``invalid config:`` error."""
    if not shown.startswith("portrl/config/") or not isinstance(node.func, ast.Attribute):
        return None
    owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
    if node.func.attr == "append" and owner == "problems":
        text = _template(node.args[0])
        return " ".join(text.split()) if text else None
    if node.func.attr == "need" and len(node.args) == 3:
        key, rule = _template(node.args[1]), _template(node.args[2])
        return f"{key}={{value}} {rule}" if key and rule else None
    return None


def messages() -> List[Message]:
    """Every error message written in the source, in file order, each once per file."""
    trees = {shown: ast.parse(path.read_text(encoding="utf-8")) for shown, path in _files()}
    errors = _error_classes(trees)
    out: List[Message] = []
    for shown, tree in trees.items():
        found = []
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            check = _config_check(shown, node)
            if check:
                found.append((node.lineno, CHECK_ERROR, check))
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name not in errors:
                continue
            text = _template(node.args[0])
            if text is None or not text.strip("{}").strip() or text.startswith("{") and text.endswith("}") \
                    and text.count("{") == 1:
                continue  # a message passed through from elsewhere: it is listed where it is written
            found.append((node.lineno, name, " ".join(text.split())))
        seen = set()
        for _line, name, text in sorted(found):
            if text not in seen:
                seen.add(text)
                out.append(Message(_area(shown), shown, name, text))
    return out


def _code(text: str) -> str:
    """``text`` as one Markdown code span (a delimiter longer than any backtick run inside it)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if longest else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def render(rows: Optional[List[Message]] = None) -> str:
    """The catalog in Markdown: one table per area, the areas in a fixed order."""
    rows = messages() if rows is None else rows
    order = list(dict.fromkeys([*AREAS.values(), "Commands and files"]))
    lines = [
        "# Error messages",
        "",
        f"<!-- generated by `{COMMAND}`; do not edit by hand -->",
        "",
        "Every message a `portrl` command can end with for a mistake in what it was given (exit code 2, one line: "
        "`portrl <command>: error: <message>`), as the source writes it: `{...}` is filled in at run time with your "
        "value, the key, the file or the row. Each message says what is wrong and then what is valid or what to run; "
        "the [troubleshooting](../troubleshooting.md) page explains the common ones. `--debug` adds the traceback.",
    ]
    for area in order:
        mine = [m for m in rows if m.area == area]
        if not mine:
            continue
        lines += ["", f"## {area}", "", "| message | error | raised in |", "|---|---|---|"]
        lines += [f"| {_code(m.text)} | {m.error} | `{m.path}` |" for m in mine]
    return "\n".join(lines) + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
