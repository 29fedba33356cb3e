"""The tools layer of the agent loop (portrl/agent/tools): @tool schemas, the YAML tool config and its errors,
run_calls' error paths and limits, truncation, and the built-ins (calculator, python on the sandbox, BM25 search)."""

from __future__ import annotations

import json
import pickle
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from typing import Any, List, Optional

import pytest

from portrl.agent.tools import (
    Tool, ToolConfigError, ToolResult, ToolSchemaError, check_schema, load_tool_config, merge_tools_kwargs,
    run_calls, run_calls_many, tool, tool_schemas, truncate_text)
from portrl.agent.tools.builtin_calculator import MAX_DIGITS, CalculatorTool, evaluate
from portrl.agent.tools.builtin_python import NO_OUTPUT, PythonTool
from portrl.agent.tools.builtin_search import NO_MATCH, SearchTool
from portrl.errors import DataError, UserError


@dataclass
class Call:
    name: str
    arguments: Optional[dict] = None
    error: Optional[str] = None


# ------------------------------------------------------------------------------------------------ @tool
@tool
def lookup(city: str, year: int = 2024, scale: Optional[float] = None, tags: List[str] = [],
           flags: dict = {}, exact: bool = False, *, ground_truth: str = "none") -> str:
    """Population of a city.

    More text that is not the description.

    Args:
        city: the city's English
            name
        year (int): the census year
    """
    return f"{city}/{year}/{ground_truth}"


def test_decorator_builds_the_schema_from_the_signature():
    fn = lookup.schema["function"]
    assert lookup.name == "lookup" and fn["name"] == "lookup"
    assert fn["description"] == "Population of a city."
    params = fn["parameters"]
    assert params["required"] == ["city"]
    assert params["properties"] == {
        "city": {"type": "string", "description": "the city's English name"},
        "year": {"type": "integer", "description": "the census year"},
        "scale": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
        "flags": {"type": "object"}, "exact": {"type": "boolean"}}
    assert "ground_truth" not in params["properties"]  # keyword-only: from the row
    assert check_schema(lookup.schema, "here") == lookup.schema
    assert lookup("Oslo") == "Oslo/2024/none"  # still callable as the function


def test_decorator_fills_keyword_only_parameters_from_the_row():
    assert lookup.call({"city": "Oslo"}, {"ground_truth": "709000", "unused": 1}) == "Oslo/2024/709000"
    assert lookup.call({"city": "Oslo", "year": 1990}, {}) == "Oslo/1990/none"

    @tool(name="check", description="Check an answer")
    def check_answer(answer: str, *, ground_truth: str) -> ToolResult:
        return ToolResult("correct" if answer == ground_truth else "wrong", reward=float(answer == ground_truth))

    assert check_answer.name == "check" and check_answer.schema["function"]["description"] == "Check an answer"
    [ok, missing] = run_calls({"check": check_answer}, [Call("check", {"answer": "7"})] * 2,
                              {"check": {"ground_truth": "7"}}, max_parallel=2)
    assert (ok.text, ok.reward, ok.error) == ("correct", 1.0, False)
    [missing] = run_calls({"check": check_answer}, [Call("check", {"answer": "7"})], {})
    assert missing.error and "the row gives no 'ground_truth'" in missing.text


def test_decorator_writes_dicts_as_json_and_refuses_what_a_schema_cannot_say():
    @tool
    def info(n: int) -> dict:
        return {"n": n, "sq": n * n}

    assert json.loads(info.call({"n": 3}, {})) == {"n": 3, "sq": 9}
    with pytest.raises(TypeError, match="has no annotation"):
        tool(lambda x: x)
    with pytest.raises(TypeError, match=r"\*args"):
        @tool
        def many(*args: int) -> str:
            return ""
    with pytest.raises(TypeError, match="valid: str, int"):
        @tool
        def odd(x: complex) -> str:
            return ""


# ----------------------------------------------------------------------------------------------- schema
@pytest.mark.parametrize("schema, problem", [
    ({"type": "func", "function": {"name": "f"}}, "has type 'func'"),
    ({"type": "function"}, "no 'function'"),
    ({"type": "function", "function": {"name": "1f"}}, "is not a name"),
    ({"type": "function", "function": {"name": "f", "description": 3}}, "not a string"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}, "type 'object'"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "str"}}}}}, "valid types: string, integer"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string"}}, "required": ["y"]}}}, "names 'y'"),
    ({"type": "function", "function": {"name": "f", "params": {}}}, "unknown key(s) 'params'"),
])
def test_check_schema_names_where_and_what(schema, problem):
    with pytest.raises(ToolSchemaError) as info:
        check_schema(schema, "tools.yaml, tools[0]")
    message = str(info.value)
    assert message.startswith("tools.yaml, tools[0]: tool schema") and problem in message
    assert "\n" not in message and "valid:" in message


