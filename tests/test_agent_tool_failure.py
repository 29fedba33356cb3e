"""A python tool whose sandbox stops working stops the run with that reason, instead of training on error messages.

A program's own failures stay tool results the model reads (a traceback, a limit); the sandbox failing to start a
program (SandboxError) is ToolUnusable: run_calls_many raises it again, the agent loop passes it on, and the trainer
ends with one line naming it and the last good checkpoint (exit code 1, as for a run stopped by its environment).
The sandbox is broken for real mid-run in a child process (a seccomp filter that refuses setting resource limits,
installed after a first call worked: the sandbox's launcher then cannot start a program)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _sandbox_faults import fault_source, seccomp_available
from portrl.agent.tools import Tool, ToolResult, ToolUnusable, run_calls, run_calls_many
from portrl.agent.tools.builtin_python import PythonTool
from portrl.errors import RunFailed
from portrl.rewards.sandbox import SandboxError
from portrl.trainer.run_end import run_failure, tool_stopped_message, tool_unusable

REPO = Path(__file__).resolve().parents[1]


class Call:
    def __init__(self, name, arguments, error=None):
        self.name, self.arguments, self.error = name, arguments, error


class Broken(Tool):
    name = "broken"
    schema = {"type": "function", "function": {"name": "broken", "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}

    def call(self, arguments, row_kwargs):
        raise ToolUnusable("the python tool's sandbox cannot run programs: the sandbox could not start the program")


class Raises(Broken):
    name = "raises"

    def call(self, arguments, row_kwargs):
        raise RuntimeError("a bug of this call")


def test_a_tool_that_raises_is_a_message_but_an_unusable_tool_raises():
    tools = {"broken": Broken(), "raises": Raises()}
    [one] = run_calls(tools, [Call("raises", {})])
    assert one.error and one.text == "Error: tool 'raises' raised RuntimeError: a bug of this call"
    with pytest.raises(ToolUnusable, match="sandbox could not start the program"):
        run_calls_many(tools, [[Call("raises", {})], [Call("broken", {})]], [{}, {}])


def test_the_python_tool_turns_a_sandbox_failure_into_tool_unusable(monkeypatch):
    import portrl.agent.tools.builtin_python as builtin

    def cannot_start(source, stdin, limits):
        raise SandboxError("the sandbox could not start the program: OSError: cannot mount /opt/python")

    monkeypatch.setattr(builtin, "run_program", cannot_start)
    with pytest.raises(ToolUnusable) as caught:
        PythonTool().call({"code": "print(1)"}, {})
    assert str(caught.value) == ("the python tool's sandbox cannot run programs: the sandbox could not start the "
                                 "program: OSError: cannot mount /opt/python")
    assert isinstance(caught.value.__cause__, SandboxError)


def test_a_programs_own_failures_stay_tool_results():
    py = PythonTool(timeout_s=2.0, memory_mb=256)
    raised = py.call({"code": "raise ValueError('mine')"}, {})
    assert not raised.error and raised.text.endswith("ValueError: mine")
    slow = py.call({"code": "while True: pass"}, {})
    assert slow.error and "time limit" in slow.text
    big = py.call({"code": "x = bytearray(1 << 30)"}, {})
    assert isinstance(big, ToolResult) and big.error and "out of memory" in big.text


_MID_RUN = textwrap.dedent("""
    import json
    from portrl.agent.loop import AgentLimits, AgentRow, ToolAgentLoop
    from portrl.agent.parsers import get_parser
    from portrl.agent.tools import ToolUnusable
    from portrl.agent.tools.builtin_python import PythonTool
    from portrl.models.tokenizer import build_char_tokenizer
    from portrl.rollout.engine import RolloutEngine
    from portrl.rollout.types import FINISH_STOP, RolloutOutput, SamplingParams

    TOK = build_char_tokenizer()
    CALL = '<tool_call>\\n' + json.dumps({{"name": "python", "arguments": {{"code": "print(6 * 7)"}}}}) + '\\n</tool_call>'

    class Engine(RolloutEngine):
        name = "scripted"
        def generate(self, prompts, params, multi_modal=None):
            out = RolloutOutput()
            for p in prompts:
                turn = TOK.decode(p).count("<|im_start|>assistant") - 1
                reply = TOK(CALL if turn == 0 else "done", add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
                out.response_ids.append(reply)
                out.logprobs.append([-0.1] * len(reply))
                out.finish_reasons.append(FINISH_STOP)
            return out
        def update_weights(self, named_tensors):
            pass

    loop = ToolAgentLoop(TOK, {{"python": PythonTool(timeout_s=10.0)}}, get_parser("hermes"),
                         AgentLimits(max_response_tokens=400))
    messages = [{{"role": "user", "content": "6 * 7?"}}]
    prompt = TOK(TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    rows = [AgentRow(prompt, messages, {{}})] * 2
    [first, _] = loop.run(Engine(), rows, SamplingParams(max_new_tokens=400))
    print(json.dumps({{"first": [m["content"] for m in first.trace if m["role"] == "tool"],
                      "errors": first.tool_errors}}), flush=True)
    {fault}
    try:
        loop.run(Engine(), rows, SamplingParams(max_new_tokens=400))
        print(json.dumps({{"stopped": None}}))
    except ToolUnusable as exc:
        print(json.dumps({{"stopped": str(exc)}}))
""")


def test_a_sandbox_that_breaks_mid_run_stops_the_agent_loop():
    """Real: the first rollout's tool call works; then the process's new threads (the calls') cannot set resource
    limits, so the sandbox cannot start the program of the second rollout's call, and the loop raises."""
    if not seccomp_available():
        pytest.skip("no seccomp here to break the sandbox with")
    script = _MID_RUN.replace("{fault}", fault_source("setrlimit").replace("{", "{{").replace("}", "}}")).format()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = [json.loads(line) for line in done.stdout.strip().splitlines()[-2:]]
    assert first == {"first": ["42\n"], "errors": 0}
    assert second["stopped"].startswith("the python tool's sandbox cannot run programs: the sandbox could not start "
                                        "the program: "), second


class _Checkpoints:
    def __init__(self, latest):
        self.latest = latest

    def latest_valid(self):
        return self.latest


class _Run:
    """What run_failure reads of a run (portrl.trainer.run_end.EndingRun)."""

    def __init__(self, step, latest):
        from omegaconf import OmegaConf

        self.cfg = OmegaConf.create({"trainer": {"total_steps": 5, "resume": "auto"}})
        self.global_step, self.ckpt, self.stopped = step, _Checkpoints(latest), False

    def shutdown_workers(self):
        self.stopped = True


class RayTaskErrorLike(Exception):
    """How a Ray worker's exception reaches the driver: wrapped, the original as ``cause``."""

    def __init__(self, cause):
        super().__init__(f"ray task failed: {cause}")
        self.cause = cause


def test_the_trainer_ends_with_one_line_and_the_last_checkpoint():
    broken = ToolUnusable("the python tool's sandbox cannot run programs: the sandbox could not start the program: "
                          "ValueError: not allowed to raise maximum limit")
    run = _Run(3, Path("out/checkpoints/global_step_2"))
    err = run_failure(run, RayTaskErrorLike(broken), None)
    assert isinstance(err, RunFailed) and err.exit_code == 1 and run.stopped
    assert str(err) == ("portrl: the run stopped after step 3 of 5: the python tool's sandbox cannot run programs: the "
                        "sandbox could not start the program: ValueError: not allowed to raise maximum limit; the last "
                        "good checkpoint is out/checkpoints/global_step_2 (intact): fix that, then rerun the same "
                        "command with trainer.resume=auto to continue from it")
    assert tool_unusable(RuntimeError("other")) is None
    assert tool_stopped_message(broken, 0, 5, None).startswith("the run stopped before step 1: the python tool's")
    assert tool_stopped_message(broken, 0, 5, None).endswith("no checkpoint was written yet: fix that, then rerun the "
                                                              "same command")


def test_portrl_train_stops_with_one_line_when_the_tool_breaks(tmp_path, monkeypatch, capsys):
    """The whole path through the worker and the trainer's loop: `portrl train` of a multi-turn run whose agent loop
    raises ToolUnusable at its second rollout ends with exit code 1 and one line naming step 1's checkpoint."""
    from portrl.agent import loop
    from portrl.cli import main

    real, calls = loop.ToolAgentLoop.run, []

    def breaks_at_the_second_rollout(self, engine, rows, params):
        calls.append(len(rows))
        if len(calls) == 2:
            raise ToolUnusable("the python tool's sandbox cannot run programs: the sandbox could not start the "
                               "program: injected")
        return real(self, engine, rows, params)

    monkeypatch.setattr(loop.ToolAgentLoop, "run", breaks_at_the_second_rollout)
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    rc = main(["--log-level", "WARNING", "train", "data=arith_tool", "model.sft_warm_start=false",
               "data.arith_tool.num_train=16", "data.arith_tool.num_test=4", "data.train_batch_size=4", "rollout.n=2",
               "actor.ppo_mini_batch_size=4", "data.max_response_length=8", "trainer.total_steps=3",
               "trainer.save_freq=1", "trainer.test_freq=0", "trainer.val_before_train=false",
               "trainer.progress_bar=false", "trainer.plot=false", "trainer.export_hf=false",
               "device.num_threads=1", f"trainer.output_dir={run}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and " WARNING " not in line]
    assert rc == 1, err
    assert lines == [f"portrl: the run stopped after step 1 of 3: the python tool's sandbox cannot run programs: the "
                     f"sandbox could not start the program: injected; the last good checkpoint is "
                     f"{run / 'checkpoints' / 'global_step_1'} (intact): fix that, then rerun the same command with "
                     "trainer.resume=auto to continue from it"], err
