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
codecontests, apps, codeforces, taco, leetcode         portrl.rewards.code (program run in the sandbox)
=====================================================  ==========================================

Keyword arguments after ``extra_info`` go to the chosen reward (e.g. ``method="flexible"``,
``format_score=0.1`` for gsm8k). The keyword ``code`` (a dict of reward.code settings: continuous, timeout_s,
memory_mb, max_workers, sandbox_fusion_url) goes to the code reward only.
"""

from __future__ import annotations

from typing import Any, Callable

from portrl.errors import UserError
from portrl.rewards import arith, code, dapo_math, gsm8k, math_reward
from portrl.rewards.text import ground_truth_text

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_SOURCES = (
    "DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math", "MATH",
    "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
    "numina_olympiads",
)
DAPO_SOURCES = ("math_dapo", "dapo_math", "BytedTsinghua-SIA/DAPO-Math-17k", "BytedTsinghua-SIA/AIME-2024")
DAPO_PREFIXES = ("aime",)
ARITH_SOURCES = ("arith",)
CODE_SOURCES = code.CODE_SOURCES


class UnknownDataSource(UserError, ValueError):
    """A row's data_source has no built-in reward (and no custom reward is configured)."""


def reward_kind(data_source: str) -> str:
    """"gsm8k", "math", "dapo_math", "arith" or "code" for a data_source; UnknownDataSource listing the known ones."""
    if data_source in GSM8K_SOURCES:
        return "gsm8k"
    if data_source in MATH_SOURCES:
        return "math"
    if data_source in DAPO_SOURCES or data_source.lower().startswith(DAPO_PREFIXES):
        return "dapo_math"
    if data_source in ARITH_SOURCES:
        return "arith"
    if data_source in CODE_SOURCES:
        return "code"
    known = ", ".join(GSM8K_SOURCES + MATH_SOURCES + DAPO_SOURCES + ARITH_SOURCES + CODE_SOURCES)
    raise UnknownDataSource(
        f"no built-in reward for data_source {data_source!r}; known: {known}, aime*. "
        "For other data give a custom reward (reward.custom.path / reward.custom.name)."
    )


_SCORERS: dict[str, Callable[..., Any]] = {
    "gsm8k": gsm8k.compute_score, "math": math_reward.compute_score, "dapo_math": dapo_math.compute_score,
    "arith": arith.compute_score,
}  # "code" takes its settings separately (compute_score below)


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs: Any) -> float | dict:
    """The rule reward of one response: a dict with "score", "acc" and "pred"."""
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}")
    code_settings = kwargs.pop("code", None) or {}
    kind = reward_kind(data_source)
    truth = ground_truth_text(ground_truth)  # 57.0 scores as "57"
    if kind == "code":
        return code.compute_score(solution_str, truth, extra_info, **dict(code_settings))
    return _SCORERS[kind](solution_str, truth, **kwargs)
