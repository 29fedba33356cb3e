"""The floors of the code (docs/ARCHITECTURE.md, "Floors"): the table there is the one source.

A unit is a package or a top-level module of portrl/, or backends/ (installed as portrl.backends) or benchmarks/.
Every import counts: top-level, inside a function, under TYPE_CHECKING, relative ones resolved. A unit imports only
from lower floors (or itself); no modules import each other in a circle; an import inside a function says why on
its line (``# noqa: PLC0415  (reason)``: an optional dependency, the command line's start-up time, ...).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = "docs/ARCHITECTURE.md"
SCANNED = ("portrl", "backends", "benchmarks")
REASON = re.compile(r"#.*\bnoqa: [A-Z0-9, ]*PLC0415\b[^(]*\(\s*[^)\s][^)]*\)")

Import = Tuple[str, int, str, bool]  # (file relative to ROOT, line, imported module, inside a function)


def floors(root: Path) -> Dict[str, int]:
    """unit -> floor, from the "## Floors" table of docs/ARCHITECTURE.md (units in backticks, second column)."""
    text = (root / DOC).read_text(encoding="utf-8")
    section = text.split("\n## Floors\n", 1)[1].split("\n## ", 1)[0]
    out: Dict[str, int] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for unit in re.findall(r"`([^`]+)`", cells[1]):
                assert unit not in out, f"{DOC}: {unit} is on two floors"
                out[unit] = int(cells[0])
    return out


def files(root: Path) -> List[Path]:
    return sorted(p for top in SCANNED for p in (root / top).rglob("*.py") if "__pycache__" not in p.parts)


def module_of(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "backends":
        parts = ["portrl", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of_module(root: Path, module: str) -> Optional[str]:
    """The unit of a module of portrl (``portrl.backends.*``: backends/); None for one that is not portrl's."""
    parts = module.split(".")
    if parts[0] == "benchmarks":
        return "benchmarks/"
    if parts[0] != "portrl":
        return None
    if len(parts) == 1:
        return "portrl/__init__.py"
    if parts[1] == "backends":
        return "backends/"
    if (root / "portrl" / parts[1]).is_dir():
        return f"portrl/{parts[1]}/"
    return f"portrl/{parts[1]}.py"


def unit_of_file(root: Path, path: Path) -> str:
    rel = path.relative_to(root)
    if rel.parts[0] != "portrl":
        return f"{rel.parts[0]}/"
    return f"portrl/{rel.parts[1]}/" if len(rel.parts) > 2 else f"portrl/{rel.parts[1]}"


def _in_functions(tree: ast.AST) -> set:
    """The ids of the import statements inside a function body."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def imports(root: Path, path: Path) -> Iterator[Tuple[ast.stmt, str, bool]]:
    """Every (import statement, module it imports, inside a function) of ``path``; ``from pkg import name`` counts
    as importing ``pkg.name`` where that is a module of its own."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = module_of(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    inside = _in_functions(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, id(node) in inside
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield node, (sub if _is_module(root, sub) else target), id(node) in inside


def _is_module(root: Path, module: str) -> bool:
    parts = module.split(".")
    if parts[:2] == ["portrl", "backends"]:
        parts = parts[1:]
    elif parts[0] not in ("portrl", "benchmarks"):
        return False
    base = root.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def all_imports(root: Path) -> Iterator[Tuple[Path, ast.stmt, str, bool]]:
    for path in files(root):
        for node, target, lazy in imports(root, path):
            yield path, node, target, lazy


def units(root: Path) -> List[str]:
    """Every unit of the tree: portrl's packages and top-level modules, backends/, benchmarks/."""
    found = {f"{top}/" for top in SCANNED[1:] if (root / top).is_dir()}
    for p in (root / "portrl").iterdir():
        if p.is_dir() and (p / "__init__.py").is_file():
            found.add(f"portrl/{p.name}/")
        elif p.suffix == ".py":
            found.add(f"portrl/{p.name}")
    return sorted(found)


def floor_violations(root: Path) -> List[str]:
    """``file:line`` of every import that goes up a floor or across one (to another unit on the same floor)."""
    table = floors(root)
    out = []
    for path, node, target, lazy in all_imports(root):
        src, dst = unit_of_file(root, path), unit_of_module(root, target)
        if dst is None or dst == src:
            continue
        where = f"{path.relative_to(root)}:{node.lineno}"
        if src not in table or dst not in table:
            out.append(f"{where}: {src} -> {dst}: a unit missing from the floors table")
        elif table[dst] >= table[src]:
            kind = "across floor" if table[dst] == table[src] else "up"
            out.append(f"{where}: {src} (floor {table[src]}) imports {target} ({dst}, floor {table[dst]}): {kind}"
                       f"{' (inside a function)' if lazy else ''}")
    return out


