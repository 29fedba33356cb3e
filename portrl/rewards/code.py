"""Code reward: run the response's program against the row's tests in the sandbox (portrl.rewards.sandbox).

As verl's prime_code (data_source codecontests, apps, codeforces, taco): the program is the text after the last
"```python" up to the next "```", wherever it is (inside ``<think>...</think>`` too: verl removes nothing, so a
response whose only python block is in its thinking is scored on that block); a response without a fence is
taken whole as the program. The ground truth is a JSON string (or dict) in one of these forms:

* stdin/stdout: ``{"inputs": [str, ...], "outputs": [str, ...]}`` (an input or output given as a list of
  lines is joined with newlines). The program reads the input on stdin; its stdout passes when, as in verl's
  testing_util: the texts are equal after stripping (also with every line stripped); or the non-empty lines
  equal the expected non-empty stripped lines; or the same number of lines that all parse as numbers (not
  all integers) are close (|a-b| <= 1e-8 + 1e-5|b|).
* call-based: the same with ``"fn_name"``. An input is the list of arguments (APPS/TACO), or a string with one
  JSON argument per line (PRIME); the expected output is the return value (a JSON string is decoded). The
  function is looked up in the program, or on ``Solution()`` when the program defines ``class Solution``. As
  verl: a returned tuple compares as a list (at every depth); dict keys that are all integers in text are
  compared as integers. APPS and TACO wrap every return value in a one-element list: a problem whose outputs
  are all one-element lists is compared with the elements, decided once per problem (:func:`outputs_wrapped`;
  ``"outputs_wrapped": true | false`` in the ground truth decides it explicitly). Unlike verl, whose
  comparison also passes a value equal to the expected value's first element in every problem, so that
  ``return min(xs)`` is paid on a sort task and a two_sum returning one index on [0, 1].
* asserts (portrl's form for LeetCode-style data, data_source ``leetcode``): ``{"asserts": ["assert f(1) ==
  2", ...], "entry_point"?: "Solution().f", "setup"?: "from typing import *"}``: each assert is a case, run
  after ``setup`` and the program, with ``candidate`` bound to ``entry_point`` when given. Also
  ``{"test": "def check(candidate): ...", "entry_point": ...}`` (HumanEval / newfacade LeetCodeDataset): one
  case, ``check(<entry_point>)``.

Where the verdict lives: never in the program's process. A stdin/stdout program's output is compared here. A
call-based program answers one call with plain data (portrl.rewards.plain_data: builtins, and objects of the
setup's classes as attribute graphs), decoded and compared here with the expected value, which never enters
its sandbox. An assert or check() test runs in a sandbox of its own beside the program's; each call it makes
to the program is relayed (portrl.rewards.code_judge), the answer comes back as plain data, and the test
judges it there. A program can only change what it answers, as if its function had returned that: an object
equal to everything, a patched ``print`` or ``json``, an exit hook, a pass line printed and ``os._exit``,
peeks at frames, the heap or the caller's source find no expected value and no verdict to forge. A value that
is not plain data (an object of the program's own class) fails a call-based case; in an assert test it may be
called or have attributes read, never compared or tested for truth. tests/test_reward_hacks.py is the
catalogue of hacks that must score 0.

Every case is a separate sandbox run (``timeout_s`` 10 s: the limit verl's continuous score gives a case;
``memory_mb`` 1024, where verl sets none) with verl's import preamble (``from math import *`` etc., so programs
that lean on it behave as in verl). Score: ``continuous`` (verl's default for these sources) is the share
passed of the first 10 cases -- verl's score, whose cases after the 10th never change it, so they are not
run; otherwise 1.0 when every case passes, else 0.0 (cases not started by the first failure are dropped).
The result: ``{"score", "acc" (all cases passed), "passed", "total", "status" (the first failing case's
status, or "ok")}``. Cases run in parallel, ``max_workers`` at a time (portrl.rewards.sandbox.shared_pool).

Deliberate differences from verl: a stdin/stdout program runs as itself (``__main__``, real stdin and
stdout) instead of wrapped into a function with patched ``sys.stdin``; verl's last whitespace-token-set
comparison is not mirrored (in verl it compares a list with a set and never passes); a call-based expected
output that is not JSON is compared as the string instead of failing the case. With ``sandbox_fusion_url``
the same cases run on a SandboxFusion service (portrl.rewards.sandbox_fusion), read and judged the same way;
verl's SandboxFusion path differs from its prime_code: it compares stdout only after stripping trailing
newlines, raises nothing, takes a bare "```" block's content when there is no "```python" (a response with no
fence scores 0.0), and its continuous score counts one more case when a case after the 10th fails (10 of 10
passed becomes 10/11); portrl keeps prime_code's rules on both paths. Assert and check() tests need the
test's own sandbox beside the program's, which a SandboxFusion service cannot give: with a SandboxFusion URL
such rows are a DataError (verl runs them in the program's interpreter, where the program can forge a pass).

A malformed ground truth is a :class:`portrl.errors.DataError` naming the row; a bad program only ever
gets a score.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from portrl.errors import DataError
from portrl.rewards.code_judge import (
    call_request,
    is_missing,
    judge_source,
    program_source,
    read_call_result,
    run_judged,
)
from portrl.rewards.plain_data import encode
from portrl.rewards.sandbox import DEFAULT_PACKAGES, RunResult, SandboxLimits, run_program, shared_pool
from portrl.rewards.sandbox_fusion import call_run_code

CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco",  # verl's prime_code names
                "leetcode")  # portrl's assert form (the LeetCode rows of verl's baseline table)
CONTINUOUS_CASES = 10

# the names verl's testing_util makes available to every program (its "from X import *" preamble)
_PREAMBLE_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                     "statistics", "itertools", "functools", "operator", "io", "sys", "json", "builtins",
                     "typing")
JUDGE_PREAMBLE = ("".join(f"from {m} import *\n" for m in _PREAMBLE_MODULES)
                  + "".join(f"import {m}\n" for m in _PREAMBLE_MODULES if m not in ("builtins", "typing")))
PREAMBLE = JUDGE_PREAMBLE + "sys.setrecursionlimit(6 * 10 ** 5)\n"  # the program's (the test's has no deep limit)


@dataclass(frozen=True)
class Case:
    """One case: the program's sandboxed file, its stdin, and how its run is judged here; or, for assert- and
    check()-style tests, ``test``: the test's own sandboxed file, which judges (portrl.rewards.code_judge)."""

    source: str
    stdin: str
    judge: Callable[[RunResult], bool] | None = None
    test: str | None = None


