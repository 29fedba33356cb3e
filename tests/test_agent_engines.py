"""The agent loop on the real ``hf`` engine (a tiny Qwen2 with the byte-level tokenizer): every model token's
rollout log-prob equals the trainer's forward over the whole trajectory (prompt, model turns, tool turns), so the
tool turns are the context the engine read and the model's tokens were never re-encoded. A parser of the test's own
(the registry is open) makes every turn call a tool, so a random model runs several turns; the live trajectories'
turns go to the engine together."""

from __future__ import annotations

import pytest
import torch

from portrl.agent.loop import AgentLimits, AgentRow, ToolAgentLoop
from portrl.agent.parsers import ToolCall, ToolCallParser, register_parser
from portrl.agent.tools.decorator import tool


@register_parser("test_every_turn")
class EveryTurn(ToolCallParser):
    """Reads a call to ``echo`` in every turn (whatever the text)."""

    def parse(self, text):
        return text, [ToolCall(name="echo", arguments={"text": text[:12]}, error=None)]


@tool(description="Echo the text back.")
def echo(text: str) -> str:
    return f"echo: {text!r}"


def trajectory_logprobs(model, traj, temperature=1.0):
    """The trainer's log-prob of every response token, from one forward of prompt + response."""
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(traj.prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(traj.response_ids)[:, None]).squeeze(-1)


def run_three_turns(engine, tokenizer, seed=3):
    from portrl.rollout import SamplingParams

    loop = ToolAgentLoop(tokenizer, {"echo": echo}, EveryTurn(), AgentLimits(max_response_tokens=120,
                                                                             max_assistant_turns=3))
    rows = []
    for q in ("1+2?", "hello there", "x"):
        messages = [{"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        rows.append(AgentRow(tokenizer(text, add_special_tokens=False)["input_ids"], messages, {}))
    # a random model seldom samples <|im_end|>: the lower-case letters stop a turn too, so that turns are short
    params = SamplingParams(temperature=1.0, max_new_tokens=120, seed=seed,
                            stop_token_ids=(tokenizer.eos_token_id, *range(ord("a"), ord("z") + 1)))
    return loop.run(engine, rows, params)


def check_against_forward(model, trajs, atol):
    multi = 0
    for traj in trajs:
        mask = torch.tensor(traj.response_mask, dtype=torch.bool)
        want = trajectory_logprobs(model, traj)[mask]
        torch.testing.assert_close(torch.tensor(traj.logprobs)[mask], want, atol=atol, rtol=0)
        assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.response_mask) if not m)
        multi += traj.num_turns > 1 and 0 in traj.response_mask
    assert multi >= 1  # some trajectory ran a tool turn between two model turns


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from portrl.models import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("agent") / "tiny", hidden_size=64, initializer_range=0.2, seed=0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def test_hf_engine_runs_the_loop_and_its_logprobs_are_the_trainers(tiny):
    from portrl.rollout import make_engine

    model, tokenizer = tiny
    engine = make_engine("hf", model=model, tokenizer=tokenizer, backend="cpu")
    trajs = run_three_turns(engine, tokenizer)
    check_against_forward(model, trajs, atol=1e-4)
    again = run_three_turns(engine, tokenizer)
    assert [t.response_ids for t in again] == [t.response_ids for t in trajs]  # seeded: reproducible