def test_check_schema_fills_in_what_may_be_left_out():
    out = check_schema({"type": "function", "function": {"name": "ping"}}, "x")
    assert out["function"] == {"name": "ping", "description": "",
                               "parameters": {"type": "object", "properties": {}}}


# ----------------------------------------------------------------------------------------------- config
TOOLS_PY = '''
from portrl.agent.tools import Tool, ToolResult, tool

class Echo(Tool):
    def __init__(self, prefix="echo"):
        self.prefix = prefix
        self.name = "echo"
        self.schema = {"type": "function", "function": {"name": "echo", "description": "Echo", "parameters": {
            "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

    def call(self, arguments, row_kwargs):
        return ToolResult(self.prefix + ":" + arguments["text"])

@tool
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()

def whisper(text: str) -> str:
    """Lower-case the text."""
    return text.lower()

NOT_A_TOOL = 3
'''


def _write(tmp_path, text: str, name: str = "tools.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_config_loads_every_form(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "my_tools.py").write_text(TOOLS_PY)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "local_tools.py").write_text(TOOLS_PY)
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"contents": "\"Oslo\"\nOslo is the capital of Norway."}))
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    path = _write(tmp_path, """
        tools:
          - {name: calculator}
          - {name: python, config: {timeout_s: 2, memory_mb: 256}}
          - {name: search, config: {corpus_path: corpus.jsonl, top_k: 2}}
          - {class_name: my_tools.Echo, config: {type: native, prefix: dotted}}
          - class_name: "my_tools:Echo"
            config: {prefix: colon}
            tool_schema: {type: function, function: {name: echo2, description: Echo again, parameters:
                          {type: object, properties: {text: {type: string}}, required: [text]}}}
          - {class_name: "sub/local_tools.py:shout"}
          - {class_name: "sub/local_tools.py:whisper"}
        """)
    tools = load_tool_config(path)
    assert list(tools) == ["calculator", "python", "search", "echo", "echo2", "shout", "whisper"]
    assert isinstance(tools["calculator"], CalculatorTool)
    assert tools["python"].limits.timeout_s == 2.0 and tools["python"].limits.memory_mb == 256
    assert isinstance(tools["search"], SearchTool) and tools["search"].top_k == 2
    assert tools["echo"].call({"text": "a"}, {}).text == "dotted:a"
    assert tools["echo2"].call({"text": "a"}, {}).text == "colon:a" and tools["echo2"].name == "echo2"
    assert tools["shout"].call({"text": "a"}, {}) == "A"
    assert tools["whisper"].schema["function"]["description"] == "Lower-case the text."
    schemas = tool_schemas(tools)
    assert [s["function"]["name"] for s in schemas] == list(tools)
    schemas[0]["function"]["name"] = "changed"  # a copy: the tools keep their schema
    assert tools["calculator"].schema["function"]["name"] == "calculator"
    assert load_tool_config(_write(tmp_path, "tools: []", "empty.yaml")) == {}


