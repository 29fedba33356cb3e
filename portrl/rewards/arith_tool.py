"""Reward of the built-in tool-use task (portrl.data.arith_tool, data_source ``arith_tool``).

The decoded response holds the whole trajectory: the model's turns and, between them, the tool outputs inside
``<tool_response>...</tool_response>`` (the chat template's tool messages). The final answer is the last
``<answer>N</answer>`` after the last tool response, ``N`` an integer written as plain digits (an optional
leading '-', spaces around it allowed; no commas, no decimals). Score 1.0 when it equals the ground truth, else
0.0: also when there is no answer after the last tool response, when the response ends inside a tool response, or
when the last answer is malformed or wrong (an earlier right answer does not count). An answer that appears only
inside a tool response never counts. Linear time in the response (no regex over the whole text).
"""

from __future__ import annotations

import re

from portrl.rewards.text import ground_truth_text

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TOOL_OPEN, TOOL_CLOSE = "<tool_response>", "</tool_response>"
_INTEGER_RE = re.compile(r"\s*(-?\d+)\s*")


def final_part(solution_str: str) -> str:
    """The text after the last tool response ("" when the response ends inside one)."""
    opened, closed = solution_str.rfind(TOOL_OPEN), solution_str.rfind(TOOL_CLOSE)
    if opened > closed:
        return ""
    return solution_str[closed + len(TOOL_CLOSE):] if closed >= 0 else solution_str


def extract_answer(solution_str: str) -> str | None:
    """The integer of the last ``<answer>...</answer>`` after the last tool response; None when there is none or
    its content is not a plain integer."""
    text = final_part(solution_str)
    end = text.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    found = _INTEGER_RE.fullmatch(text, start + len(ANSWER_OPEN), end)
    return found.group(1) if found else None


def compute_score(solution_str: str, ground_truth: str) -> dict:
    """{"score", "acc", "pred"}: 1.0 for the exact result as the final answer, else 0.0."""
    pred = extract_answer(solution_str)
    truth = _INTEGER_RE.fullmatch(ground_truth_text(ground_truth))  # 440040051.0 reads as 440040051
    correct = pred is not None and truth is not None and int(pred) == int(truth.group(1))
    return {"score": float(correct), "acc": float(correct), "pred": pred}
