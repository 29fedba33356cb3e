"""NuminaMath reward (verl's ``prime_math``, data_source ``numina_*``): the final answer found by answer
phrases or a box, graded by symbolic equivalence. Score 1.0 when right, else 0.0.

The answer is found the way verl's prime_math finds it, in this order, each step working on what the previous
one left: the text after the last "answer:", "answer is" or "answers are"; the text before the last "is the
answer" / "is answer" / "are the answers" / "are answers"; the content of the last ``\\boxed{}`` (or
``\\fbox{}``); the text before the last ". "; the text after the last "be ", "is ", "are ", "=", ": " or
"get " (each phrase matched case-insensitively). With none of these the whole response is the answer.

It is right when :func:`portrl.rewards.symbolic.grade_answer` or :func:`portrl.rewards.symbolic.math_equal`
says so (math-verify when installed, else sympy, else string and number checks; see that module); when
``\\pi`` appears, also with pi taken as 3.14 (verl's rule for answers computed with that value); and, with
math-verify installed, when math-verify shows the answer as written equivalent (sets and other forms verl's
rules do not read; verl scores those 0.0).
"""

from __future__ import annotations

from portrl.rewards.symbolic import grade_answer, math_equal, math_verify_equal
from portrl.rewards.text import last_boxed

MAX_CHARS = 10_000  # the answer is near the end; this bounds the cost on a runaway response
_AFTER = ("answer:", "answer is", "answers are")
_BEFORE = ("is answer", "is the answer", "are answers", "are the answers")
_LAST = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")


def extract_answer(response: str) -> str:
    """The final answer of a response (module docstring for the steps)."""
    text = response[-MAX_CHARS:]
    for marker in _AFTER:
        at = text.lower().rfind(marker)
        if at >= 0:
            text = text[at + len(marker):].strip()
    for marker in _BEFORE:
        at = text.lower().rfind(marker)
        if at >= 0:
            text = text[:at].strip()
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        text = boxed.strip()
    at = text.rfind(". ")
    if at >= 0:
        text = text[:at].strip()
    for marker in _LAST:
        at = text.lower().rfind(marker)
        if at >= 0:
            text = text[at + len(marker):].strip()
    return text


def answers_match(pred: str, ground_truth: str) -> bool:
    """verl prime_math's verdict on an extracted answer: the PRM800K rule, then the numeric/symbolic rule."""
    if grade_answer(pred, ground_truth) or math_equal(pred, ground_truth):
        return True
    if ("\\pi" in pred or "\\pi" in ground_truth) and \
            math_equal(pred.replace("\\pi", "(3.14)"), ground_truth.replace("\\pi", "(3.14)")):
        return True  # answers worked out with pi = 3.14
    return math_verify_equal(pred, ground_truth)  # sets, intervals, ... that the rules above do not read


def compute_score(solution_str: str, ground_truth: str) -> dict:
    """{"score": 1.0 or 0.0, "acc", "pred"}."""
    pred = extract_answer(solution_str)
    correct = answers_match(pred, str(ground_truth))
    return {"score": float(correct), "acc": float(correct), "pred": pred}