@pytest.mark.parametrize("text, problem", [
    ("tools: [", "is not valid YAML"),
    ("other: 1", "has no 'tools' list"),
    ("tools: [3]", "tools[0]: an entry is a int"),
    ("tools: [{name: abacus}]", "tools[0] (abacus): unknown built-in tool 'abacus'; valid: calculator, python, search"),
    ("tools: [{name: calculator, class: x}]", "unknown key(s) 'class'"),
    ("tools: [{name: calc, class_name: tools.py:Echo}]", "both name and class_name; give one"),
    ("tools: [{class_name: no_such_module.Tool}]", "cannot import 'no_such_module' (ModuleNotFoundError"),
    ("tools: [{class_name: tools.py:Missing}]", "'tools.py' defines no 'Missing'"),
    ("tools: [{class_name: nothere.py:Echo}]", "tool file"),
    ("tools: [{class_name: tools.py:NOT_A_TOOL}]", "names a int, not a Tool subclass"),
    ("tools: [{class_name: tools.py:Echo, config: {colour: red}}]", "valid config keys: prefix"),
    ("tools: [{class_name: tools.py:shout, config: {a: 1}}]", "a function tool takes no config"),
    ("tools: [{name: python, config: {timeout_s: 0}}]", "timeout_s must be a number of seconds > 0"),
    ("tools: [{name: python, config: {type: mcp}}]", "config.type 'mcp' is not supported"),
    ("tools: [{name: python, config: {max_concurrent: 0}}]", "max_concurrent must be an integer >= 1"),
    ("tools: [{name: search, config: {corpus_path: none.jsonl}}]", "search corpus"),
    ("tools: [{name: calculator, tool_schema: {type: function, function: {name: 'a b'}}}]", "is not a name"),
    ("tools: [{class_name: my.Bare}]", "tools[0] (my.Bare): no schema: the tool sets none"),
    ("tools: [{name: calculator}, {class_name: tools.py:Echo}, {name: calculator}]",
     "tools[2] (calculator): a second tool named 'calculator' (the first: "),
])
def test_config_errors_are_one_line_naming_the_file_and_entry(tmp_path, monkeypatch, text, problem):
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    (tmp_path / "my.py").write_text("from portrl.agent.tools import Tool\nclass Bare(Tool):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write(tmp_path, text, "bad.yaml")
    with pytest.raises(UserError) as info:
        load_tool_config(path)
    message = str(info.value)
    assert isinstance(info.value, ToolConfigError) and "\n" not in message
    assert str(path) in message and problem in message


def test_a_missing_config_file_names_the_setting(tmp_path):
    with pytest.raises(ToolConfigError, match=r"tool config '.*nope.yaml' does not exist \(rollout.multi_turn"):
        load_tool_config(tmp_path / "nope.yaml")


# -------------------------------------------------------------------------------------------- run_calls
class Sleeper(Tool):
    name = "sleeper"
    schema = {"type": "function", "function": {"name": "sleeper", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}

    def __init__(self, release: threading.Event, barrier: Optional[threading.Barrier] = None):
        self.release, self.barrier = release, barrier

    def call(self, arguments, row_kwargs):
        if arguments["n"] < 0:
            raise ValueError("n must be >= 0\nsecond line")
        if self.barrier is not None:
            self.barrier.wait(timeout=5)  # passes only when the calls run at the same time
            return f"met {arguments['n']}"
        self.release.wait(timeout=10)
        return 5


def test_run_calls_turns_every_failure_into_a_message():
    release = threading.Event()
    tools: Any = {"sleeper": Sleeper(release), "calculator": CalculatorTool()}
    calls = [Call("nope", {}), Call("sleeper", None, error="invalid JSON at char 3"), Call("sleeper", {}),
             Call("sleeper", {"n": 1, "m": 2}), Call("sleeper", {"n": "1"}), Call("sleeper", {"n": -1}),
             Call("calculator", {"expression": "2**70"}), Call("sleeper", {"n": 1})]
    start = time.monotonic()
    try:
        results = run_calls(tools, calls, {}, timeout_s=0.3, max_parallel=7)
    finally:
        release.set()
    assert time.monotonic() - start < 3
    texts = [r.text for r in results]
    assert [r.error for r in results] == [True] * 6 + [False, True]
    assert texts[0] == "Error: unknown tool 'nope'; valid tools: calculator, sleeper"
    assert texts[1] == "Error: the tool call could not be read: invalid JSON at char 3"
    assert texts[2] == "Error: tool 'sleeper': missing required argument(s) 'n'"
    assert texts[3] == "Error: tool 'sleeper': unknown argument(s) 'm'; valid: 'n'"
    assert texts[4] == "Error: tool 'sleeper': argument 'n' must be of type integer, got string"
    assert texts[5] == "Error: tool 'sleeper' raised ValueError: n must be >= 0 second line"
    assert texts[6] == str(2 ** 70)
    assert texts[7] == "Error: at most 7 tool call(s) run per turn; call 8 ('sleeper') was not run"


def test_run_calls_times_out_and_checks_what_a_tool_returns():
    release = threading.Event()
    try:
        [slow] = run_calls({"sleeper": Sleeper(release)}, [Call("sleeper", {"n": 1})], {}, timeout_s=0.2)
    finally:
        release.set()
    assert slow.error and slow.text == "Error: tool 'sleeper' timed out after 0.2 s"
    time.sleep(0.05)
    [wrong_type] = run_calls({"sleeper": Sleeper(release)}, [Call("sleeper", {"n": 1})], {}, timeout_s=5)
    assert wrong_type.error and wrong_type.text == "Error: tool 'sleeper' returned a int, not a str or ToolResult"


def test_run_calls_runs_up_to_max_parallel_calls_at_once():
    barrier = threading.Barrier(2)
    tools: Any = {"sleeper": Sleeper(threading.Event(), barrier)}
    results = run_calls(tools, [Call("sleeper", {"n": 1}), Call("sleeper", {"n": 2})], {}, timeout_s=8, max_parallel=2)
    assert [r.text for r in results] == ["met 1", "met 2"]
    one = run_calls(tools, [Call("calculator", {})] + [Call("sleeper", {"n": 1})], {}, max_parallel=1)
    assert one[1].text.startswith("Error: at most 1 tool call(s)")


def test_run_calls_many_runs_the_turns_of_many_rows_at_once():
    barrier = threading.Barrier(2)
    tools: Any = {"sleeper": Sleeper(threading.Event(), barrier), "lookup": lookup}
    rows = [[Call("sleeper", {"n": 1}), Call("lookup", {"city": "Oslo"})],
            [Call("sleeper", {"n": 2})], [], [Call("lookup", {"city": "Rome"})]]
    kwargs = [{}, {}, {}, {"lookup": {"ground_truth": "2.8M"}}]
    out = run_calls_many(tools, rows, kwargs, timeout_s=8, max_parallel=1)
    assert [[r.text for r in row] for row in out] == [
        ["met 1", "Error: at most 1 tool call(s) run per turn; call 2 ('lookup') was not run"], ["met 2"], [],
        ["Rome/2024/2.8M"]]
    with pytest.raises(ValueError, match="2 rows of calls but 1 rows of kwargs"):
        run_calls_many(tools, [[], []], [{}])


def test_merge_tools_kwargs_reads_verls_tools_kwargs():
    row = {"calc": {"create_kwargs": {"ground_truth": "3", "a": 1}, "execute_kwargs": {"a": 2},
                    "calc_reward_kwargs": {}}, "search": None, "python": {"create_kwargs": None}}
    assert merge_tools_kwargs(row) == {"calc": {"ground_truth": "3", "a": 2}, "search": {}, "python": {}}
    assert merge_tools_kwargs(None) == {}
    with pytest.raises(DataError, match=r"row 4: extra_info.tools_kwargs.calc.execute_kwargs is a list"):
        merge_tools_kwargs({"calc": {"execute_kwargs": [1]}}, "row 4")
    with pytest.raises(DataError, match="is a str; valid: a mapping"):
        merge_tools_kwargs("x", "row 4")


@pytest.mark.parametrize("side, want", [
    ("left", "abcd...(truncated)"), ("right", "(truncated)...ghij"), ("middle", "ab...(truncated)...ij")])
def test_truncate_text_as_verl(side, want):
    assert truncate_text("abcdefghij", 4, side) == want
    assert truncate_text("abcd", 4, side) == "abcd"


def test_truncate_text_refuses_another_side():
    with pytest.raises(ValueError, match="valid: left, right, middle"):
        truncate_text("abc", 1, "top")


# ---------------------------------------------------------------------------------------------- builtins
def test_calculator_is_exact_on_big_ints():
    a, b = 123456789012345678901234567890, 987654321098765432109876543210
    assert evaluate(f"{a} * {b} - ({a} + 7) // 3 % 1000") == a * b - (a + 7) // 3 % 1000
    assert evaluate("2 ** 4000") == 2 ** 4000 and evaluate("-(-5) ** 2") == -25
    assert evaluate("10 / 4") == 2.5 and evaluate("10 / 5") == 2 and isinstance(evaluate("10 / 5"), int)
    assert CalculatorTool().call({"expression": f"{a} * {b}"}, {}).text == str(a * b)


@pytest.mark.parametrize("expression, problem", [
    ("9 ** 9 ** 9", f"more than {MAX_DIGITS} digits"), ("10 ** 4000", f"more than {MAX_DIGITS} digits"),
    ("1 / 0", "division by zero"), ("2 ^ 3", "write **"), ("__import__('os').system('ls')", "only numbers"),
    ("1e308 * 10", "too large for a float"), ("(1", "not an arithmetic expression"), ("True + 1", "only numbers"),
])
def test_calculator_refuses_with_a_message(expression, problem):
    start = time.monotonic()
    result = CalculatorTool().call({"expression": expression}, {})
    assert result.error and result.text.startswith("Error: ") and problem in result.text
    assert time.monotonic() - start < 1  # a huge power is refused, not computed


def test_python_tool_runs_code_in_the_sandbox():
    py = PythonTool(timeout_s=1.0, memory_mb=256)
    ok = py.call({"code": "```python\nprint(sum(range(10 ** 6)))\n```"}, {})
    assert (ok.text, ok.error) == ("499999500000\n", False)
    assert py.call({"code": "print('no newline', end='')"}, {}).text == "no newline"
    raised = py.call({"code": "print('before')\n1 / 0"}, {})
    assert not raised.error and raised.text.startswith("before\nTraceback (most recent call last):")
    assert 'File "main.py", line 2' in raised.text and raised.text.endswith("ZeroDivisionError: division by zero")
    assert py.call({"code": "x = 1"}, {}).text == NO_OUTPUT
    assert py.call({"code": "import sys; print(1); sys.exit(3)"}, {}).text == (
        "1\n(the program stopped with exit code 3)")
    slow = py.call({"code": "print('start', flush=True)\nwhile True: pass"}, {})
    assert slow.error and slow.text == "start\nError: the program ran past the time limit of 1 s"
    one_slot = pickle.loads(pickle.dumps(PythonTool(timeout_s=2.0, max_concurrent=1)))
    start = time.monotonic()
    out = run_calls({"python": one_slot}, [Call("python", {"code": "import time; time.sleep(0.4)"})] * 2, {},
                    max_parallel=2)
    assert [r.text for r in out] == [NO_OUTPUT] * 2 and time.monotonic() - start >= 0.8  # one after the other


def _corpus(tmp_path):
    docs = [{"contents": "\"Oslo\"\nOslo is the capital and most populous city of Norway."},
            {"title": "Bergen", "text": "Bergen is a city on the west coast of Norway, known for rain."},
            {"text": "The fjords of western Norway attract many visitors."},
            {"contents": "\"Paris\"\nParis is the capital of France."}]
    path = tmp_path / "wiki.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in docs) + "\n\n")
    return path


def test_search_ranks_the_right_document_first(tmp_path):
    search = SearchTool(str(_corpus(tmp_path)), top_k=2)
    result = search.call({"query": "What is the capital of Norway?"}, {})
    assert not result.error
    lines = result.text.splitlines()
    assert lines[0] == "Doc 1(Title: \"Oslo\") Oslo is the capital and most populous city of Norway."
    assert lines[1].startswith("Doc 2(Title: ") and len(lines) == 2
    assert search.call({"query": "rain on the west coast"}, {}).text.startswith("Doc 1(Title: Bergen) Bergen is")
    assert search.call({"query": "zebra"}, {}).text == NO_MATCH
    assert SearchTool(str(_corpus(tmp_path)), top_k=10).search("fjords visitors")[0] == (
        "", "The fjords of western Norway attract many visitors.")


def test_search_corpus_errors_and_a_missing_bm25s(tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"contents": "a"}\n{"body": "b"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl' line 2: no \"contents\" or \"text\" string"):
        SearchTool(str(bad))
    bad.write_text('{"contents": "a"}\nnot json\n')
    with pytest.raises(UserError, match=r"line 2: not JSON"):
        SearchTool(str(bad))
    monkeypatch.setitem(sys.modules, "bm25s", None)
    with pytest.raises(UserError, match=r"needs the bm25s package.*pip install 'portrl\[agent\]'"):
        SearchTool(str(_corpus(tmp_path)))


def test_a_missing_corpus_is_a_data_file_checked_with_the_run_not_at_compose(tmp_path):
    path = _write(tmp_path, "tools: [{name: search, config: {corpus_path: none.jsonl, top_k: 2}}]", "s.yaml")
    schema_only = load_tool_config(path, open_files=False)["search"]
    assert schema_only.schema["function"]["name"] == "search"
    with pytest.raises(ToolConfigError, match="valid config keys: corpus_path, top_k"):
        load_tool_config(_write(tmp_path, "tools: [{name: search, config: {corpus: x.jsonl}}]", "t.yaml"),
                         open_files=False)
    with pytest.raises(ToolConfigError, match=r"search corpus '.*none.jsonl' does not exist"):
        load_tool_config(path)


def test_a_relative_configs_path_outside_the_repository_is_the_wheels_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tools = load_tool_config("configs/tools/calculator.yaml")
    assert list(tools) == ["calculator"]
    with pytest.raises(ToolConfigError, match="'configs/tools/none.yaml' does not exist"):
        load_tool_config("configs/tools/none.yaml")