def module_cycles(root: Path) -> List[List[str]]:
    """The circles of modules importing each other (an import of one's own package, which Python runs first
    anyway, is left out)."""
    graph: Dict[str, set] = {}
    for path, _node, target, _lazy in all_imports(root):
        src = module_of(root, path)
        graph.setdefault(src, set())
        if target != src and _is_module(root, target) and not src.startswith(target + "."):
            graph[src].add(target)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    cycles: List[List[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def unexplained_lazy_imports(root: Path) -> List[str]:
    """``file:line`` of every import inside a function whose lines carry no ``# noqa: PLC0415  (reason)``."""
    out = []
    for path in files(root):
        if path.parts[len(root.parts)] == "benchmarks":
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for node, _target, lazy in imports(root, path):
            end = node.end_lineno or node.lineno
            if lazy and not any(REASON.search(line) for line in lines[node.lineno - 1:end]):
                out.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(out))


def test_every_unit_is_on_one_floor():
    table = floors(ROOT)
    missing = [u for u in units(ROOT) if u not in table]
    assert not missing, f"units missing from the floors table of {DOC}: {', '.join(missing)}"
    gone = [u for u in table if u not in units(ROOT)]
    assert not gone, f"the floors table of {DOC} names units that do not exist: {', '.join(gone)}"


def test_no_import_goes_up_or_across_a_floor():
    found = floor_violations(ROOT)
    assert not found, "imports against the floors of " + DOC + ":\n" + "\n".join(found)


def test_no_modules_import_each_other():
    assert not module_cycles(ROOT)


def test_every_import_inside_a_function_says_why():
    found = unexplained_lazy_imports(ROOT)
    assert not found, ("an import inside a function needs its reason on its line, "
                       "`# noqa: PLC0415  (reason)`:\n" + "\n".join(found))


def _tree(tmp_path: Path, files_: Dict[str, str]) -> Path:
    for rel, text in {**files_, DOC: "# doc\n\n## Floors\n\n| floor | units | what |\n| --- | --- | --- |\n"
                      "| 3 | `portrl/cli/` | top |\n| 2 | `portrl/config/`, `portrl/agent/`, `backends/` | middle |\n"
                      "| 1 | `portrl/errors.py` | bottom |\n| 0 | `portrl/__init__.py` | face |\n\n"
                      "## Next\n"}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.fixture
def planted(tmp_path) -> Path:
    """A small tree with the rule's cases: a lazy import up, a relative one across, imports down, a circle."""
    return _tree(tmp_path, {
        "portrl/__init__.py": "",
        "portrl/errors.py": "class UserError(Exception):\n    pass\n",
        "portrl/cli/__init__.py": "from portrl.config import x\nfrom portrl.errors import UserError\n",
        "portrl/config/__init__.py": "from .schema import y\n\nx = 1\n",
        "portrl/config/schema.py": "y = 2\n",
        "portrl/agent/__init__.py": "",
        "portrl/agent/loop.py": ("def run():\n    from portrl.cli import main  # noqa: PLC0415  (planted)\n"
                                 "    from ..config import schema\n    return main, schema\n"),
        "backends/__init__.py": "",
        "backends/fake.py": "from portrl import errors\nfrom . import other\n",
        "backends/other.py": "from portrl.backends import fake\n",
    })


def test_the_rule_sees_a_planted_upward_lazy_import(planted):
    found = floor_violations(planted)
    assert any(f.startswith("portrl/agent/loop.py:2: ") and "portrl.cli" in f and "up (inside a function)" in f
               for f in found), found
    assert any(f.startswith("portrl/agent/loop.py:3: ") and "portrl.config.schema" in f and "across floor" in f
               for f in found), found  # a relative import, resolved: the same floor's other unit
    assert not [f for f in found if f.startswith(("portrl/cli/", "backends/"))], found  # down: allowed
    assert unexplained_lazy_imports(planted) == ["portrl/agent/loop.py:3: from ..config import schema"]
    assert module_cycles(planted) == [["portrl.backends.fake", "portrl.backends.other"]]
    assert units(planted) == ["backends/", "portrl/__init__.py", "portrl/agent/", "portrl/cli/", "portrl/config/",
                              "portrl/errors.py"]


def test_a_unit_missing_from_the_table_is_named(planted):
    (planted / "portrl" / "progress.py").write_text("from portrl.errors import UserError\n")
    assert "portrl/progress.py" not in floors(planted) and "portrl/progress.py" in units(planted)
    assert any("portrl/progress.py:1: " in f and "missing from the floors table" in f for f in floor_violations(planted))