# --------------------------------------------------------------------------------------------- program
def extract_program(response: str) -> str:
    """verl's prime_code rule: the text after the last ```python up to the next ``` (``<think>`` is not removed);
    the whole response when it has no ```python."""
    return response.split("```python")[-1].split("```")[0]


# ----------------------------------------------------------------------------------------- comparisons
def _is_int_text(value: Any) -> bool:
    return isinstance(value, int) or (isinstance(value, str) and value.isdigit())


def stdout_matches(output: str, expected: str | Sequence[str]) -> bool:
    """verl's stdin/stdout comparison (module docstring)."""
    if isinstance(expected, (list, tuple)):
        expected = "\n".join(str(x) for x in expected)
    expected = str(expected)
    lines = output.splitlines()
    want = expected.strip()
    if "\n".join(lines).strip() == want or "\n".join(x.strip() for x in lines).strip() == want:
        return True
    want_lines = [x.strip() for x in expected.split("\n") if x]
    got_lines = [x for x in lines if x]
    if got_lines == want_lines:
        return True
    if len(got_lines) != len(want_lines) or not got_lines:
        return False
    if all(_is_int_text(a) and _is_int_text(b) for a, b in zip(got_lines, want_lines)):
        return False
    try:
        pairs = [(float(a), float(b)) for a, b in zip(got_lines, want_lines)]
    except ValueError:
        return False
    return all(abs(a - b) <= 1e-8 + 1e-5 * abs(b) for a, b in pairs)


def _stdout_judge(want: str | Sequence[str]) -> Callable[[RunResult], bool]:
    """Passes when the program ran ok and its stdout matches ``want`` (:func:`stdout_matches`)."""
    def judge(result: RunResult) -> bool:
        return result.status == "ok" and stdout_matches(result.stdout, want)
    return judge


