"""Any question-answer rows -> verl rows scored by a built-in rule reward (``portrl preprocess qa``).

A raw record holds a question and an answer under keys found by name (``--question-key`` /
``--answer-key`` override): the first of :data:`QUESTION_KEYS` and of :data:`ANSWER_KEYS` present in the
first record. The question is a string (or a list of chat messages, whose last user turn gets the
instruction); the answer a string or a number. The ground truth is the answer's final value:

* ``"... #### 72"`` (GSM8K's worked answers) -> ``72`` (thousands commas and ``$`` removed);
* ``"... \\boxed{\\frac{1}{2}}"`` (MATH's solutions) -> ``\\frac{1}{2}``;
* anything else -> the answer as written (stripped); a number as the number it is (57.0 -> ``57``).

``data_source`` picks the reward that scores the row (portrl.rewards.registry). The default, ``qa_boxed``,
scores the last ``\\boxed{}`` of the response against the ground truth by equivalence (numbers, fractions,
expressions, short text answers), and the default instruction asks for exactly that box. A gsm8k source
(``openai/gsm8k``) asks for and scores ``#### N``; a DAPO source (``math_dapo``, or ``math`` as in verl) ``Answer: N``; ``arith``
scores the last integer and adds no instruction. Any other name is written as given with no instruction:
a run then needs a custom reward (``reward.custom.path``). Code sources need tests, not answers: use
``portrl preprocess code``.
"""

from __future__ import annotations

import logging
from typing import Any

from portrl.data.dapo_math import DAPO_PREFIX, DAPO_SUFFIX
from portrl.data.geo3k import GEO3K_INSTRUCTION
from portrl.data.gsm8k import extract_ground_truth
from portrl.data.schema import GSM8K_INSTRUCTION, MATH_INSTRUCTION, DataError, make_row
from portrl.rewards.registry import UnknownDataSource, reward_kind
from portrl.rewards.text import ground_truth_text, last_boxed

log = logging.getLogger(__name__)

QUESTION_KEYS = ("question", "problem", "prompt", "input", "query")
ANSWER_KEYS = ("answer", "solution", "output", "target", "ground_truth")
DEFAULT_DATA_SOURCE = "qa_boxed"
#: reward kind -> (text before the question, text after it); the instruction asks for what the reward reads
INSTRUCTIONS = {"math": ("", " " + MATH_INSTRUCTION), "gsm8k": ("", " " + GSM8K_INSTRUCTION),
                "dapo_math": (DAPO_PREFIX, DAPO_SUFFIX), "arith": ("", ""),
                # numina_* read the last \boxed{} too; hiyouga/geometry3k also a <think> block; searchR1_* an <answer> tag
                "prime_math": ("", " " + MATH_INSTRUCTION), "geo3k": ("", " " + GEO3K_INSTRUCTION),
                "search_qa": ("", " Give the final answer between <answer> and </answer>."),
                "arith_tool": ("", " Give the final answer between <answer> and </answer>.")}


def find_key(record: Any, given: str | None, candidates: tuple[str, ...], what: str, flag: str, where: str) -> str:
    """The key of ``record`` holding the ``what`` (``given`` when set); DataError naming the keys present."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: row 0: is a {type(record).__name__}, expected a record with a question and an answer")
    keys = list(record)
    if given is not None:
        if given not in record:
            raise DataError(f"{where}: {flag} {given!r} is not a key of the rows; keys present: {', '.join(keys)}")
        return given
    for key in candidates:
        if key in record:
            return key
    raise DataError(f"{where}: no {what} key among {', '.join(candidates)}; keys present: {', '.join(keys)}; "
                    f"name it with {flag} KEY")


def answer_ground_truth(answer: Any) -> str | None:
    """The final value of an answer (see the module docstring), or None when there is none. A verl
    ``reward_model`` struct gives its ``ground_truth``."""
    if isinstance(answer, dict) and "ground_truth" in answer:
        answer = answer["ground_truth"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return None
    if not isinstance(answer, str):
        text = ground_truth_text(answer)
        return None if text in ("nan", "inf", "-inf") else text
    if "####" in answer:
        return extract_ground_truth(answer)
    boxed = last_boxed(answer)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    return answer.strip() or None


def instruction_for(data_source: str) -> tuple[str, str] | None:
    """(prefix, suffix) around the question for ``data_source``'s reward; None for a source without a
    built-in rule reward (a custom reward scores it); DataError for a code source (it needs tests)."""
    try:
        kind = reward_kind(data_source)
    except UnknownDataSource:
        return None
    if kind == "code":
        raise DataError(f"data_source {data_source!r} is scored by running tests; question-answer rows have none: "
                        "use `portrl preprocess code`")
    return INSTRUCTIONS[kind]


def _messages(question: Any, where: str, i: int, key: str) -> list[dict]:
    if isinstance(question, str):
        if not question.strip():
            raise DataError(f"{where}: row {i}: field {key!r} is empty")
        return [{"role": "user", "content": question}]
    if isinstance(question, (list, tuple)) and question and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in question):
        return [{"role": m["role"], "content": m["content"]} for m in question]
    raise DataError(f"{where}: row {i}: field {key!r} must be a string or a list of chat messages "
                    f"{{'role', 'content'}}, got {type(question).__name__}")


def convert(records: list[tuple[str, int, dict]], split: str, *, question_key: str | None = None,
            answer_key: str | None = None, data_source: str | None = None, instruction: str | None = None,
            system: str | None = None) -> list[dict]:
    """verl rows from (file, row index, raw record) triples.

    ``instruction`` replaces the default text appended to the question ("" for none); ``system`` adds a
    system message before the question (a question given as chat messages that has one keeps its own).
    """
    if not records:
        return []
    source = data_source or DEFAULT_DATA_SOURCE
    affix = instruction_for(source)
    if instruction is not None:
        affix = ("", (" " + instruction) if instruction else "")
    elif affix is None:
        affix = ("", "")
        log.warning("data_source %r has no built-in reward: rows are written without an instruction, and training "
                    "on them needs reward.custom.path", source)
    where0, _, first = records[0]
    q_key = find_key(first, question_key, QUESTION_KEYS, "question", "--question-key", where0)
    a_key = find_key(first, answer_key, ANSWER_KEYS, "answer", "--answer-key", where0)
    ability = "math" if source == DEFAULT_DATA_SOURCE or affix != ("", "") else "qa"
    rows: list[dict] = []
    for where, i, rec in records:
        if not isinstance(rec, dict):
            raise DataError(f"{where}: row {i}: is a {type(rec).__name__}, expected a record")
        for key in (q_key, a_key):
            if rec.get(key) is None:
                raise DataError(f"{where}: row {i}: field {key!r} is missing")
        messages = _messages(rec[q_key], where, i, q_key)
        truth = answer_ground_truth(rec[a_key])
        if truth is None:
            raise DataError(f"{where}: row {i}: field {a_key!r} ({_short(rec[a_key])}) has no answer to score against "
                            "(a string or a number)")
        users = [j for j, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise DataError(f"{where}: row {i}: field {q_key!r} has no user message")
        last = messages[users[-1]]
        last["content"] = affix[0] + last["content"] + affix[1]
        if system and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system})
        row = make_row(source, "", truth, split, len(rows), ability=ability,
                       question=_text(rec[q_key]), answer=str(rec[a_key]))
        row["prompt"] = messages
        rows.append(row)
    return rows


def _text(question: Any) -> str:
    return question if isinstance(question, str) else "\n".join(m["content"] for m in question)


def _short(value: Any, n: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."
