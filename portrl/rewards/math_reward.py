"""MATH reward: the last \\boxed{} of the response, checked for equivalence with the ground truth.

The checker is math-verify (``pip install 'portrl[math]'``) when it is installed, or-ed with the
hand-written normaliser of portrl.rewards.math_normalize (which alone is the checker otherwise).
Score 1.0 for an equivalent answer, 0.0 otherwise (also when there is no box).
"""

from __future__ import annotations

import importlib.util
import threading

from portrl.rewards.math_normalize import MAX_CHARS, is_equiv
from portrl.rewards.text import last_boxed

_HAVE_MATH_VERIFY: bool | None = None


def math_verify_available() -> bool:
    global _HAVE_MATH_VERIFY
    if _HAVE_MATH_VERIFY is None:
        _HAVE_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None
    return _HAVE_MATH_VERIFY


def math_verify_equiv(prediction: str, ground_truth: str) -> bool:
    """math-verify's verdict on two boxed answers; False when it cannot parse them.

    Its timeouts use SIGALRM, which only the main thread may set, so elsewhere they are off.
    """
    from math_verify import parse, verify  # noqa: PLC0415  (optional dependency: math-verify)

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse("\\boxed{" + ground_truth + "}", parsing_timeout=timeout)
        pred = parse("\\boxed{" + prediction + "}", parsing_timeout=timeout)
        return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - any parser failure means "not shown equivalent"
        return False


def answers_equiv(prediction: str | None, ground_truth: str, use_math_verify: bool | None = None) -> bool:
    """The equivalence used by the math rewards (math-verify when available, or the normaliser)."""
    if prediction is None:
        return False
    if is_equiv(prediction, ground_truth):
        return True
    if use_math_verify is None:
        use_math_verify = math_verify_available()
    if use_math_verify and len(prediction) <= MAX_CHARS and len(str(ground_truth)) <= MAX_CHARS:
        return math_verify_equiv(prediction, str(ground_truth))
    return False


def compute_score(solution_str: str, ground_truth: str, use_math_verify: bool | None = None) -> dict:
    """{"score", "acc", "pred"}: 1.0 when the last boxed answer is equivalent to ``ground_truth``."""
    pred = last_boxed(solution_str)
    correct = answers_equiv(pred, str(ground_truth), use_math_verify)
    return {"score": float(correct), "acc": float(correct), "pred": pred}
