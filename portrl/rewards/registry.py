"""``compute_score``: the rule reward chosen by a row's ``data_source``.

The names verl's preprocessors write map to the same rewards, so parquet files made for verl
score unchanged:

=====================================================  ==========================================
data_source                                            reward
=====================================================  ==========================================
openai/gsm8k, gsm8k                                    portrl.rewards.gsm8k (strict "#### N")
DigitalLearningGmbH/MATH-lighteval, lighteval/MATH,    portrl.rewards.math_reward (last \\boxed{})
HuggingFaceH4/MATH-500, math, numina_* (NuminaMath)
math_dapo, dapo_math, aime*, BytedTsinghua-SIA/*       portrl.rewards.dapo_math (+1/-1, "Answer:")
arith                                                  portrl.rewards.arith (last integer)
=====================================================  ==========================================

Keyword arguments after ``extra_info`` go to the chosen reward (e.g. ``method="flexible"``,
``format_score=0.1`` for gsm8k).
"""

from __future__ import annotations

from typing import Any, Callable

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_SOURCES = (
    "DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math", "MATH",
    "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
    "numina_olympiads",
)
DAPO_SOURCES = ("math_dapo", "dapo_math", "BytedTsinghua-SIA/DAPO-Math-17k", "BytedTsinghua-SIA/AIME-2024")
DAPO_PREFIXES = ("aime",)
ARITH_SOURCES = ("arith",)


def reward_kind(data_source: str) -> str:
    """"gsm8k", "math", "dapo_math" or "arith" for a data_source; ValueError listing the known ones."""
    if data_source in GSM8K_SOURCES:
        return "gsm8k"
    if data_source in MATH_SOURCES:
        return "math"
    if data_source in DAPO_SOURCES or data_source.lower().startswith(DAPO_PREFIXES):
        return "dapo_math"
    if data_source in ARITH_SOURCES:
        return "arith"
    known = ", ".join(GSM8K_SOURCES + MATH_SOURCES + DAPO_SOURCES + ARITH_SOURCES)
    raise ValueError(
        f"no built-in reward for data_source {data_source!r}; known: {known}, aime*. "
        "For other data give a custom reward (reward.custom.path / reward.custom.name)."
    )


def _scorer(kind: str) -> Callable[..., Any]:
    if kind == "gsm8k":
        from portrl.rewards.gsm8k import compute_score
    elif kind == "math":
        from portrl.rewards.math_reward import compute_score
    elif kind == "dapo_math":
        from portrl.rewards.dapo_math import compute_score
    else:
        from portrl.rewards.arith import compute_score
    return compute_score


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs: Any) -> float | dict:
    """The rule reward of one response: a dict with "score", "acc" and "pred"."""
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}")
    return _scorer(reward_kind(data_source))(solution_str, str(ground_truth), **kwargs)
