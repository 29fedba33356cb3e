"""``compute_score``: the rule reward chosen by a row's ``data_source``.

Every name verl's ``default_compute_score`` routes maps to a reward that gives verl's score on the inputs
verl's reward was written for, so parquet files made for verl score the same (checked against verl's
dispatcher and scorers, verl-project/verl ``verl/utils/reward_score``):

==========================================  ======================  ==========================================
data_source (verl's names, then portrl's)   verl's scorer           portrl's reward
==========================================  ======================  ==========================================
openai/gsm8k; gsm8k, wordprob               gsm8k                   portrl.rewards.gsm8k (strict "#### N")
lighteval/MATH, DigitalLearningGmbH/        math_reward             portrl.rewards.math_reward (last \\boxed{})
MATH-lighteval, HuggingFaceH4/MATH-500;
math, MATH
math_dapo, math_dapo_reasoning, aime*;      math_dapo               portrl.rewards.dapo_math (+1/-1, "Answer:")
dapo_math, BytedTsinghua-SIA/DAPO-Math-17k,
BytedTsinghua-SIA/AIME-2024
numina_aops_forum, numina_synthetic_math,   prime_math              portrl.rewards.prime_math (answer phrases or
numina_amc_aime, numina_synthetic_amc,                              box; symbolic: math-verify, else sympy)
numina_cn_k12, numina_olympiads
codecontests, apps, codeforces, taco;       prime_code /            portrl.rewards.code (the sandbox, or
leetcode                                    sandbox_fusion          reward.code.sandbox_fusion_url)
hiyouga/geometry3k                          geo3k                   portrl.rewards.geo3k (0.9 acc + 0.1 format)
searchR1_nq, searchR1_triviaqa,             search_r1_like_qa_em    portrl.rewards.search_qa (<answer> exact
searchR1_popqa, searchR1_hotpotqa,                                  match; ground truth {"target": [...]})
searchR1_2wikimultihopqa, searchR1_musique,
searchR1_bamboogle
arith                                       (none)                  portrl.rewards.arith (last integer)
arith_tool                                  (none)                  portrl.rewards.arith_tool (last <answer>
                                                                    after the last tool response)
==========================================  ======================  ==========================================

Deliberate differences (each reward's docstring has the details):

* Every name after the ";" of a table row, and ``aime`` in other cases ("AIME_2025"), is portrl's addition: verl
  raises NotImplementedError for it. ``qa_boxed`` (portrl's own name, the default of ``portrl preprocess qa``)
  and ``MATH`` are scored by the MATH reward; ``math`` goes to math_dapo, as in verl (+1 / -1 on an "Answer:"
  line: ``compute_score("math", "Answer: 17", "18")`` is -1).
* gsm8k compares numbers by value ("18.00" scores "18"; verl compares strings) and accepts "####5" and
  "#### $5" (verl: 0.0); like verl it reads the last 300 characters.
* MATH is right when verl's string check is, and also for equal rationals ("0.25" and "\\frac{1}{4}") and,
  with math-verify installed, for answers math-verify shows equivalent (verl 0.0 there).
* math_dapo is right when verl's Minerva check is, and also by portrl's MATH equivalence; with no "Answer:"
  line a last \\boxed{} is read (verl: -1). The ``aime`` prefix matches in any case ("AIME_2025").
* prime_math and geo3k use portrl's own LaTeX-to-sympy translation (verl: pylatexenc and mathruler), so rare
  forms (mixed numbers "7 3/4", "million", functions other than sqrt/log/trig) can grade differently;
  math-verify, when installed, can only add right answers. Expressions with more than two unknown letters
  are compared as strings (as verl).
* code: as verl's prime_code (the last python block, inside ``<think>`` too); with a SandboxFusion URL portrl
  keeps those rules where verl's sandbox_fusion scorer has its own (portrl.rewards.code lists them).
* searchR1_* rows score as in verl; their multi-turn retrieval rollouts run with portrl's local search tool (BM25,
  not verl's retrieval server; docs/agent_recipes.md); the ground truth struct is passed on as JSON text.

Keyword arguments after ``extra_info`` go to the chosen reward (e.g. ``method="flexible"``,
``format_score=0.1`` for gsm8k). The keyword ``code`` (a dict of reward.code settings: continuous, timeout_s,
memory_mb, max_workers, sandbox_fusion_url; and the sandbox's allow_unisolated and packages, config ``sandbox.*``)
goes to the code reward only.
"""

