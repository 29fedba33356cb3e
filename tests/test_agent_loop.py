"""The agent loop's token bookkeeping, exactly, with a scripted engine and the tiny model's real tokenizer: the
model's tokens and log-probs are kept as the engine returned them (mask 1), the tool turn is the chat template's
delta (mask 0, log-prob 0), all live trajectories' turns go to the engine in one call, and the limits end a
trajectory where they say. The running ids equal the template's tokenization of the conversation (strict mode)."""

import json

import pytest

from portrl.agent.loop import AgentLimits, AgentRow, ToolAgentLoop
from portrl.agent.parsers import get_parser
from portrl.agent.rollout import trajectory_meta
from portrl.agent.tools.decorator import tool
from portrl.models.tokenizer import build_char_tokenizer
from portrl.rollout.engine import RolloutEngine
from portrl.rollout.types import FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams
from portrl.workers.batch import build_rollout_batch

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def call_text(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedEngine(RolloutEngine):
    """Answers each prompt with the next turn of the script whose key the prompt contains; records every call."""

    name = "scripted"

    def __init__(self, scripts):
        self.scripts = scripts  # key text -> list of turn texts (each ends with eos unless it ends with "...")
        self.calls = []

    def generate(self, prompts, params, multi_modal=None):
        self.calls.append((len(prompts), params))
        out = RolloutOutput()
        for p in prompts:
            text = TOK.decode(p)
            key = next(k for k in self.scripts if k in text)
            turn = text.count("<|im_start|>assistant") - 1
            reply = ids(self.scripts[key][turn])
            if not self.scripts[key][turn].endswith("..."):
                reply = reply + [EOS]
            reply = reply[:params.max_new_tokens]
            out.response_ids.append(reply)
            out.logprobs.append([-0.01 * (k + 1) - turn for k in range(len(reply))])
            stopped = reply[-1] == EOS
            out.finish_reasons.append(FINISH_STOP if stopped else FINISH_LENGTH)
        return out

    def update_weights(self, named_tensors):
        pass


@tool(description="Evaluate an arithmetic expression.")
def calculator(expression: str) -> str:
    return str(eval(expression, {"__builtins__": {}}))  # test tool: the scripted model writes the expressions


def _loop(strict=True, **limits):
    limits = {"max_response_tokens": 400, "strict": strict, **limits}
    return ToolAgentLoop(TOK, {"calculator": calculator}, get_parser("hermes"), AgentLimits(**limits))


def _row(question):
    messages = [{"role": "user", "content": question}]
    prompt = TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return AgentRow(ids(prompt), messages, {})


def test_two_turns_keep_the_models_tokens_and_mask_the_tool_turn():
    engine = ScriptedEngine({"A?": [call_text("calculator", expression="12*34"), "It is 408."],
                             "B?": ["Just 7."]})
    loop = _loop()
    a, b = loop.run(engine, [_row("A?"), _row("B?")], SamplingParams(max_new_tokens=400, seed=5))
    turn1, turn2 = ids(call_text("calculator", expression="12*34")) + [EOS], ids("It is 408.") + [EOS]
    delta = loop.delta.tool_turn_ids(["408"])
    assert TOK.decode(delta).startswith("\n<|im_start|>") and TOK.decode(delta).endswith("<|im_start|>assistant\n")
    assert a.response_ids == turn1 + delta + turn2
    assert a.response_mask == [1] * len(turn1) + [0] * len(delta) + [1] * len(turn2)
    assert a.logprobs == ([-0.01 * (k + 1) for k in range(len(turn1))] + [0.0] * len(delta)
                          + [-0.01 * (k + 1) - 1 for k in range(len(turn2))])
    assert a.turn_ends == [len(turn1) - 1, len(a.response_ids) - 1] and a.num_turns == 2
    assert (a.tool_calls, a.tool_errors, a.finish_reason) == (1, 0, FINISH_STOP)
    assert [m["role"] for m in a.trace] == ["user", "assistant", "tool", "assistant"] and a.trace[2]["content"] == "408"
    assert b.response_ids == ids("Just 7.") + [EOS] and b.response_mask == [1] * len(b.response_ids)
    assert b.num_turns == 1 and b.tool_calls == 0
    # round 1 had both trajectories in one call, round 2 only the live one; seeds differ per round
    assert [c[0] for c in engine.calls] == [2, 1] and engine.calls[0][1].seed == 5 and engine.calls[1][1].seed == 5 + 7919
    # strict mode: the running ids are the template's tokenization (the loop would have raised otherwise)
    full = TOK.apply_chat_template([{"role": "user", "content": "A?"},
                                    {"role": "assistant", "content": call_text("calculator", expression="12*34")},
                                    {"role": "tool", "content": "408"}], add_generation_prompt=True, tokenize=False)
    assert a.prompt_ids + a.response_ids[:len(turn1) + len(delta)] == ids(full)


def test_batch_carries_the_mask_and_the_meta():
    engine = ScriptedEngine({"A?": [call_text("calculator", expression="1+1"), "2."], "B?": ["3."]})
    trajs = _loop().run(engine, [_row("A?"), _row("B?")], SamplingParams(max_new_tokens=400))
    batch = build_rollout_batch([trajs[0].prompt_ids, trajs[1].prompt_ids], [t.response_ids for t in trajs],
                                [t.logprobs for t in trajs], pad_token_id=TOK.pad_token_id,
                                response_masks=[t.response_mask for t in trajs])
    P = batch["prompts"].shape[1]
    assert batch["response_mask"][0].tolist()[:len(trajs[0].response_mask)] == trajs[0].response_mask
    assert batch["attention_mask"][0, P:].sum() == len(trajs[0].response_ids)  # the model reads the tool turn
    assert batch["response_mask"][0].sum() < len(trajs[0].response_ids)
    meta = trajectory_meta(trajs)
    assert meta["num_turns"] == [2, 1] and meta["tool_calls"] == [1, 0] and meta["turn_ends"][1] == [2]


def test_errors_are_the_tools_output_and_the_run_goes_on():
    engine = ScriptedEngine({"A?": [call_text("nope", x=1) + call_text("calculator", expression="1/0"), "Sorry."]})
    (a,) = _loop(max_parallel_calls=2).run(engine, [_row("A?")], SamplingParams(max_new_tokens=400))
    assert (a.tool_calls, a.tool_errors, a.num_turns) == (2, 2, 2)
    tool_msgs = [m["content"] for m in a.trace if m["role"] == "tool"]
    assert "nope" in tool_msgs[0] and "calculator" in tool_msgs[0]  # names the unknown tool and the valid ones
    assert "ZeroDivisionError" in tool_msgs[1]


def test_limits_end_trajectories():
    script = {"A?": [call_text("calculator", expression="1+1")] * 5}
    (a,) = _loop(max_assistant_turns=2).run(ScriptedEngine(script), [_row("A?")], SamplingParams(max_new_tokens=400))
    assert a.num_turns == 2 and a.tool_calls == 1 and a.finish_reason == FINISH_STOP  # the 2nd turn's call never runs
    (b,) = _loop(max_response_tokens=60).run(ScriptedEngine(script), [_row("A?")], SamplingParams(max_new_tokens=400))
    assert len(b.response_ids) == 60 and b.finish_reason == FINISH_LENGTH  # the budget covers tool tokens too
    long = {"A?": [call_text("calculator", expression="7**200"), "ok"]}
    (c,) = _loop(max_tool_response_length=20, tool_response_truncate_side="left").run(
        ScriptedEngine(long), [_row("A?")], SamplingParams(max_new_tokens=400))
    assert c.trace[2]["content"] == str(7**200)[:20] + "...(truncated)"  # left: the start is kept, as in verl


def test_strict_mode_catches_a_template_mismatch(monkeypatch):
    engine = ScriptedEngine({"A?": [call_text("calculator", expression="1+1"), "2."]})
    loop = _loop()
    real = loop.delta.tool_turn_ids
    monkeypatch.setattr(loop.delta, "tool_turn_ids", lambda texts: real(texts)[1:])  # a delta missing a token
    with pytest.raises(Exception, match="tokenization_sanity_check_mode"):
        loop.run(engine, [_row("A?")], SamplingParams(max_new_tokens=400))


def test_an_interaction_answers_turns_without_a_call_and_rewards_them(tmp_path):
    """verl's interaction: a wrong answer gets feedback as a user turn (mask 0) and the turn's score as its reward;
    a right one ends the trajectory. ``reward_feedback`` scores with the row's reward (gsm8k: ``#### N``)."""
    from portrl.agent.interactions import load_interaction_config, row_interaction

    config = tmp_path / "interaction.yaml"
    config.write_text("interaction:\n  - name: check\n    class_name: reward_feedback\n"
                      "    config: {feedback: Try again.}\n")
    interactions = load_interaction_config(config)
    picked = row_interaction(interactions, {"interaction_kwargs": {"name": "check", "ground_truth": "6"}}, "gsm8k")
    engine = ScriptedEngine({"A?": ["#### 5", "#### 6"], "B?": ["#### 1", "#### 2", "#### 3"]})
    rows = [_row("A?"), _row("B?")]
    rows[0].interaction = rows[1].interaction = picked
    a, b = _loop(max_user_turns=2).run(engine, rows, SamplingParams(max_new_tokens=400))
    first, feedback = ids("#### 5") + [EOS], _loop().delta.user_turn_ids("Try again.")
    assert a.response_ids == first + feedback + ids("#### 6") + [EOS]
    assert a.response_mask == [1] * len(first) + [0] * len(feedback) + [1] * (len(ids("#### 6")) + 1)
    assert a.turn_rewards == [0.0, 1.0] and a.finish_reason == FINISH_STOP
    assert [m["role"] for m in a.trace] == ["user", "assistant", "user", "assistant"]
    assert b.num_turns == 3 and b.turn_rewards == [0.0, 0.0, 0.0]  # max_user_turns=2: two replies, then it ends
    assert [m["content"] for m in b.trace if m["role"] == "user"][1:] == ["Try again.", "Try again."]
    with pytest.raises(Exception, match="interaction 'nope'; valid: check"):
        row_interaction(interactions, {"interaction_kwargs": {"name": "nope"}}, "gsm8k")
