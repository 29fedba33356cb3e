"""Geometry3K reward (verl's ``geo3k``, data_source ``hiyouga/geometry3k``): 0.9 x accuracy + 0.1 x format.

* accuracy: 1 when the content of the last ``\\boxed{...}`` is right by
  :func:`portrl.rewards.symbolic.grade_answer` (the PRM800K rule: an integer answer must be an integer, a
  plain fraction the same fraction; expressions compared by math-verify or sympy), else 0 (also without a box);
* format: 1 when the whole response is ``<think>...</think>`` followed by text holding a ``\\boxed{...}``.

So a right boxed answer with the think block scores 1.0, without it 0.9; a wrong one 0.1 or 0.0.
``format_score`` changes the 0.1 weight.

Checked against verl's geo3k scorer (mathruler's ``extract_boxed_content`` and
``grade_answer``, the PRM800K rule) on the table of tests/test_rewards_geo3k.py, whose expected scores were
computed with mathruler 0.1.0 itself. Known differences, none reachable with Geometry3K's answers: a mixed number
(``7 3/4``, ``7\\frac{3}{4}``) is not read as ``31/4`` (portrl/rewards/symbolic.py), and a response without a box
is wrong even against the ground truth ``None`` (mathruler returns the string ``"None"`` for a missing box).
"""

from __future__ import annotations

from portrl.rewards.symbolic import grade_answer

FORMAT_WEIGHT = 0.1


def boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{`` up to its closing brace (stripped), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for j in range(start + len("\\boxed{"), len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            if depth == 0:
                return text[start + len("\\boxed{"):j].strip()
            depth -= 1
    return None


def format_ok(response: str) -> bool:
    """The response starts with ``<think>``, and after a ``</think>`` comes a ``\\boxed{`` with a ``}`` after it
    (verl's full-match pattern ``<think>.*</think>.*\\boxed\\{.*\\}.*``, checked in linear time)."""
    if not response.startswith("<think>"):
        return False
    end = response.find("</think>", len("<think>"))
    if end < 0:
        return False
    box = response.find("\\boxed{", end + len("</think>"))
    return box >= 0 and response.rfind("}") >= box + len("\\boxed{")


def compute_score(solution_str: str, ground_truth: str, format_score: float = FORMAT_WEIGHT) -> dict:
    """{"score", "acc", "pred", "format"}."""
    pred = boxed_content(solution_str)
    correct = grade_answer(pred, str(ground_truth))
    fmt = format_ok(solution_str)
    score = (1.0 - format_score) * float(correct) + format_score * float(fmt)
    return {"score": score, "acc": float(correct), "pred": pred, "format": float(fmt)}
