"""Code problems ({"question", "tests", "data_source"?}) -> verl rows scored by portrl.rewards.code.

``question`` (or ``prompt`` / ``problem``) is the task text; ``tests`` (or ``input_output``, as in the APPS
and TACO datasets) is a JSON object (or its JSON text) in one of portrl.rewards.code's forms: stdin/stdout
``{"inputs", "outputs"}``, call-based with ``"fn_name"``, or ``{"asserts": [...], "entry_point"?, "setup"?}``
/ ``{"test", "entry_point"}``. The prompt is one user message: the question, the ``starter_code`` when the
row has one (APPS / TACO: the function or class to complete), and CODE_INSTRUCTION;
``reward_model.ground_truth`` is the tests as JSON text; ``ability`` is "code". ``data_source``: the
``--data-source`` given, else the row's, else "codecontests"; it must be one of the code reward's names.
Without an input file, the problem set shipped with portrl (``code_problems.jsonl``, 13 small self-written
problems in every test form, each with a reference solution) is used.
"""

from __future__ import annotations

import json
from pathlib import Path

from portrl.data.schema import DataError, make_row
from portrl.rewards.code import CODE_SOURCES, parse_tests

BUILTIN_PROBLEMS = Path(__file__).with_name("code_problems.jsonl")
DEFAULT_DATA_SOURCE = "codecontests"
CODE_INSTRUCTION = ("Write a complete Python 3 program that solves the problem. Put the whole program in one "
                    "fenced code block that starts with ```python.")


def convert(records: list[tuple[str, int, dict]], split: str, data_source: str | None = None) -> list[dict]:
    """verl rows from (file, row index, raw record) triples; DataError naming the row when one is bad."""
    if data_source is not None and data_source not in CODE_SOURCES:
        raise DataError(f"--data-source {data_source!r} is not a code data source; valid: {', '.join(CODE_SOURCES)}")
    rows: list[dict] = []
    for where, i, rec in records:
        if not isinstance(rec, dict):
            raise DataError(f"{where}: row {i}: is a {type(rec).__name__}, expected a record")
        question = next((rec[k] for k in ("question", "prompt", "problem") if isinstance(rec.get(k), str)), None)
        if not question or not question.strip():
            raise DataError(f"{where}: row {i}: field 'question' (or 'prompt' / 'problem') is missing or empty")
        raw_tests = rec.get("tests") if rec.get("tests") is not None else rec.get("input_output")
        if raw_tests is None or raw_tests == "":
            raise DataError(f"{where}: row {i}: field 'tests' (or 'input_output') is missing or empty (the test "
                            "cases, e.g. {\"inputs\": [...], \"outputs\": [...]})")
        try:
            tests = parse_tests(raw_tests)
        except DataError as exc:
            raise DataError(f"{where}: row {i}: {str(exc).removeprefix('a row: ')}") from None
        source = data_source or rec.get("data_source") or DEFAULT_DATA_SOURCE
        if source not in CODE_SOURCES:
            raise DataError(f"{where}: row {i}: data_source {source!r} is not a code data source; valid: "
                            f"{', '.join(CODE_SOURCES)}")
        extra = {"question": question}
        if rec.get("id") is not None:
            extra["problem_id"] = str(rec["id"])
        content = question.strip()
        starter = rec.get("starter_code")
        if isinstance(starter, str) and starter.strip():
            content += f"\n\nStart from this code:\n```python\n{starter.rstrip()}\n```"
        rows.append(make_row(source, content + "\n\n" + CODE_INSTRUCTION, json.dumps(tests), split, len(rows),
                             ability="code", **extra))
    return rows
