"""Reward routing by data_source against verl's dispatcher (verl/utils/reward_score/__init__.py,
default_compute_score) and scorers: for every name verl routes, a right and a wrong response score what verl's
scorer gives them. Each expected score is worked out by hand from verl's scorer code, in the comment beside it.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from portrl.data.qa import instruction_for
from portrl.data.schema import DataError, check_row
from portrl.rewards import RewardManager, symbolic
from portrl.rewards.dapo_math import minerva_normalize
from portrl.rewards.geo3k import format_ok
from portrl.rewards.math_reward import math_verify_available
from portrl.rewards.prime_math import extract_answer as prime_extract
from portrl.rewards.registry import (
    CODE_SOURCES,
    SEARCH_QA_SOURCES,
    UnknownDataSource,
    compute_score,
    reward_kind,
)
from portrl.rewards.search_qa import gold_answers
from portrl.rewards.symbolic import grade_answer, math_equal, sympy_available

NUMINA = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
          "numina_olympiads")
SEARCH = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa", "searchR1_2wikimultihopqa",
          "searchR1_musique", "searchR1_bamboogle")
CODE_FAST = {"timeout_s": 2.0, "memory_mb": 256}
ADD_TESTS = json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})
ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
needs_sympy = pytest.mark.skipif(not sympy_available(), reason="sympy not installed")

# (data_source, response, ground truth, verl's score). verl's scorer and why, per group:
CASES = [
    # gsm8k: the last "#### (-?[0-9.,]+)" match equals the ground truth -> score 1.0, else format_score 0.0
    ("openai/gsm8k", "3 + 4 = 7\n#### 7", "7", 1.0),
    ("openai/gsm8k", "3 + 4 = 8\n#### 8", "7", 0.0),
    # math_reward: last \boxed{} through Hendrycks' strip_string ("\dfrac" -> "\frac") equals -> 1.0, else 0.0
    *[(src, "So it is \\boxed{\\dfrac{1}{2}}.", "\\frac{1}{2}", 1.0)
      for src in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")],
    *[(src, "So it is \\boxed{\\frac{1}{3}}.", "\\frac{1}{2}", 0.0)
      for src in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")],
    # math_dapo: last "(?i)Answer\s*:\s*([^\n]+)" in the last 300 chars, Minerva-normalised, equal -> +1.0 else -1.0
    *[(src, "Work...\nAnswer: 42", "42", 1.0) for src in ("math_dapo", "math_dapo_reasoning", "aime2024", "aime")],
    *[(src, "Work...\nAnswer: 41", "42", -1.0) for src in ("math_dapo", "math_dapo_reasoning", "aime2024", "aime")],
    # prime_math: "answer is" -> "\boxed{...}." -> box content "\frac{1}{2}"; grade_answer: mathd strings equal
    # -> (True, ...) -> float(res[0]) = 1.0. "\frac{1}{3}": strings differ, sympy 1/2 - 1/3 != 0,
    # math_equal neither numeric nor symbolically equal -> 0.0
    *[(src, "The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", 1.0) for src in NUMINA],
    *[(src, "The answer is \\boxed{\\frac{1}{3}}.", "\\frac{1}{2}", 0.0) for src in NUMINA],
    # code (no sandbox_fusion_url): prime_code, continuous -> share of the first 10 cases passed: 1/1 and 0/1
    *[(src, ADD, ADD_TESTS, 1.0) for src in ("codecontests", "apps", "codeforces", "taco")],
    *[(src, "```python\nprint(4)\n```", ADD_TESTS, 0.0) for src in ("codecontests", "apps", "codeforces", "taco")],
    # geo3k: 0.9 * grade_answer(last box, gt) + 0.1 * fullmatch("<think>.*</think>.*\\boxed\{.*\}.*")
    ("hiyouga/geometry3k", "<think>h = 2\\sqrt{3}</think> The height is \\boxed{2\\sqrt{3}}.", "2\\sqrt{3}", 1.0),
    ("hiyouga/geometry3k", "<think>guess</think> The height is \\boxed{4}.", "2\\sqrt{3}", 0.1),
    # search_r1_like_qa_em: last <answer>..</answer>, SQuAD-normalised, equal to a target -> 1.0, else 0.0
    *[(src, "<think>..</think><answer>The Beatles</answer>", {"target": ["beatles", "fab four"]}, 1.0)
      for src in SEARCH],
    *[(src, "<answer>Rolling Stones</answer>", {"target": ["beatles", "fab four"]}, 0.0) for src in SEARCH],
]


@pytest.mark.parametrize("source,response,truth,want", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_every_verl_data_source_scores_as_verl(source, response, truth, want):
    result = compute_score(source, response, truth, {"index": 0}, code=CODE_FAST)
    assert result["score"] == pytest.approx(want)


# portrl's own names score like the verl name they stand for
@pytest.mark.parametrize("source,response,truth,want", [
    ("gsm8k", "#### 7", "7", 1.0), ("gsm8k", "#### 8", "7", 0.0),
    ("MATH", "\\boxed{3}", "3", 1.0), ("MATH", "\\boxed{4}", "3", 0.0),
    ("dapo_math", "Answer: 3", "3", 1.0), ("BytedTsinghua-SIA/DAPO-Math-17k", "Answer: 4", "3", -1.0),
    ("BytedTsinghua-SIA/AIME-2024", "Answer: 3", "3", 1.0), ("AIME_2025", "Answer: 4", "3", -1.0),
    ("leetcode", "```python\ndef f(x):\n    return x + 1\n```", json.dumps({"asserts": ["assert f(1) == 2"]}), 1.0),
    ("leetcode", "```python\ndef f(x):\n    return x\n```", json.dumps({"asserts": ["assert f(1) == 2"]}), 0.0),
    ("arith", "19", "19", 1.0), ("arith", "18", "19", 0.0),
])
def test_portrl_names(source, response, truth, want):
    assert compute_score(source, response, truth, {"index": 0}, code=CODE_FAST)["score"] == want


def test_math_is_scored_as_verl_scores_it_and_qa_boxed_by_the_math_reward():
    # verl routes "math" to math_dapo (+1 / -1 on an "Answer:" line); `portrl preprocess qa` writes "qa_boxed",
    # portrl's own name for boxed answers (the MATH reward, 1 / 0)
    assert reward_kind("math") == "dapo_math"
    assert compute_score("math", "Answer: 42", "42")["score"] == 1.0
    assert compute_score("math", "Answer: 41", "42")["score"] == -1.0
    assert reward_kind("qa_boxed") == "math"
    assert compute_score("qa_boxed", "\\boxed{42}", "42")["score"] == 1.0
    assert compute_score("qa_boxed", "\\boxed{41}", "42")["score"] == 0.0


def test_unknown_data_source_keeps_the_one_line_error():
    with pytest.raises(UnknownDataSource) as info:
        compute_score("my_dataset", "x", "y")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("no built-in reward for data_source 'my_dataset'; known: openai/gsm8k, ")
    assert "numina_olympiads" in message and "hiyouga/geometry3k" in message and "searchR1_nq" in message
    assert message.endswith("For other data give a custom reward (reward.custom.path / reward.custom.name).")
    for near_miss in ("searchr1_nq", "numina", "geometry3k", "Math_dapo"):  # verl matches names exactly
        with pytest.raises(UnknownDataSource):
            reward_kind(near_miss)


def test_every_routed_name_has_a_qa_instruction():
    # `portrl preprocess qa --data-source NAME` asks for what the name's reward reads
    from portrl.rewards.registry import _BY_NAME

    assert set(SEARCH) == set(SEARCH_QA_SOURCES)
    for name in _BY_NAME:
        if name not in CODE_SOURCES:
            assert isinstance(instruction_for(name), tuple), name
    assert "<answer>" in instruction_for("searchR1_nq")[1] and "boxed" in instruction_for("numina_cn_k12")[1]


# ---------------------------------------------------------------- math_dapo (Minerva) details

@pytest.mark.parametrize("response,truth,want", [
    ("Answer:\n42", "42", 1.0),  # verl's \s* after the colon crosses the line break
    ("Answer: The total is n = 5", "5", 1.0),  # Minerva keeps the text after the last "="
    ("Answer: $\\frac12$", "\\frac{1}{2}", 1.0),  # "$...$" unwrapped, \frac12 braced
    ("Answer: 1,000", "1000", 1.0),  # thousands commas of a whole number
    ("Answer: 12 \\text{ cm}", "12", 1.0),  # units
    ("answer: 7\nAnswer: 8", "8", 1.0),  # the last one
    ("x" * 400 + "\nAnswer: 8", "8", 1.0),  # the tail is read
    ("Answer: 8" + "\n" + "y" * 400, "8", -1.0),  # out of the last 300 characters
    ("The result is \\boxed{8}", "8", 1.0),  # portrl only: no "Answer:" line -> the last box (verl: -1.0)
])
def test_dapo_answer_line(response, truth, want):
    assert compute_score("math_dapo", response, truth)["score"] == want


def test_minerva_normalisation():
    assert minerva_normalize("x = \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert minerva_normalize("\\text{(B)}") == "(B)"
    assert minerva_normalize("5 degrees") == "5"
    assert minerva_normalize("\\sqrt2") == "\\sqrt{2}"


# ---------------------------------------------------------------- prime_math details

def test_prime_math_answer_extraction_follows_verl():
    assert prime_extract("blah. The answer is 42") == "42"
    assert prime_extract("So 42 is the answer.") == "So 42"  # "is the answer" cuts before; then "So 42"
    assert prime_extract("Thus we get x = 7") == "7"
    assert prime_extract("Final answer: \\boxed{(1, 2)}") == "(1, 2)"
    assert prime_extract("no markers 5") == "no markers 5"


@needs_sympy
@pytest.mark.parametrize("response,truth,want", [
    ("The answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),  # sympy: 1/2 - 0.5 == 0
    ("The answer is \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # sympy simplify
    ("The answer is \\boxed{1.41421}", "\\sqrt{2}", 1.0),  # math_equal: N() within rel. 1e-4
    ("The answer is \\boxed{1.4}", "\\sqrt{2}", 0.0),
    ("The answer is \\boxed{50}", "0.5", 1.0),  # math_equal's percentage rule: 0.5 * 100
    ("The answer is \\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("The answer is \\boxed{x^2+2x+2}", "(x+1)^2", 0.0),
    ("The answer is \\boxed{(1, 2)}", "(1,2)", 1.0),  # tuples element-wise
    ("The answer is \\boxed{(2, 1)}", "(1,2)", 0.0),
    ("The answer is \\boxed{2\\pi}", "6.2832", 1.0),  # \pi as its value
    ("The answer is \\boxed{6.28}", "2\\pi", 1.0),  # \pi taken as 3.14 (verl's second try)
    ("The answer is \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),  # grade_answer says no, math_equal's value yes
])
def test_prime_math_symbolic(response, truth, want):
    assert compute_score("numina_olympiads", response, truth)["score"] == want


def test_grading_rules_without_sympy(monkeypatch):
    monkeypatch.setattr(symbolic, "_HAVE_SYMPY", False)
    monkeypatch.setattr("portrl.rewards.symbolic.math_verify_available", lambda: False)
    assert compute_score("numina_olympiads", "\\boxed{\\frac12}", "\\frac{1}{2}")["score"] == 1.0  # strings
    assert compute_score("numina_olympiads", "\\boxed{0.50}", "0.5")["score"] == 1.0  # numbers
    assert compute_score("numina_olympiads", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}")["score"] == 0.0  # needs sympy
    assert compute_score("hiyouga/geometry3k", "<think></think>\\boxed{12}", "12")["score"] == 1.0


# ---------------------------------------------------------------- geo3k details

@needs_sympy
@pytest.mark.parametrize("response,truth,want", [
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 0.9),  # right, no think block: 0.9 * 1 + 0.1 * 0
    ("<think>\n..\n</think>\n\\boxed{\\frac{5}{2}}", "2.5", 1.0),  # sympy: 5/2 - 2.5 == 0
    ("<think></think>\\boxed{\\frac{6}{2}}", "3", 0.1),  # an integer truth needs an integer answer
    ("<think></think>\\boxed{2/4}", "1/2", 0.1),  # an unreduced fraction is wrong
    ("<think></think>\\boxed{3.0}", "3", 1.0),  # a whole float is the integer
    ("<think></think> no box", "3", 0.0),
    ("I think </think><think>\\boxed{3}", "3", 0.9),  # the format needs <think> first and a box after </think>
])
def test_geo3k(response, truth, want):
    assert compute_score("hiyouga/geometry3k", response, truth)["score"] == pytest.approx(want)


def test_geo3k_format_is_linear_time():
    big = "<think>" + "</think>" * 100_000 + "x" * 1_000_000
    start = time.monotonic()
    assert not format_ok(big)
    assert time.monotonic() - start < 1.0


# ---------------------------------------------------------------- search QA details

def test_search_qa_rules():
    gold = {"target": ["Paris"]}
    assert compute_score("searchR1_nq", "<answer>paris.</answer>", gold)["score"] == 1.0  # punctuation, case
    assert compute_score("searchR1_nq", "<answer>x</answer> then <answer> Paris </answer>", gold)["score"] == 1.0
    assert compute_score("searchR1_nq", "Paris", gold)["score"] == 0.0  # no answer tag
    sprayed = "<answer>a</answer>" * 11 + "<answer>Paris</answer>"
    assert compute_score("searchR1_nq", sprayed, gold)["score"] == 0.25  # more than 10 tags: score / 4
    assert compute_score("searchR1_nq", "<answer>Paris</answer>", "Paris")["score"] == 1.0


def test_search_qa_ground_truth_forms():
    assert gold_answers({"target": np.array(["a", "b"])}) == ["a", "b"]  # as pandas reads a parquet list
    assert gold_answers('{"target": ["a"]}') == ["a"]
    assert gold_answers(["a", "b"]) == ["a", "b"]
    assert gold_answers("[not json") == ["[not json"]
    assert gold_answers("[1, 2]") == ["[1, 2]"] and gold_answers('{"a": 1}') == ['{"a": 1}']  # one answer
    with pytest.raises(ValueError, match="'target'"):
        gold_answers({"answers": ["a"]})


def test_verl_search_row_reads_and_scores_through_the_manager():
    row = {"data_source": "searchR1_nq", "prompt": [{"role": "user", "content": "Capital of France?"}],
           "reward_model": {"style": "rule", "ground_truth": {"target": ["Paris", "paris france"]}}}
    _, source, truth, _ = check_row(row, "train.parquet", 0)
    assert json.loads(truth) == {"target": ["Paris", "paris france"]}
    result = RewardManager().score(["<answer>Paris</answer>", "<answer>Lyon</answer>"], [source, source],
                                   [truth, truth])
    assert result.scores.tolist() == [1.0, 0.0]
    row["reward_model"]["ground_truth"] = {"target": []}
    with pytest.raises(DataError, match="row 0: field 'reward_model.ground_truth' search QA ground truth"):
        check_row(row, "train.parquet", 0)
    row["data_source"] = "openai/gsm8k"  # a struct stays an error for the other rewards
    with pytest.raises(DataError, match="must be a string or a number, got dict"):
        check_row(row, "train.parquet", 0)


# ---------------------------------------------------------------- safety and the math-verify path

@pytest.mark.parametrize("hostile", [
    "__import__('os').system('echo hi')", "x.n(10**8)", "99^{99^{99}}", "2^{(50+50)}", "9^{999}",
    "(" * 300 + "2" + ")" * 300, "a+b+c+d", "\\input{/etc/passwd}",
])
def test_hostile_answers_are_not_evaluated_and_stay_fast(hostile):
    start = time.monotonic()
    assert compute_score("numina_olympiads", f"\\boxed{{{hostile}}}", "1")["score"] == 0.0
    assert compute_score("hiyouga/geometry3k", f"\\boxed{{{hostile}}}", "1")["score"] == 0.0
    assert time.monotonic() - start < 5.0


def test_grade_and_math_equal_none_and_empty():
    assert not grade_answer(None, "1") and not math_equal(None, "1")
    assert not grade_answer("", "1") and not math_equal("", "1")


@pytest.mark.skipif(not math_verify_available(), reason="math-verify not installed (extra 'math')")
def test_math_verify_adds_only_right_answers():
    assert compute_score("numina_olympiads", "\\boxed{\\{1,2\\}}", "\\{2,1\\}")["score"] == 1.0  # sets
    assert compute_score("numina_olympiads", "\\boxed{x+1}", "x+2")["score"] == 0.0
    assert compute_score("hiyouga/geometry3k", "<think></think>\\boxed{\\frac{6}{2}}", "3")["score"] == 0.1
