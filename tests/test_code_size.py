"""The project's size rule, wherever code lives: files and functions short enough to read whole.

* Python in portrl/, backends/, benchmarks/ and ci/: 400 lines per file, 80 per function (decorators included).
* C++ in backends/ (``*.cpp``, ``*.h``): 400 lines per file, 80 per function, from the first line of its signature
  (a ``template`` line included) to its closing brace; :func:`cpp_functions` finds them with a brace-matching scan
  (its self-test below shows what it sees and what it skips).
* Shell scripts in ci/: 400 lines per file.
* tests/: 500 lines per file, 100 per function. Chosen from the data when the rule reached tests/ (180 files: median
  124 lines, 95 % under 340, the largest 428 once the one 621-line file was split; 1820 functions: median 8 lines,
  99 % under 37, the longest 69): a test file is a flat list of cases read one at a time and its tables of inputs
  are data, so it gets a quarter more room than the code; the limit still stops the next 600-line file.
"""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_TEST_FILE_LINES = 500
MAX_TEST_FUNCTION_LINES = 100

# (folders, file pattern, lines per file, lines per function: None where functions are not measured)
RULES = (
    (("portrl", "backends", "benchmarks", "ci"), "*.py", MAX_FILE_LINES, MAX_FUNCTION_LINES),
    (("tests",), "*.py", MAX_TEST_FILE_LINES, MAX_TEST_FUNCTION_LINES),
    (("backends",), "*.cpp", MAX_FILE_LINES, MAX_FUNCTION_LINES),
    (("backends",), "*.h", MAX_FILE_LINES, MAX_FUNCTION_LINES),
    (("ci",), "*.sh", MAX_FILE_LINES, None),
)

# what the C++ scan blanks out (newlines kept, so line numbers hold): comments, string and character literals,
# preprocessor lines with their continuations
_CPP_SKIP = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'|^[ \t]*#(?:[^\n]*\\\n)*[^\n]*",
                       re.S | re.M)
# a declaration that opens a function body: it ends with its parameter list, then qualifiers or a trailing return type
_CPP_BODY = re.compile(r"\)\s*(?:(?:const|noexcept|override|final|mutable|volatile)\b\s*|->[^{};]*)*$")
_CPP_SCOPE = re.compile(r"\b(?:namespace|class|struct|union|enum|extern)\b")  # braces holding declarations
_CPP_ACCESS = re.compile(r"\b(?:public|private|protected)\s*:(?!:)")


def _matching_brace(code: str, at: int) -> int:
    depth = 0
    for i in range(at, len(code)):
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"the brace at offset {at} is never closed")


def cpp_functions(text: str) -> list[tuple[str, int, int]]:
    """``(name, first line, last line)`` of each function body in C++ source ``text``: at namespace, class or
    ``extern`` scope, a ``{`` whose declaration ends with a parameter list (a lambda or a macro block such as
    ``TORCH_LIBRARY(ns, m) {`` counts; a lambda inside a function is part of that function). Any other brace at that
    scope (an initializer, a member's brace initializer) is skipped whole as part of the declaration around it."""
    code = _CPP_SKIP.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)
    found = []
    start = i = 0  # start: where the current declaration's text begins
    while i < len(code):
        c = code[i]
        if c in ";}":
            start = i + 1
        elif c == "{":
            head = code[start:i]
            head = head[max((m.end() for m in _CPP_ACCESS.finditer(head)), default=0):]
            if _CPP_BODY.search(head):
                close = _matching_brace(code, i)
                name = re.search(r"(\w+)\s*\(", head)
                first = start + len(head) - len(head.lstrip()) + (len(code[start:i]) - len(head))
                found.append((name.group(1) if name else "<lambda>", code.count("\n", 0, first) + 1,
                              code.count("\n", 0, close) + 1))
                start = i = close + 1
                continue
            if _CPP_SCOPE.search(head):
                start = i + 1  # the declarations inside come next
            else:
                i = _matching_brace(code, i)  # an initializer: part of the declaration around it
        i += 1
    return found


