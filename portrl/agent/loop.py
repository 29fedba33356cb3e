"""The agent loop: many trajectories at once, token in and token out, on any rollout engine.

Every round asks the engine for the next model turn of all live trajectories in ONE ``generate`` call (prompt =
the trajectory's running ids: prompt ids, then every model and tool token so far; ``n=1``), so every rollout
engine batches them as they batch single-turn prompts. A turn's tokens and log-probs are appended as the engine
returned them (never decoded and re-encoded, response mask 1). The turn's text (decoded only to read it) goes to
the tool-call parser (``rollout.multi_turn.format``); a turn without a tool call ends the trajectory. Otherwise the
calls run (portrl/agent/tools/execute.py: at most ``max_parallel_calls``, each limited to ``tool_timeout_s``; an
unknown tool, bad arguments, an exception or a timeout is an error message the model reads; a tool whose environment
broke, ``ToolUnusable``, raises out of :meth:`ToolAgentLoop.run` and stops the run), each output is cut to
``max_tool_response_length`` characters on ``tool_response_truncate_side``, and the ids the chat template adds for
those tool messages (portrl/agent/chat_delta.py, through the next generation prompt) are appended with mask 0.
The calls of all live trajectories run concurrently.

A trajectory ends when the model answers without a tool call (finish ``stop``), after ``max_assistant_turns`` model
turns (``stop``; the last turn's calls are not run), when its response-token budget ``max_response_tokens`` (the
whole trajectory: model and tool tokens) runs out (``length``; a tool turn that does not fit is cut there), or when
the engine was interrupted (``abort``). Each turn's tool rewards (``ToolResult.reward``) are summed into that turn's
entry of ``turn_rewards``.

Seeds: round ``k`` of a call with ``SamplingParams.seed = s`` samples with seed ``s + 7919 * k`` (None stays None),
so a call is reproducible on one engine and device as a single-turn one is.

With ``strict`` (``tokenization_sanity_check_mode=strict``) every tool turn compares the running ids with the chat
template's tokenization of the conversation so far and raises on the first mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from portrl.agent.chat_delta import ChatDelta, check_running_ids
from portrl.agent.interactions import Interaction
from portrl.agent.parsers import ToolCallParser
from portrl.agent.tools.base import Tool
from portrl.agent.tools.execute import run_calls_many, truncate_text
from portrl.agent.trajectory import Trajectory
from portrl.rollout.engine import eos_token_ids
from portrl.rollout.types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams

SEED_STRIDE = 7919  # round k samples with seed + SEED_STRIDE * k


@dataclass(frozen=True)
class AgentLimits:
    """The limits of ``rollout.multi_turn`` plus the response-token budget of the whole trajectory."""

    max_response_tokens: int
    max_assistant_turns: Optional[int] = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_timeout_s: float = 10.0
    strict: bool = False
    max_user_turns: Optional[int] = None

    @classmethod
    def from_config(cls, multi_turn: Any, max_response_length: int) -> "AgentLimits":
        turns = multi_turn.max_assistant_turns
        return cls(max_response_tokens=int(max_response_length),
                   max_assistant_turns=None if turns is None else int(turns),
                   max_parallel_calls=int(multi_turn.max_parallel_calls),
                   max_tool_response_length=int(multi_turn.max_tool_response_length),
                   tool_response_truncate_side=str(multi_turn.tool_response_truncate_side),
                   tool_timeout_s=float(multi_turn.tool_timeout_s),
                   max_user_turns=None if multi_turn.max_user_turns is None else int(multi_turn.max_user_turns),
                   strict=str(multi_turn.tokenization_sanity_check_mode) == "strict")


@dataclass
class AgentRow:
    """One trajectory to run: its prompt ids, the prompt's chat messages (for the trace and the strict check) and
    what the data row gives each tool (``{tool name: kwargs}``, verl's ``extra_info.tools_kwargs`` merged)."""

    prompt_ids: List[int]
    messages: List[Dict[str, Any]]
    tool_kwargs: Dict[str, Dict[str, Any]]
    interaction: Optional[Tuple[Interaction, Dict[str, Any]]] = None  # environment turns (portrl/agent/interactions)


class ToolAgentLoop:
    """The ``tool_agent`` loop (module docstring). ``tools``: name -> Tool (may be empty: the model then only talks
    and every call it makes is an unknown-tool error)."""

    name = "tool_agent"

    def __init__(self, tokenizer: Any, tools: Dict[str, Tool], parser: ToolCallParser, limits: AgentLimits,
                 schemas: Optional[List[Dict[str, Any]]] = None):
        self.tokenizer, self.tools, self.parser, self.limits = tokenizer, tools, parser, limits
        self.schemas = schemas
        self.delta = ChatDelta(tokenizer, schemas)
        self.stops = set(eos_token_ids(tokenizer))

    def run(self, engine: Any, rows: Sequence[AgentRow], params: SamplingParams) -> List[Trajectory]:
        """One trajectory per row (``params.n`` is ignored: repeat a row for more samples); rows in order."""
        trajs = [Trajectory(prompt_ids=list(r.prompt_ids), trace=[dict(m) for m in r.messages]) for r in rows]
        live = list(range(len(rows)))
        user_turns = [0] * len(rows)
        turn = 0
        while live:
            budgets = {i: self.limits.max_response_tokens - len(trajs[i].response_ids) for i in live}
            live = [i for i in live if budgets[i] > 0]
            if not live:
                break
            seed = None if params.seed is None else (params.seed + SEED_STRIDE * turn) % (2**62)
            step = replace(params, n=1, max_new_tokens=max(budgets[i] for i in live), seed=seed)
            out = engine.generate([trajs[i].prompt_ids + trajs[i].response_ids for i in live], step)
            calls_of: Dict[int, list] = {}
            replies: List[int] = []
            for row, i in enumerate(live):
                traj, budget = trajs[i], budgets[i]
                ids, lps = list(out.response_ids[row][:budget]), list(out.logprobs[row][:budget])
                traj.add_model_tokens(ids, lps)
                stops = self.stops | set(params.stop_token_ids)
                text = self.tokenizer.decode(ids[:-1] if ids and ids[-1] in stops else ids, skip_special_tokens=False)
                traj.trace.append({"role": "assistant", "content": text})
                reason = out.finish_reasons[row]
                if reason == FINISH_ABORT:
                    traj.finish_reason = FINISH_ABORT
                    continue
                if reason != FINISH_STOP or len(out.response_ids[row]) > budget:
                    traj.finish_reason = FINISH_LENGTH  # the engine's or the trajectory's budget ran out
                    continue
                _, calls = self.parser.parse(text)
                if self.limits.max_assistant_turns is not None and traj.num_turns >= self.limits.max_assistant_turns:
                    continue  # the last turn allowed: its calls never run
                if calls:
                    traj.trace[-1]["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in calls]
                    calls_of[i] = calls
                elif rows[i].interaction is not None and user_turns[i] < (self.limits.max_user_turns or 10**9):
                    replies.append(i)  # the environment answers this turn
                    user_turns[i] += 1
            self._tool_turns(trajs, rows, calls_of)
            live = sorted(list(calls_of) + self._user_turns(trajs, rows, replies))
            turn += 1
        for traj in trajs:
            traj.check()
        return trajs

    def _tool_turns(self, trajs: List[Trajectory], rows: Sequence[AgentRow], calls_of: Dict[int, list]) -> None:
        """Run the calls of every trajectory that made some (concurrently) and append their tool turns."""
        if not calls_of:
            return
        lim = self.limits
        rows_with_calls = list(calls_of)
        results = dict(zip(rows_with_calls, run_calls_many(
            self.tools, [calls_of[i] for i in rows_with_calls], [rows[i].tool_kwargs for i in rows_with_calls],
            lim.tool_timeout_s, lim.max_parallel_calls)))
        for i, res in results.items():
            traj = trajs[i]
            texts = [truncate_text(r.text, lim.max_tool_response_length, lim.tool_response_truncate_side) for r in res]
            traj.tool_calls += len(res)
            traj.tool_errors += sum(1 for r in res if r.error)
            traj.turn_rewards[-1] += sum(float(r.reward) for r in res if r.reward is not None)
            traj.trace += [{"role": "tool", "name": c.name, "content": t} for c, t in zip(calls_of[i], texts)]
            self._append_context(traj, self.delta.tool_turn_ids(texts))

    def _user_turns(self, trajs: List[Trajectory], rows: Sequence[AgentRow], replies: List[int]) -> List[int]:
        """The environment's reply to every trajectory in ``replies`` (a turn without a tool call): the turn's reward,
        then ``done`` ends it, or the reply is a user turn (mask 0). Returns the trajectories that go on."""
        going = []
        for i in replies:
            traj, picked = trajs[i], rows[i].interaction
            assert picked is not None  # only rows with an interaction are in replies
            reply = picked[0].respond(_template_messages(traj.trace), picked[1])
            traj.turn_rewards[-1] += float(reply.reward)
            if reply.done:
                continue
            traj.trace.append({"role": "user", "content": reply.text})
            self._append_context(traj, self.delta.user_turn_ids(reply.text))
            going.append(i)
        return going

    def _append_context(self, traj: Trajectory, ids: List[int]) -> None:
        """Append a tool or user turn's ids; one that leaves no room for a model turn is cut and ends the trajectory
        (``length``); with ``strict`` the running ids are checked against the template."""
        room = self.limits.max_response_tokens - len(traj.response_ids)
        if len(ids) >= room:
            traj.add_context_tokens(ids[:max(room, 0)])
            traj.finish_reason = FINISH_LENGTH
            return
        traj.add_context_tokens(ids)
        if self.limits.strict:
            check_running_ids(self.tokenizer, _template_messages(traj.trace), self.schemas,
                              traj.prompt_ids + traj.response_ids)


def _template_messages(trace: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The trace as chat-template messages (an assistant turn's raw text, calls included, as its content)."""
    return [{"role": m["role"], "content": m["content"]} for m in trace]
