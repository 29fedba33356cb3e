"""RewardManager: batch scoring, custom rewards and their errors, overlong shaping, token placement."""

import pytest
import torch

from portrl.rewards.custom import RewardFileError
from portrl.rewards import (RewardFunctionError, RewardManager, load_custom_reward, per_source_metrics,
                            place_on_last_token)

SOURCES = ["openai/gsm8k", "lighteval/MATH", "arith", "math_dapo"]
RESPONSES = ["... #### 72", "\\boxed{\\frac12}", "20", "Answer: 5"]
TRUTHS = ["72", "0.5", "19", "5"]


def test_scores_a_mixed_batch():
    result = RewardManager(num_workers=1).score(RESPONSES, SOURCES, TRUTHS, [None] * 4)
    assert result.scores.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert result.acc.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert result.scores.dtype == torch.float32 and result.scores.shape == (4,)
    assert result.extra["pred"] == ["72", "\\frac12", "20", "5"]


def test_parallel_matches_inline():
    n = 40
    responses = [f"#### {i % 7}" for i in range(n)]
    sources, truths = ["openai/gsm8k"] * n, ["3"] * n
    inline = RewardManager(num_workers=1).score(responses, sources, truths)
    manager = RewardManager(num_workers=2, parallel_threshold=8)
    try:
        parallel = manager.score(responses, sources, truths)
    finally:
        manager.close()
    assert torch.equal(inline.scores, parallel.scores) and inline.extra == parallel.extra
    assert parallel.scores.sum().item() == sum(1 for i in range(n) if i % 7 == 3)


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="ground_truths has 1 rows but responses has 2"):
        RewardManager(num_workers=1).score(["a", "b"], ["arith", "arith"], ["1"])


def test_unknown_source_names_the_row():
    with pytest.raises(RewardFunctionError, match="row 1 .*'my_data'.*no built-in reward"):
        RewardManager(num_workers=1).score(["1", "2"], ["arith", "my_data"], ["1", "2"])


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def length_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': len(solution_str) / 10, 'tag': data_source}\n"
        "def plain(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if solution_str == ground_truth else -0.5\n"
        "def broken(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'bad':\n"
        "        raise KeyError('boom')\n"
        "    return 0.0\n"
        "def nan(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float('nan')\n"
        "NOT_A_FUNCTION = 3\n"
    )
    return path


def test_custom_reward(reward_file):
    result = RewardManager(str(reward_file), "length_reward", num_workers=1).score(["abc", "abcdefghij"], ["x", "y"], ["", ""])
    assert result.scores.tolist() == pytest.approx([0.3, 1.0])
    assert result.acc.tolist() == [1.0, 1.0]  # float-like score > 0 counts as correct when no "acc"
    assert result.extra == {"tag": ["x", "y"]}
    plain = RewardManager(str(reward_file), "plain", num_workers=1).score(["a", "b"], ["x", "x"], ["a", "a"])
    assert plain.scores.tolist() == [1.0, -0.5] and plain.acc.tolist() == [1.0, 0.0]


def test_custom_reward_in_worker_processes(reward_file):
    manager = RewardManager(str(reward_file), "plain", num_workers=2, parallel_threshold=2)
    try:
        assert manager.score(["a", "b", "a"], ["x"] * 3, ["a"] * 3).scores.tolist() == [1.0, -0.5, 1.0]
    finally:
        manager.close()


def test_custom_reward_errors(reward_file, tmp_path):
    with pytest.raises(RewardFileError, match="nope.py"):
        RewardManager(str(tmp_path / "nope.py"), "f")
    with pytest.raises(RewardFileError, match="defines no 'missing'.*broken, length_reward, nan, plain"):
        RewardManager(str(reward_file), "missing")
    with pytest.raises(RewardFileError, match="NOT_A_FUNCTION.*is a int"):
        load_custom_reward(reward_file, "NOT_A_FUNCTION")
    with pytest.raises(RewardFunctionError, match="'broken' from .*my_reward.py.* row 1 .*KeyError"):
        RewardManager(str(reward_file), "broken", num_workers=1).score(["ok", "bad"], ["x", "x"], ["", ""])
    with pytest.raises(RewardFunctionError, match="non-finite"):
        RewardManager(str(reward_file), "nan", num_workers=1).score(["ok"], ["x"], [""])
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def f(:\n")
    with pytest.raises(RewardFileError, match="syntax.py.*failed to import: SyntaxError"):
        RewardManager(str(syntax), "f")
    with pytest.raises(ValueError, match="custom.name is set but reward.custom.path is not"):
        RewardManager(custom_name="f")


def test_overlong_shaping_in_manager():
    manager = RewardManager(overlong_buffer={"enable": True, "len": 4, "penalty_factor": 1.0},
                            max_response_length=20, num_workers=1)
    result = manager.score(["19", "19", "18"], ["arith"] * 3, ["19"] * 3, response_lengths=[5, 18, 20])
    assert result.scores.tolist() == [1.0, 0.5, -1.0]
    assert result.acc.tolist() == [1.0, 1.0, 0.0]
    assert result.extra["overlong_reward"] == [0.0, -0.5, -1.0]
    assert result.extra["raw_score"] == [1.0, 1.0, 0.0]
    assert result.extra["overlong"] == [False, False, True]
    with pytest.raises(ValueError, match="response_lengths"):
        manager.score(["19"], ["arith"], ["19"])
    with pytest.raises(ValueError, match="max_response_length"):
        RewardManager(overlong_buffer={"enable": True, "len": 4})
    with pytest.raises(ValueError, match="unknown keys"):
        RewardManager(overlong_buffer={"enable": True, "length": 4}, max_response_length=8)
    off = RewardManager(overlong_buffer={"enable": False, "len": 4}, max_response_length=20, num_workers=1)
    assert off.score(["19"], ["arith"], ["19"], response_lengths=[20]).scores.tolist() == [1.0]


def test_place_on_last_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]])
    out = place_on_last_token(torch.tensor([1.0, -2.0, 3.0, 0.5]), mask)
    assert out.tolist() == [[0, 0, 1.0, 0], [-2.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0.5, 0]]
    with pytest.raises(ValueError, match="scores must be"):
        place_on_last_token(torch.zeros(2), mask)


def test_per_source_metrics():
    m = per_source_metrics(["a", "b", "a"], torch.tensor([1.0, 0.0, 0.0]), [1.0, 0.0, 0.0], prefix="val/")
    assert m == {"val/score/a": 0.5, "val/acc/a": 0.5, "val/count/a": 2.0,
                 "val/score/b": 0.0, "val/acc/b": 0.0, "val/count/b": 1.0}
