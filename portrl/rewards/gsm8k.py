"""GSM8K reward: the answer after the last "#### " (strict) or the last number (flexible).

Strict follows the GSM8K format the prompt asks for ("output the final answer after ####"): only
the last 300 characters are searched (the answer is at the end; this bounds the cost), commas and
'$' are removed. Flexible takes the last number anywhere in those characters. Numbers compare by
value ("18.00" == "18"). Score: ``score`` when the answer matches, ``format_score`` when an answer
was found but is wrong, 0 when none was found.
"""

from __future__ import annotations

import re

from portrl.rewards.text import NUMBER_RE, canonical_number, last_number, tail

CLIP_CHARS = 300
_STRICT_RE = re.compile(r"#### ?\$?(" + NUMBER_RE.pattern + ")")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The model's final answer as a string (commas removed), or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    text = tail(solution_str, CLIP_CHARS)
    if method == "flexible":
        return last_number(text)
    found = _STRICT_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> dict:
    """{"score", "acc", "pred"} for one GSM8K response."""
    pred = extract_answer(solution_str, method)
    if pred is None:
        return {"score": 0.0, "acc": 0.0, "pred": None}
    want = canonical_number(str(ground_truth))
    got = canonical_number(pred)
    correct = got is not None and got == want
    return {"score": float(score if correct else format_score), "acc": float(correct), "pred": pred}
