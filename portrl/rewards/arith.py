"""Reward of the built-in arithmetic task (portrl.data.arith).

The answer is the last integer in the last 300 characters of the response ("19", "= 19",
"the answer is -4" all parse). Score 1.0 when it equals the ground truth, else 0.0.
"""

from __future__ import annotations

import re

from portrl.rewards.text import tail

CLIP_CHARS = 300
_INT_RE = re.compile(r"-?\d+")


def extract_answer(solution_str: str) -> str | None:
    """The last integer in the response tail, or None."""
    found = None
    for found in _INT_RE.finditer(tail(solution_str, CLIP_CHARS)):
        pass
    return found.group(0) if found else None


def compute_score(solution_str: str, ground_truth: str) -> dict:
    """{"score", "acc", "pred"}: 1.0 for the right integer, else 0.0."""
    pred = extract_answer(solution_str)
    truth = _as_integer(ground_truth)
    correct = pred is not None and truth is not None and int(pred) == truth
    return {"score": float(correct), "acc": float(correct), "pred": pred}


def _as_integer(ground_truth) -> int | None:
    """The integer a ground truth stands for ("19", 19, 19.0, "19.0"), or None when it is not a whole number."""
    text = str(ground_truth).strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None