def _as_compared(value: Any) -> Any:
    """verl's view of a returned value: tuples as lists, at every depth."""
    if isinstance(value, (list, tuple)):
        return [_as_compared(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_compared(v) for k, v in value.items()}
    return value


def _int_keys(value: Any) -> Any:
    """A dict whose keys are all integers in text, with int keys (JSON cannot hold int keys)."""
    if isinstance(value, dict) and value and all(isinstance(k, str) and k.lstrip("-").isdigit() for k in value):
        return {int(k): v for k, v in value.items()}
    return value


def _call_judge(want: Any) -> Callable[[RunResult], bool]:
    """Passes when the program's returned value (decoded here from plain data) equals ``want`` (module
    docstring); ``want`` never enters the sandbox."""
    wants = [_as_compared(want)] + ([_as_compared(_int_keys(want))] if _int_keys(want) is not want else [])

    def judge(result: RunResult) -> bool:
        value = read_call_result(result)
        return not is_missing(value) and _as_compared(value) in wants
    return judge


# ------------------------------------------------------------------------------------------ test cases
def _describe(extra_info: dict | None) -> str:
    if isinstance(extra_info, dict) and extra_info.get("index") is not None:
        return f"row {extra_info['index']}" + (f" ({extra_info['split']})" if extra_info.get("split") else "")
    return "a row"


def parse_tests(ground_truth: str | dict, extra_info: dict | None = None) -> dict:
    """The ground truth as a dict in one of the module's forms; DataError naming the row otherwise."""
    where = _describe(extra_info)
    tests = ground_truth
    if isinstance(ground_truth, (str, bytes)):
        try:
            tests = json.loads(ground_truth)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: reward_model.ground_truth of a code row must be JSON test cases "
                            f"({exc.msg} at char {exc.pos}); valid: {{\"inputs\": [...], \"outputs\": [...]}} "
                            "(+ \"fn_name\"), or {\"asserts\": [...]}") from None
    if not isinstance(tests, dict):
        raise DataError(f"{where}: code ground truth must be a JSON object, got {type(tests).__name__}; valid: "
                        "{\"inputs\": [...], \"outputs\": [...]} (+ \"fn_name\"), or {\"asserts\": [...]}")
    if "asserts" in tests:
        asserts = tests["asserts"]
        if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) for a in asserts):
            raise DataError(f"{where}: code ground truth 'asserts' must be a non-empty list of strings")
    elif "test" in tests:
        if not isinstance(tests["test"], str) or not isinstance(tests.get("entry_point"), str):
            raise DataError(f"{where}: code ground truth with 'test' (a check(candidate) function) needs "
                            "'entry_point' (e.g. \"Solution().twoSum\"), both strings")
    else:
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise DataError(f"{where}: code ground truth needs 'inputs' and 'outputs' lists (or 'asserts'); "
                            f"got keys {sorted(tests)}")
        if len(inputs) != len(outputs) or not inputs:
            raise DataError(f"{where}: code ground truth has {len(inputs)} inputs and {len(outputs)} outputs; "
                            "they must pair up, at least one")
        if tests.get("fn_name") is not None and not isinstance(tests["fn_name"], str):
            raise DataError(f"{where}: code ground truth 'fn_name' must be a string")
    for key in ("entry_point", "setup"):
        if tests.get(key) is not None and not isinstance(tests[key], str):
            raise DataError(f"{where}: code ground truth {key!r} must be a string")
    return tests


def judged_in_own_sandbox(ground_truth: Any) -> bool:
    """Whether a row's tests are assert- or check()-style (judged in a sandbox of their own); False for a
    ground truth that is not a JSON object (the data check names those)."""
    try:
        tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    except ValueError:
        return False
    return isinstance(tests, dict) and ("asserts" in tests or "test" in tests)


def _call_args(raw: Any) -> list:
    if isinstance(raw, str):  # PRIME: one JSON value per line
        return [json.loads(line) for line in raw.split("\n") if line.strip()]
    return list(raw) if isinstance(raw, (list, tuple)) else [raw]


