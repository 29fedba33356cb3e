"""reward.timeout_s: a reward function that never returns is stopped within the limit, with an error naming it
(reward.on_timeout=error) or with the rows left scored 0 and a warning (reward.on_timeout=zero); inline, in the
process pool, and in a real `portrl train`."""

import logging
import textwrap
import time

import pytest

from portrl.errors import UserError
from portrl.rewards import RewardManager
from portrl.rewards.manager import RewardTimeoutError
from portrl.rewards.time_limit import TimeLimitReached, call_with_time_limit

STUCK = textwrap.dedent("""
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "ok":
            return 1.0
        try:
            {body}
        except Exception:  # a function that swallows errors is still stopped
            pass
        return 0.5
""")
BODIES = {"sleep": "time.sleep(10**6)", "busy": "while True: pass"}
SMALL = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=64", "data.arith.num_test=8",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
         "model.sft_steps=4", "model.sft_batch_size=8", "trainer.progress_bar=false", "trainer.plot=false",
         "trainer.export_hf=false", "trainer.loggers=[jsonl]"]


def _reward(tmp_path, body="sleep"):
    path = tmp_path / f"stuck_{body}.py"
    path.write_text(STUCK.format(body=BODIES[body]))
    return str(path)


@pytest.mark.parametrize("body", ["sleep", "busy"])
def test_stuck_reward_is_an_error_naming_the_function(tmp_path, body):
    path = _reward(tmp_path, body)
    manager = RewardManager(custom_path=path, num_workers=1, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RewardTimeoutError) as err:
        manager.score(["ok", "stuck", "ok"], ["arith"] * 3, ["1"] * 3)
    assert time.monotonic() - t0 < 4.0
    msg = str(err.value)
    assert f"custom reward 'compute_score' from '{path}'" in msg and "reward.timeout_s=1s" in msg
    assert "the first row 1" in msg and "reward.on_timeout=zero" in msg and "\n" not in msg
    assert isinstance(err.value, UserError)  # portrl prints it as one line, exit code 2
    assert manager.score(["ok"], ["arith"], ["1"]).scores.tolist() == [1.0]  # the limit is per batch


def test_zero_mode_keeps_scored_rows_and_warns(tmp_path, caplog):
    manager = RewardManager(custom_path=_reward(tmp_path), num_workers=1, timeout_s=1.0, on_timeout="zero")
    with caplog.at_level(logging.WARNING, logger="portrl.rewards.manager"):
        result = manager.score(["ok", "stuck", "ok"], ["arith"] * 3, ["1"] * 3)
    assert result.scores.tolist() == [1.0, 0.0, 0.0] and result.acc.tolist() == [1.0, 0.0, 0.0]
    assert "compute_score" in caplog.text and "2 rows left" in caplog.text and "score 0" in caplog.text


def test_stuck_reward_in_the_process_pool(tmp_path):
    manager = RewardManager(custom_path=_reward(tmp_path), num_workers=2, parallel_threshold=4, timeout_s=3.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(RewardTimeoutError, match="compute_score"):
            manager.score(["ok", "ok", "stuck", "ok"], ["arith"] * 4, ["1"] * 4)
        assert time.monotonic() - t0 < 15.0  # spawning the pool's processes included
        assert manager._pool is None  # its stuck processes were terminated
    finally:
        manager.close()


def test_bad_settings_and_the_helper():
    with pytest.raises(UserError, match="reward.on_timeout='skip'.*valid: error, zero"):
        RewardManager(num_workers=1, on_timeout="skip")
    with pytest.raises(UserError, match="reward.timeout_s=-1"):
        RewardManager(num_workers=1, timeout_s=-1)
    assert call_with_time_limit(lambda: 7, 5.0) == 7
    with pytest.raises(TimeLimitReached):
        call_with_time_limit(lambda: time.sleep(30), 0.2)
    time.sleep(0.3)  # a late alarm must not end the process (the handler was restored, no signal sent)


def test_train_stops_on_a_stuck_reward(tmp_path, capsys, monkeypatch):
    from portrl.cli import main

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "hangs_on_wrong_answers.py"
    path.write_text(textwrap.dedent("""
        import time

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str.strip() == str(ground_truth).strip():
                return 1.0
            time.sleep(10**6)  # e.g. a symbolic check that never ends
    """))
    code = main(["--log-level", "WARNING", "train", *SMALL, "trainer.total_steps=2",
                 f"trainer.output_dir={tmp_path / 'run'}", f"reward.custom.path={path}", "reward.timeout_s=1"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    assert f"custom reward 'compute_score' from '{path}' did not score a batch" in err.splitlines()[-1]


def test_train_stops_on_a_reward_stuck_in_the_preflight_check(tmp_path, capsys, monkeypatch):
    from portrl.cli import main

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    path = _reward(tmp_path)  # stuck on every answer but "ok", the ground truth included
    code = main(["--log-level", "WARNING", "train", *SMALL, f"trainer.output_dir={tmp_path / 'run'}",
                 f"reward.custom.path={path}", "reward.timeout_s=1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert f"custom reward 'compute_score' from '{path}' did not score one row within reward.timeout_s=1s" in err