from __future__ import annotations

from typing import Any, Callable

from portrl.errors import UserError
from portrl.rewards import arith, arith_tool, code, dapo_math, geo3k, gsm8k, math_reward, prime_math, search_qa
from portrl.rewards.text import ground_truth_text

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k", "wordprob")
MATH_SOURCES = ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500", "MATH", "qa_boxed")
DAPO_SOURCES = ("math", "math_dapo", "math_dapo_reasoning", "dapo_math", "BytedTsinghua-SIA/DAPO-Math-17k",
                "BytedTsinghua-SIA/AIME-2024")
DAPO_PREFIXES = ("aime",)
PRIME_MATH_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                      "numina_cn_k12", "numina_olympiads")
GEO3K_SOURCES = ("hiyouga/geometry3k",)
SEARCH_QA_SOURCES = search_qa.SEARCH_QA_SOURCES
ARITH_SOURCES = ("arith",)
ARITH_TOOL_SOURCES = ("arith_tool",)
CODE_SOURCES = code.CODE_SOURCES
_BY_NAME = {
    **dict.fromkeys(GSM8K_SOURCES, "gsm8k"), **dict.fromkeys(MATH_SOURCES, "math"),
    **dict.fromkeys(DAPO_SOURCES, "dapo_math"), **dict.fromkeys(PRIME_MATH_SOURCES, "prime_math"),
    **dict.fromkeys(GEO3K_SOURCES, "geo3k"), **dict.fromkeys(SEARCH_QA_SOURCES, "search_qa"),
    **dict.fromkeys(ARITH_SOURCES, "arith"), **dict.fromkeys(CODE_SOURCES, "code"),
    **dict.fromkeys(ARITH_TOOL_SOURCES, "arith_tool"),
}


class UnknownDataSource(UserError, ValueError):
    """A row's data_source has no built-in reward (and no custom reward is configured)."""


def reward_kind(data_source: str) -> str:
    """The reward kind of a data_source ("gsm8k", "math", "dapo_math", "prime_math", "geo3k", "search_qa",
    "arith", "arith_tool" or "code"); UnknownDataSource listing the known names."""
    kind = _BY_NAME.get(data_source)
    if kind is not None:
        return kind
    if data_source.lower().startswith(DAPO_PREFIXES):
        return "dapo_math"
    known = ", ".join(_BY_NAME)
    raise UnknownDataSource(
        f"no built-in reward for data_source {data_source!r}; known: {known}, aime*. "
        "For other data give a custom reward (reward.custom.path / reward.custom.name)."
    )


_SCORERS: dict[str, Callable[..., Any]] = {
    "gsm8k": gsm8k.compute_score, "math": math_reward.compute_score, "dapo_math": dapo_math.compute_score,
    "arith": arith.compute_score, "prime_math": prime_math.compute_score, "geo3k": geo3k.compute_score,
    "arith_tool": arith_tool.compute_score,
}  # "code" takes its settings separately and "search_qa" a structured ground truth (compute_score below)


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs: Any) -> float | dict:
    """The rule reward of one response: a dict with "score", "acc" and "pred"."""
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}")
    code_settings = kwargs.pop("code", None) or {}
    kind = reward_kind(data_source)
    if kind == "search_qa":  # {"target": [answers]}, kept as the struct it is
        return search_qa.compute_score(solution_str, ground_truth, **kwargs)
    truth = ground_truth_text(ground_truth)  # 57.0 scores as "57"
    if kind == "code":
        return code.compute_score(solution_str, truth, extra_info, **dict(code_settings))
    return _SCORERS[kind](solution_str, truth, **kwargs)
