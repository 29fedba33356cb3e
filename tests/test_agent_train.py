"""Multi-turn training end to end, as a user runs it: ``portrl sft`` on the built-in tool-call conversations of
``arith_tool``, then ``portrl train data=arith_tool`` with GRPO, DAPO and PPO (critic) from that checkpoint. The
tiny model calls the real calculator through the hermes parser, the batch trains with tool tokens masked, and the
run logs ``agent/*`` metrics, writes traces and saves its checkpoint.

Marked slow: the SFT that teaches a random tiny model the tool-call format takes about 40 s on a 2-core CPU (a
random model never closes a turn, so no tool turn would run without it), each training run 10-20 s."""

from __future__ import annotations

import json

import pytest

from portrl.cli import main

pytestmark = pytest.mark.slow

SMALL = ["data.arith_tool.num_train=64", "data.arith_tool.num_test=8", "device.num_threads=1",
         "trainer.progress_bar=false", "trainer.plot=false", "trainer.export_hf=false"]


@pytest.fixture(scope="module")
def tool_sft_model(tmp_path_factory):
    """The tiny model after 200 SFT steps on arith_tool's conversations (call, tool result, answer)."""
    out = tmp_path_factory.mktemp("sft") / "model"
    work = tmp_path_factory.mktemp("sftrun")
    assert main(["sft", "data=arith_tool", "--output", str(out), "--steps", "200", "--batch-size", "32",
                 "model.sft_target_answer_p=null", f"trainer.output_dir={work}", *SMALL]) == 0
    return out


@pytest.mark.parametrize("algorithm, extra", [
    ("grpo", []),
    ("dapo", ["algorithm.filter_groups.max_num_gen_batches=3"]),
    ("ppo", ["critic.optim.lr=1e-4"]),
])
def test_multi_turn_training_runs_the_calculator(tool_sft_model, tmp_path, capsys, algorithm, extra):
    run = tmp_path / "run"
    assert main(["train", f"algorithm={algorithm}", "data=arith_tool", "model=tiny", f"model.path={tool_sft_model}",
                 "model.sft_warm_start=false", "data.train_batch_size=8", "rollout.n=4",
                 "actor.ppo_mini_batch_size=8", "trainer.total_steps=2", "trainer.test_freq=2",
                 "trainer.trace_freq=1", "trainer.trace_rows=2", f"trainer.output_dir={run}", *SMALL, *extra]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "agent/tool_call_rate" in m]
    assert len(trained) == 2
    for m in trained:
        assert m["agent/tool_call_rate"] > 0.5 and m["agent/num_turns/max"] >= 2
        assert m["agent/tool_calls/mean"] >= m["agent/tool_call_rate"] and 0 <= m["agent/tool_error_rate"] <= 1
        assert all(v == v for k, v in m.items() if isinstance(v, float))  # no NaN
    assert "val/agent/tool_call_rate" in steps[-1]
    assert (run / "checkpoints" / "global_step_2").is_dir()
    capsys.readouterr()
    assert main(["trace", str(run)]) == 0
    shown = capsys.readouterr().out
    assert "=== step 2 | row 1 |" in shown and "tool (calculator)" in shown and "-> calculator(expression=" in shown