def _expected_value(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def outputs_wrapped(tests: dict) -> bool:
    """Whether a call-based problem's expected outputs are each wrapped in a one-element list (APPS and TACO
    wrap every return value): ``"outputs_wrapped"`` in the ground truth when given, else True exactly when
    every output is a one-element list. Decided once per problem, never per comparison."""
    given = tests.get("outputs_wrapped")
    if given is not None:
        return bool(given)
    values = [_expected_value(raw) for raw in tests["outputs"]]
    return all(isinstance(v, list) and len(v) == 1 for v in values)


def build_cases(program: str, tests: dict, limit: int | None = None, where: str = "a row") -> list[Case]:
    """The sandbox runs for ``program`` against ``tests`` (the first ``limit`` cases)."""
    setup = tests.get("setup") or ""
    cases: list[Case] = []
    if "asserts" in tests or "test" in tests:
        served = program_source(program, PREAMBLE + setup + "\n")
        statements = tests["asserts"][:limit] if "asserts" in tests else [tests["test"]]
        form = "asserts" if "asserts" in tests else "check"
        for stmt in statements:
            test = judge_source(JUDGE_PREAMBLE, setup + "\n", stmt, tests.get("entry_point"), form)
            cases.append(Case(served, "", test=test))
    elif tests.get("fn_name"):
        served = program_source(program, PREAMBLE)
        wrapped = outputs_wrapped(tests)
        for raw_in, raw_out in list(zip(tests["inputs"], tests["outputs"]))[:limit]:
            try:
                args = encode([_int_keys(a) for a in _call_args(raw_in)])
            except (TypeError, ValueError) as exc:
                raise DataError(f"{where}: a call-based test input is not JSON ({exc}); inputs are argument lists "
                                "or lines of JSON values") from None
            want = _expected_value(raw_out)
            cases.append(Case(served, call_request(tests["fn_name"], args), _call_judge(want[0] if wrapped else want)))
    else:
        head = PREAMBLE + setup + "\n" + program + "\n"
        for raw_in, raw_out in list(zip(tests["inputs"], tests["outputs"]))[:limit]:
            stdin = "\n".join(map(str, raw_in)) if isinstance(raw_in, list) else str(raw_in)
            cases.append(Case(head, stdin, _stdout_judge(raw_out)))
    return cases


# ------------------------------------------------------------------------------------------------ score
def compute_score(solution_str: str, ground_truth: str | dict, extra_info: dict | None = None,
                  continuous: bool = True, timeout_s: float = 10.0, memory_mb: int = 1024, max_workers: int = 4,
                  sandbox_fusion_url: str | None = None, allow_unisolated: bool = False,
                  packages: Sequence[str] | None = None) -> dict:
    """The code reward of one response (module docstring). ``allow_unisolated`` and ``packages``: the
    sandbox's (portrl.rewards.sandbox.SandboxLimits; config ``sandbox.*``)."""
    tests = parse_tests(ground_truth, extra_info)
    program = extract_program(solution_str)
    where = _describe(extra_info)
    cases = build_cases(program, tests, CONTINUOUS_CASES if continuous else None, where)
    limits = _limits(timeout_s, memory_mb, allow_unisolated, packages)
    if sandbox_fusion_url:
        if any(c.test is not None for c in cases):
            raise DataError(f"{where}: assert- and check()-style code tests are judged in a sandbox of their own "
                            "beside the program's, which a SandboxFusion service cannot run; valid with "
                            "reward.code.sandbox_fusion_url: stdin/stdout and call-based (fn_name) tests")
        run: Callable[..., RunResult] = partial(call_run_code, sandbox_fusion_url)
    else:
        run = run_program
    pool = shared_pool(max(1, int(max_workers)))
    futures = [pool.submit(_run_case, run, c, limits) for c in cases]
    n_pass, first_bad = 0, "ok"
    try:
        for future in futures:
            passed, result = future.result()
            if passed:
                n_pass += 1
            elif first_bad == "ok":
                first_bad = _failure(result)
                if not continuous:
                    break  # all-or-nothing: the score is 0 already; cases not started yet are dropped
    finally:
        for future in futures:
            future.cancel()  # also when interrupted (reward time limit)
    total = len(cases)
    score = n_pass / total if continuous else float(n_pass == total)
    return {"score": float(score), "acc": float(n_pass == total), "passed": n_pass, "total": total,
            "status": first_bad}


def _limits(timeout_s: float, memory_mb: int, allow_unisolated: bool, packages: Sequence[str] | None) -> SandboxLimits:
    """The sandbox limits of one case; the sandbox's own packages when ``packages`` is None."""
    return SandboxLimits(timeout_s=float(timeout_s), memory_mb=int(memory_mb), allow_unisolated=bool(allow_unisolated),
                         packages=DEFAULT_PACKAGES if packages is None else tuple(packages))


def _run_case(run: Callable[..., RunResult], case: Case, limits: SandboxLimits) -> tuple[bool, RunResult]:
    """(passed, the program's run) of one case."""
    if case.judge is None:
        assert case.test is not None  # a case is judged here or by its test's sandbox
        return run_judged(case.source, case.test, limits)
    result = run(case.source, case.stdin, limits)
    return case.judge(result), result


def _failure(result: RunResult) -> str:
    """The status of a failed case: a run that finished (or failed an assert) is "wrong"."""
    if result.status == "ok" or (result.status == "runtime_error"
                                 and result.stderr.rstrip().rsplit("\n", 1)[-1].startswith("AssertionError")):
        return "wrong"
    return result.status