def _functions(path: Path, rel: str, text: str) -> list[tuple[str, int]]:
    """``(name, lines)`` of each function in a Python or C++ file."""
    if path.suffix == ".py":
        return [(node.name, node.end_lineno - min([node.lineno] + [d.lineno for d in node.decorator_list]) + 1)
                for node in ast.walk(ast.parse(text, filename=rel))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [(name, last - first + 1) for name, first, last in cpp_functions(text)]


def oversized() -> list[str]:
    """``path (N lines)`` and ``path:function (N lines)`` of every file and function over its limits (RULES)."""
    found = []
    for folders, pattern, max_file, max_function in RULES:
        for path in sorted(p for folder in folders if (ROOT / folder).is_dir() for p in (ROOT / folder).rglob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            text = path.read_text(encoding="utf-8")
            lines = len(text.splitlines())
            if lines > max_file:
                found.append(f"{rel} ({lines} lines)")
            if max_function is not None:
                found += [f"{rel}:{name} ({length} lines)" for name, length in _functions(path, rel, text)
                          if length > max_function]
    return found


def test_no_file_or_function_over_the_limits():
    offenders = oversized()
    assert not offenders, (f"over {MAX_FILE_LINES} lines per file / {MAX_FUNCTION_LINES} per function, tests/ "
                           f"{MAX_TEST_FILE_LINES} / {MAX_TEST_FUNCTION_LINES} (split along a seam, one purpose per "
                           "file): " + "; ".join(offenders))


def test_the_rule_sees_a_long_function(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "portrl").mkdir()
    (tmp_path / "backends").mkdir()
    (tmp_path / "portrl" / "long.py").write_text(f"def long():\n{body}\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert oversized() == [f"portrl/long.py:long ({MAX_FUNCTION_LINES + 1} lines)"]


def test_the_rule_sees_every_folder_with_its_limits(tmp_path, monkeypatch):
    def write(rel: str, lines: int, text: str = "") -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text + "".join(f"x{i} = {i}\n" for i in range(lines)))

    write("benchmarks/long.py", MAX_FILE_LINES + 1)
    write("ci/long.sh", MAX_FILE_LINES + 1)
    write("ci/short.sh", MAX_FILE_LINES)
    write("tests/test_fits.py", MAX_TEST_FILE_LINES)
    write("tests/test_long.py", MAX_TEST_FILE_LINES + 1)
    write("tests/test_fn.py", 0, "def case():\n" + "".join(f"    x{i} = {i}\n" for i in range(MAX_TEST_FUNCTION_LINES)))
    write("backends/cpu/long.h", MAX_FILE_LINES + 1)
    body = "".join(f"  x += {i};\n" for i in range(MAX_FUNCTION_LINES - 2))
    write("backends/cpu/k.cpp", 0, f"int fits(int x) {{\n{body}}}\nint over(int x) {{\n{body}  return x;\n}}\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert oversized() == ["benchmarks/long.py (401 lines)", "tests/test_fn.py:case (101 lines)",
                           "tests/test_long.py (501 lines)", "backends/cpu/k.cpp:over (81 lines)",
                           "backends/cpu/long.h (401 lines)", "ci/long.sh (401 lines)"]


def test_the_cpp_scan_finds_each_function_and_skips_the_rest():
    source = """\
// a comment with a brace { and a call f() {
#include <vector>
#define OPEN {
namespace {
constexpr int TABLE[] = {1, 2, 3};
/* int commented(int x) {
   } */
template <typename T>
T twice(T x) {
  auto add = [&](T y) { return x + y; };  // a lambda: part of twice
  if (x > 0) { return add(x); }
  return x;
}
struct Kernel {
 public:
  Kernel(int n) : n_{n}, m_(n) {
    const char* s = "} not a brace {";
  }
  int size() const noexcept { return n_; }
  int n_, m_;
};
}  // namespace
auto trailing(int x) -> int {
  return x;
}
LIBRARY(ns, m) {
  m.def("f(Tensor x) -> Tensor");
}
"""
    assert cpp_functions(source) == [("twice", 8, 13), ("Kernel", 16, 18), ("size", 19, 19),
                                     ("trailing", 23, 25), ("LIBRARY", 26, 28)]
