"""The built-in word-problem task wordprob (portrl.data.wordprob): deterministic rows, splits disjoint by their
arithmetic, worked answers that the GSM8K reward scores right and that are 30-100 tokens of the tiny model."""

from __future__ import annotations

import re

import pytest

from portrl.data import DataError, write_split
from portrl.data.schema import check_row
from portrl.data.wordprob import (MAX_ANSWER_CHARS, MIN_ANSWER_CHARS, make_wordprob_rows, make_wordprob_sft_rows,
                                  wordprob_problems)
from portrl.models.tokenizer import build_char_tokenizer
from portrl.rewards.registry import compute_score, reward_kind
from portrl.tasks import get_task

_STEP = re.compile(r"(\d+)([*+-])(\d+)=(\d+)")


def _skeleton(answer: str) -> str:
    """The arithmetic of a worked answer ("4*7+3-5"), read back from its lines."""
    steps = _STEP.findall(answer)
    return steps[0][0] + "".join(op + b for _, op, b, _ in steps)


def test_rows_are_deterministic_per_seed_and_differ_between_seeds():
    rows = make_wordprob_rows(100, seed=3)
    assert rows == make_wordprob_rows(100, seed=3)
    assert rows != make_wordprob_rows(100, seed=4)
    assert make_wordprob_sft_rows(30, seed=3, difficulty=3) == make_wordprob_sft_rows(30, seed=3, difficulty=3)
    for i, row in enumerate(rows):
        messages, source, truth, extra = check_row(row, "<wordprob>", i)
        assert source == "wordprob" and len(messages) == 1 and messages[0]["role"] == "user"
        assert extra["split"] == "train" and extra["index"] == i and extra["question"] == messages[0]["content"]
    assert len({r["prompt"][0]["content"] for r in rows}) == 100


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_train_and_test_share_no_problem_nor_computation(difficulty):
    train = wordprob_problems(2000, seed=0, difficulty=difficulty, split="train")
    test = wordprob_problems(200, seed=1, difficulty=difficulty, split="test")
    assert not {p for p, _, _ in train} & {p for p, _, _ in test}
    assert not {_skeleton(a) for _, a, _ in train} & {_skeleton(a) for _, a, _ in test}


@pytest.mark.parametrize("difficulty,steps", [(1, {2}), (2, {2, 3}), (3, {3})])
def test_worked_answers_are_right_and_scored_by_the_gsm8k_reward(difficulty, steps):
    assert reward_kind("wordprob") == "gsm8k"
    rows = make_wordprob_sft_rows(300, seed=0, difficulty=difficulty, split="test")
    assert {len(_STEP.findall(r["response"])) for r in rows} == steps
    for row in rows:
        answer, truth = row["response"], row["reward_model"]["ground_truth"]
        assert answer.endswith(f"\n#### {truth}")
        value = None
        for a, op, b, result in _STEP.findall(answer):  # every step is true arithmetic, chained
            assert value is None or int(a) == value
            value = int(a) * int(b) if op == "*" else int(a) + int(b) if op == "+" else int(a) - int(b)
            assert value == int(result) and 0 <= value < 100
        assert str(value) == truth
        assert compute_score("wordprob", answer, truth) == {"score": 1.0, "acc": 1.0, "pred": truth}
        wrong = answer[: answer.rindex("#### ")] + f"#### {int(truth) + 1}"
        assert compute_score("wordprob", wrong, truth)["acc"] == 0.0


def test_answers_are_30_to_100_tokens_of_the_tiny_model():
    tok = build_char_tokenizer()
    for difficulty in (1, 2, 3):
        rows = make_wordprob_sft_rows(500, seed=0, difficulty=difficulty)
        lengths = [len(tok(r["response"], add_special_tokens=False)["input_ids"]) for r in rows]
        assert MIN_ANSWER_CHARS <= min(lengths) and max(lengths) <= MAX_ANSWER_CHARS, (difficulty, lengths)
        assert lengths == [len(r["response"].encode()) for r in rows]  # one token per byte


def test_task_registry_parquet_and_bad_options(tmp_path):
    from portrl.data.validate import read_verl_file

    task = get_task("wordprob")
    assert task.generated and task.sft_rows and task.preset
    path = write_split(task.generate(8, 0, 2, "train"), tmp_path / "train.parquet")
    assert [r[2] for r in read_verl_file(path, "data.train_files")] == \
        [r["reward_model"]["ground_truth"] for r in make_wordprob_rows(8, seed=0, difficulty=2)]
    with pytest.raises(DataError, match=r"difficulty must be in 1..3, got 4"):
        make_wordprob_rows(1, seed=0, difficulty=4)
    with pytest.raises(DataError, match="split must be 'train' or 'test'"):
        make_wordprob_rows(1, seed=0, split="val")
