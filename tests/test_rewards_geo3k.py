"""portrl's geo3k reward (data_source ``hiyouga/geometry3k``) against verl's scorer.

verl's geo3k score is ``0.9 * acc + 0.1 * format``: ``acc`` is mathruler's ``grade_answer`` (the PRM800K rule) on
mathruler's ``extract_boxed_content`` of the response (the last ``\\boxed{...}``, the string "None" when there is
none); ``format`` is a full match of ``<think>.*</think>.*\\boxed\\{.*\\}.*`` (DOTALL). The expected scores below
were computed with mathruler 0.1.0 itself (not a portrl dependency) on each pair, the formula above applied.
"""

from __future__ import annotations

import pytest

from portrl.rewards import compute_score
from portrl.rewards.registry import UnknownDataSource, reward_kind
from portrl.rewards.symbolic import sympy_available

T = "<think>reasoning</think> "

# (response, ground truth, verl's score)
VERL_TABLE = [
    (T + '\\boxed{5}', '5', 1.0),
    ('\\boxed{5}', '5', 0.9),
    (T + '\\boxed{4}', '5', 0.1),
    (T + 'no box', '5', 0.0),
    ('no box', '5', 0.0),
    (T + '\\boxed{2\\sqrt{3}}', '2\\sqrt{3}', 1.0),
    (T + '\\boxed{\\sqrt{12}}', '2\\sqrt{3}', 1.0),
    (T + '\\boxed{2 \\sqrt { 3 }}', '2\\sqrt{3}', 1.0),
    (T + '\\boxed{\\frac{5}{2}}', '2.5', 1.0),
    (T + '\\boxed{\\frac{6}{2}}', '3', 0.1),
    (T + '\\boxed{2/4}', '1/2', 0.1),
    (T + '\\boxed{1/2}', '1/2', 1.0),
    (T + '\\boxed{\\frac{1}{2}}', '\\frac{1}{2}', 1.0),
    (T + '\\boxed{0.5}', '\\frac{1}{2}', 1.0),
    (T + '\\boxed{3.0}', '3', 1.0),
    (T + '\\boxed{60^\\circ}', '60', 1.0),
    (T + '\\boxed{60 degrees}', '60', 1.0),
    (T + '\\boxed{12 cm}', '12', 1.0),
    (T + '\\boxed{4\\pi}', '4\\pi', 1.0),
    (T + '\\boxed{4 \\pi}', '4\\pi', 1.0),
    (T + '\\boxed{12.57}', '4\\pi', 0.1),
    (T + '\\boxed{x=5}', '5', 1.0),
    (T + '\\boxed{\\text{5}}', '5', 1.0),
    (T + '\\boxed{1,000}', '1000', 1.0),
    (T + '\\boxed{(1,2)}', '(1,2)', 1.0),
    (T + '\\boxed{(2,1)}', '(1,2)', 0.1),
    (T + '\\boxed{5\\sqrt{2}}', '5\\sqrt{2}', 1.0),
    (T + '\\boxed{7.07}', '5\\sqrt{2}', 0.1),
    (T + '\\boxed{\\frac{\\sqrt{3}}{2}}', '\\frac{\\sqrt{3}}{2}', 1.0),
    (T + '\\boxed{\\dfrac{\\sqrt3}{2}}', '\\frac{\\sqrt{3}}{2}', 1.0),
    (T + '\\boxed{32.5}', '32.5', 1.0),
    (T + '\\boxed{32.50}', '32.5', 1.0),
    (T + '\\boxed{65/2}', '32.5', 1.0),
    (T + '\\boxed{}', '5', 0.1),
    (T + '\\boxed{5', '5', 0.0),
    ('<think>a</think>\\boxed{a}\\boxed{5}', '5', 1.0),
    ('<think>\\boxed{5}</think>', '5', 0.9),
    ('x <think>a</think>\\boxed{5}', '5', 0.9),
    ('<think>a</think>\\boxed{5} trailing', '5', 1.0),
    ('<think>a</think>\\boxed{\\boxed{5}}', '5', 1.0),
    (T + '\\boxed{None}', 'None', 1.0),
    (T + 'The answer is 5', '5', 0.0),
    (T + '\\boxed{5.0}', '5', 1.0),
    (T + '\\boxed{-3}', '-3', 1.0),
    (T + '\\boxed{- 3}', '-3', 1.0),
    (T + '\\boxed{2\\sqrt{221}}', '2\\sqrt{221}', 1.0),
    (T + '\\boxed{29.7}', '2\\sqrt{221}', 0.1),
    (T + '\\boxed{\\frac{40}{3}}', '\\frac{40}{3}', 1.0),
    (T + '\\boxed{13.33}', '\\frac{40}{3}', 0.1),
    (T + '\\boxed{40/3}', '\\frac{40}{3}', 1.0),
    (T + '\\boxed{A}', 'A', 1.0),
    (T + '\\boxed{a}', 'A', 1.0),
    (T + '\\boxed{3\\sqrt{2}+1}', '1+3\\sqrt{2}', 1.0),
    (T + '\\boxed{10^{2}}', '100', 0.1),
    (T + '\\boxed{2\\cdot 3}', '6', 0.1),
    (T + '\\boxed{\\$5}', '5', 1.0),
    (T + '\\boxed{5\\%}', '5', 1.0),
    (T + '\\boxed{2 million}', '2000000', 0.1),
    (T + '\\boxed{\\frac{9\\sqrt{3}}{4}}', '\\frac{9}{4}\\sqrt{3}', 1.0),
    (T + '\\boxed{8.5}', '\\frac{17}{2}', 1.0),
    (T + '\\boxed{\\sin(30)}', '0.5', 0.1),
    (T + '\\boxed{\\tan 45}', '1', 0.1),
    (T + '\\boxed{\\sqrt{2}/2}', '\\frac{\\sqrt{2}}{2}', 1.0),
]

