"""DAPO-Math reward: +1 when the answer after the last "Answer:" is right, -1 otherwise.

DAPO-Math-17k prompts ask for a last line "Answer: $Answer". The last 300 characters are
searched (case-insensitive "Answer:"), the rest of that line is the prediction (a \\boxed{} in it
is unwrapped), and it is compared with the ground truth by portrl.rewards.math_reward.answers_equiv.
When no "Answer:" line exists, a last \\boxed{} is accepted instead.
"""

from __future__ import annotations

import re

from portrl.rewards.math_reward import answers_equiv
from portrl.rewards.text import last_boxed, tail

CLIP_CHARS = 300
_ANSWER_RE = re.compile(r"answer\s*:[ \t]*([^\n]*)", re.IGNORECASE)


def extract_answer(solution_str: str) -> str | None:
    """The text after the last "Answer:" (boxed content unwrapped), else the last \\boxed{}; or None."""
    text = tail(solution_str, CLIP_CHARS)
    found = _ANSWER_RE.findall(text)
    if found:
        pred = found[-1].strip()
        boxed = last_boxed(pred)
        pred = (boxed if boxed is not None else pred).strip().strip("$").strip()
        return pred or None
    return last_boxed(text)


def compute_score(solution_str: str, ground_truth: str, use_math_verify: bool | None = None) -> dict:
    """{"score": +1.0 or -1.0, "acc", "pred"}."""
    pred = extract_answer(solution_str)
    correct = answers_equiv(pred, str(ground_truth), use_math_verify)
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}
