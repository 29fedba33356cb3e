"""GSM8K and arith rewards on real GSM8K rows (tests/data/gsm8k_sample.jsonl, MIT, see its LICENSE)."""

import json
from pathlib import Path

import pytest

from portrl.data.gsm8k import extract_ground_truth
from portrl.rewards import compute_score, reward_kind
from portrl.rewards.gsm8k import compute_score as gsm8k_score
from portrl.rewards.gsm8k import extract_answer

ROWS = [json.loads(line) for line in (Path(__file__).parent / "data" / "gsm8k_sample.jsonl").read_text().splitlines()]


def test_sample_has_50_real_rows():
    assert len(ROWS) == 50
    assert all("####" in r["answer"] for r in ROWS)


def test_reference_solutions_score_one_strict_and_flexible():
    for r in ROWS:
        truth = extract_ground_truth(r["answer"])
        assert truth is not None and "," not in truth
        assert compute_score("openai/gsm8k", r["answer"], truth) == {"score": 1.0, "acc": 1.0, "pred": truth}
        assert gsm8k_score(r["answer"], truth, method="flexible")["score"] == 1.0


def test_first_row_known_answer():
    assert extract_ground_truth(ROWS[0]["answer"]) == "63"
    assert extract_ground_truth(ROWS[1]["answer"]) == "4"


def test_wrong_answer_gets_format_score():
    r = ROWS[0]
    wrong = r["answer"].rsplit("####", 1)[0] + "#### 64"
    assert gsm8k_score(wrong, "63")["score"] == 0.0
    out = gsm8k_score(wrong, "63", format_score=0.1)
    assert out == {"score": 0.1, "acc": 0.0, "pred": "64"}


def test_strict_needs_marker_flexible_takes_last_number():
    text = "She needs 3*21 = 63 skeins. The answer is 63."
    assert gsm8k_score(text, "63")["score"] == 0.0  # no "####": no answer, not even format_score
    assert gsm8k_score(text, "63", format_score=0.1)["score"] == 0.0
    assert gsm8k_score(text, "63", method="flexible")["score"] == 1.0
    assert extract_answer("#### 5 then 7", "flexible") == "7"


def test_strict_uses_last_marker_commas_dollars_and_decimals():
    assert extract_answer("#### 3\nno wait\n#### 1,234") == "1234"
    assert gsm8k_score("#### $1,234", "1234")["score"] == 1.0
    assert gsm8k_score("#### 18.00", "18")["score"] == 1.0
    assert gsm8k_score("#### -5", "-5")["score"] == 1.0
    assert gsm8k_score("#### 5", "-5")["score"] == 0.0


def test_strict_only_searches_last_300_chars():
    text = "#### 63\n" + "x" * 400
    assert extract_answer(text) is None
    assert extract_answer("x" * 400 + "\n#### 63") == "63"


def test_megabyte_and_garbage_never_crash():
    big = ("1,2,3 ####" * 100_000) + " #### 7"
    assert gsm8k_score(big, "7")["score"] == 1.0
    for junk in ("", "####", "#### ", "#### ,,,", "#### .", "-", "-.-", "1e999999", "\x00\uffff"):
        out = gsm8k_score(junk, "7", method="strict")
        assert out["score"] == 0.0
        assert gsm8k_score(junk, "7", method="flexible")["score"] == 0.0


@pytest.mark.parametrize("source,kind", [
    ("openai/gsm8k", "gsm8k"), ("DigitalLearningGmbH/MATH-lighteval", "math"), ("lighteval/MATH", "math"),
    ("HuggingFaceH4/MATH-500", "math"), ("numina_olympiads", "prime_math"), ("math_dapo", "dapo_math"),
    ("aime24", "dapo_math"), ("aime_2025", "dapo_math"), ("arith", "arith"),
])
def test_verl_data_source_names(source, kind):
    assert reward_kind(source) == kind


def test_unknown_source_is_a_clear_error():
    with pytest.raises(ValueError, match="no built-in reward for data_source 'my_dataset'.*custom"):
        compute_score("my_dataset", "x", "y")


def test_arith_reward():
    assert compute_score("arith", "19", "19")["score"] == 1.0
    assert compute_score("arith", "12+7=19", "19")["score"] == 1.0
    assert compute_score("arith", "-12", "-12")["score"] == 1.0
    assert compute_score("arith", "12", "-12")["score"] == 0.0
    assert compute_score("arith", "19 or 20", "19")["score"] == 0.0
    assert compute_score("arith", "", "19") == {"score": 0.0, "acc": 0.0, "pred": None}
    assert compute_score("arith", "9" * 1_000_000, "19")["score"] == 0.0