# (response, ground truth, verl's score, portrl's score), documented in portrl/rewards/geo3k.py: mixed numbers are
# not read as sums; a missing box is not the answer "None"
KNOWN_DIFFERENCES = [(T + "\\boxed{7 3/4}", "31/4", 1.0, 0.1), (T + "\\boxed{7\\frac{3}{4}}", "31/4", 1.0, 0.1),
                     (T + "no box", "None", 0.9, 0.0)]


@pytest.mark.skipif(not sympy_available(), reason="verl's grader simplifies with sympy")
@pytest.mark.parametrize("response,truth,verl_score", VERL_TABLE)
def test_geo3k_scores_as_verl(response, truth, verl_score):
    result = compute_score("hiyouga/geometry3k", response, truth)
    assert result["score"] == pytest.approx(verl_score, abs=1e-12)
    assert result["acc"] == (1.0 if verl_score >= 0.9 - 1e-9 else 0.0)


@pytest.mark.skipif(not sympy_available(), reason="verl's grader simplifies with sympy")
@pytest.mark.parametrize("response,truth,verl_score,portrl_score", KNOWN_DIFFERENCES)
def test_geo3k_documented_differences(response, truth, verl_score, portrl_score):
    assert compute_score("hiyouga/geometry3k", response, truth)["score"] == pytest.approx(portrl_score)
    assert verl_score != portrl_score


def test_geo3k_is_routed_by_verls_exact_name_only():
    assert reward_kind("hiyouga/geometry3k") == "geo3k"
    for near_miss in ("geometry3k", "hiyouga/Geometry3K", "geo3k"):  # verl's dispatcher compares the name exactly
        with pytest.raises(UnknownDataSource):
            reward_kind(near_miss)
    assert len(VERL_TABLE) >= 60 and {s for *_, s in VERL_TABLE} == {0.0, 0.1, 0.9, 1.0}
