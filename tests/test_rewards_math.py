"""MATH / DAPO rewards: equivalent answer forms, wrong answers, adversarial strings."""

import time

import pytest

from portrl.rewards import compute_score
from portrl.rewards.dapo_math import extract_answer as dapo_extract
from portrl.rewards.math_normalize import is_equiv, normalize
from portrl.rewards.math_reward import compute_score as math_score
from portrl.rewards.math_reward import math_verify_available
from portrl.rewards.text import last_boxed

EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"), ("\\dfrac{1}{2}", "\\frac{1}{2}"), ("\\frac12", "\\frac{1}{2}"), ("1/2", "\\tfrac12"),
    ("\\frac{1}2", "\\frac12"), (".5", "\\frac{1}{2}"), ("-\\frac{3}{4}", "-0.75"), ("5\\text{ cm}", "5"),
    ("10 \\text{ dollars}", "10"), ("12 cm^2", "12"), ("90^\\circ", "90"), ("90^{\\circ}", "90"), ("50\\%", "50"),
    ("2.50", "2.5"), ("3.0", "3"), ("x = 4", "4"), ("\\left(1,2\\right)", "(1,2)"), ("1,000", "1000"),
    ("\\text{(A)}", "(A)"), ("\\sqrt3", "\\sqrt{3}"), ("2 \\sqrt{3}", "2\\sqrt{3}"), ("\\$5.00", "5"),
    ("\\textbf{5}", "5"), ("\\mbox{ 7 }", "7"), ("\\boxed{3}", "3"), ("\\left[ 2, 5 \\right)", "[2,5)"),
]
DIFFERENT = [("1", "2"), ("\\frac{1}{2}", "\\frac{1}{3}"), ("(1,2)", "(2,1)"), ("x+1", "x+2"),
             ("2\\sqrt3", "2\\sqrt2"), ("12", "1"), ("0.5", "5"), ("", "0"), ("10", "100")]


@pytest.mark.parametrize("pred,truth", EQUIVALENT)
def test_fallback_normaliser_equivalent(pred, truth):
    assert is_equiv(pred, truth), (normalize(pred), normalize(truth))
    assert math_score(f"so \\boxed{{{pred}}}.", truth, use_math_verify=False)["score"] == 1.0


@pytest.mark.parametrize("pred,truth", DIFFERENT)
def test_fallback_normaliser_different(pred, truth):
    assert not is_equiv(pred, truth)
    assert math_score(f"\\boxed{{{pred}}}", truth, use_math_verify=False)["score"] == 0.0


@pytest.mark.skipif(not math_verify_available(), reason="math-verify not installed (extra 'math')")
@pytest.mark.parametrize("pred,truth,want", [
    ("\\frac{\\sqrt{8}}{2}", "\\sqrt{2}", 1.0), ("x^2+2x+1", "(x+1)^2", 1.0), ("\\{1,2\\}", "\\{2,1\\}", 1.0),
    ("\\pi/2", "\\frac{\\pi}{2}", 1.0), ("2\\sqrt2", "2\\sqrt3", 0.0), ("x+1", "x+2", 0.0),
])
def test_math_verify_symbolic(pred, truth, want):
    assert math_score(f"\\boxed{{{pred}}}", truth, use_math_verify=True)["score"] == want


def test_verl_math_sources_dispatch():
    for source in ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500"):
        assert compute_score(source, "The answer is \\boxed{\\dfrac{1}{2}}.", "\\frac{1}{2}")["acc"] == 1.0


def test_last_boxed_extraction():
    assert last_boxed("\\boxed{1} then \\boxed{2}") == "2"
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\boxed{2}}") == "2"  # the last box to open is the inner one
    assert last_boxed("\\boxed 5$ done") == "5"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed{1} and \\boxed{2") is None  # the last box is unbalanced
    assert last_boxed("no box here") is None
    assert last_boxed("\\boxed") is None
    assert last_boxed("\\boxed{}") == ""


def test_adversarial_strings_score_correctly():
    truth = "2"
    assert math_score("no answer at all", truth)["score"] == 0.0
    assert math_score("\\boxed{1} wait, \\boxed{2}", truth)["score"] == 1.0
    assert math_score("\\boxed{2} wait, \\boxed{1}", truth)["score"] == 0.0
    assert math_score("\\boxed{2", truth)["score"] == 0.0
    assert math_score("}}}}\\boxed{{2}}{{{", truth)["score"] == 1.0
    assert math_score("\\boxed{\\frac{4}{2}}", truth, use_math_verify=False)["score"] == 1.0  # compared by value
    assert math_score("$\\boxed{2}$", truth)["pred"] == "2"


def test_megabyte_inputs_are_fast_and_safe():
    cases = [
        "{" * 1_000_000 + "\\boxed{2}",
        "\\boxed{" + "{" * 1_000_000,
        "\\boxed{" + "1" * 1_000_000 + "}",
        "x = " * 250_000 + "\\boxed{2}",
        "\\text{ " * 100_000 + "\\boxed{2 cm}",
        ("Answer: " + "9" * 100) * 10_000 + "\nAnswer: 2",
        "1," * 500_000,
    ]
    start = time.perf_counter()
    for text in cases:
        for source in ("lighteval/MATH", "math_dapo", "openai/gsm8k", "arith"):
            out = compute_score(source, text, "2")
            assert set(out) >= {"score", "acc"}
    assert compute_score("lighteval/MATH", cases[0], "2")["score"] == 1.0
    assert compute_score("lighteval/MATH", cases[2], "2")["score"] == 0.0
    assert compute_score("math_dapo", cases[5], "2")["score"] == 1.0
    # a generous bound that only catastrophic backtracking (minutes) could exceed
    assert time.perf_counter() - start < 20


def test_normalise_is_linear_on_long_answers():
    start = time.perf_counter()
    for s in ("1" * 999 + "x", "\\frac" * 190, "a" * 998 + " cm", "{" * 999):
        normalize(s)
        is_equiv(s, s + "1")
    assert time.perf_counter() - start < 5


def test_dapo_math():
    good = "Work...\nAnswer: 34"
    assert compute_score("math_dapo", good, "34") == {"score": 1.0, "acc": 1.0, "pred": "34"}
    assert compute_score("math_dapo", "Answer: 35", "34")["score"] == -1.0
    assert compute_score("math_dapo", "no answer", "34")["score"] == -1.0
    assert compute_score("math_dapo", "answer: $\\frac{1}{2}$", "1/2")["score"] == 1.0
    assert compute_score("math_dapo", "Answer: \\boxed{34}", "34")["score"] == 1.0
    assert compute_score("aime24", "Answer: 1\nAnswer: 34", "34")["score"] == 1.0
    assert compute_score("math_dapo", "so \\boxed{34}", "34")["score"] == 1.0  # no Answer: line, a box
    assert dapo_extract("Answer:   \n") is None
