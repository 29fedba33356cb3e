"""Multi-turn rollouts of a run: the agent loops its config builds, chosen per row, and the Batch meta they fill.

:class:`AgentRollout` is built once per rollout worker from ``rollout.multi_turn`` and ``data.max_response_length``
(the tools of ``tool_config_path`` loaded then, each given the run's ``sandbox`` settings,
``Tool.configure_sandbox``). Each row runs the loop its ``agent_name`` column names (verl's
column; absent: ``tool_agent``): ``tool_agent`` (portrl/agent/loop.py) or ``single_turn`` (the same loop limited
to one model turn: a plain response). The row's ``extra_info.tools_kwargs`` (verl's, read unchanged) gives each tool
its ``create_kwargs`` and ``execute_kwargs``; its ``extra_info.interaction_kwargs`` picks the interaction of
``interaction_config_path`` that answers its turns without a tool call (portrl/agent/interactions.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence

from portrl.agent.interactions import load_interaction_config, row_interaction
from portrl.agent.loop import AgentLimits, AgentRow, ToolAgentLoop
from portrl.agent.parsers import get_parser
from portrl.agent.tools.base import Tool
from portrl.agent.tools.config import load_tool_config, tool_schemas
from portrl.agent.tools.execute import merge_tools_kwargs
from portrl.agent.trajectory import (META_NUM_TURNS, META_TOOL_CALLS, META_TOOL_ERRORS, META_TRACE, META_TURN_ENDS,
                                     META_TURN_REWARDS, Trajectory)
from portrl.errors import UserError
from portrl.rollout.types import SamplingParams

AGENT_NAMES = ("tool_agent", "single_turn")  # the values of a row's agent_name
DEFAULT_AGENT = "tool_agent"


class AgentRollout:
    """The agent loops of a run (module docstring)."""

    def __init__(self, multi_turn: Any, max_response_length: int, tokenizer: Any, sandbox: Any = None):
        path = multi_turn.tool_config_path
        self.tools = load_tool_config(str(path)) if path else {}
        configure_sandbox(self.tools, sandbox)
        self.schemas = tool_schemas(self.tools) if self.tools else None
        path = multi_turn.interaction_config_path
        self.interactions = load_interaction_config(str(path)) if path else {}
        parser = get_parser(str(multi_turn.format))
        limits = AgentLimits.from_config(multi_turn, max_response_length)
        self.loops = {
            "tool_agent": ToolAgentLoop(tokenizer, self.tools, parser, limits, self.schemas),
            "single_turn": ToolAgentLoop(tokenizer, {}, parser, _one_turn(limits), self.schemas),
        }

    def generate(self, engine: Any, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                 meta: Optional[Mapping[str, Sequence[Any]]] = None) -> List[Trajectory]:
        """``params.n`` trajectories per prompt, prompt-major (as ``RolloutEngine.generate`` orders rows)."""
        meta = meta or {}
        n = params.n
        names = list(meta.get("agent_name") or [None] * len(prompt_ids))
        messages = list(meta.get("messages") or [[] for _ in prompt_ids])
        extras = list(meta.get("extra_info") or [{} for _ in prompt_ids])
        sources = list(meta.get("data_source") or [""] * len(prompt_ids))
        groups: Dict[str, List[int]] = {}
        rows: List[AgentRow] = []
        for i, ids in enumerate(prompt_ids):
            name = names[i] or DEFAULT_AGENT
            if name not in self.loops:
                raise UserError(f"a data row has agent_name={name!r}, which is not an agent loop; valid: "
                                f"{', '.join(AGENT_NAMES)}")
            kwargs = merge_tools_kwargs((extras[i] or {}).get("tools_kwargs"))
            interaction = row_interaction(self.interactions, extras[i], str(sources[i]))
            for _ in range(n):
                groups.setdefault(name, []).append(len(rows))
                rows.append(AgentRow(list(ids), list(messages[i] or []), kwargs, interaction))
        out: List[Optional[Trajectory]] = [None] * len(rows)
        for name, members in groups.items():
            for k, traj in zip(members, self.loops[name].run(engine, [rows[k] for k in members], params)):
                out[k] = traj
        return [t for t in out if t is not None]

    def close(self) -> None:
        for tool in self.tools.values():
            tool.close()


def configure_sandbox(tools: Mapping[str, Tool], sandbox: Any) -> None:
    """Give every tool the run's ``sandbox`` config group (``allow_unisolated``, ``packages``); None (a config
    without the group): the tools keep their defaults."""
    if sandbox is None:
        return
    for tool in tools.values():
        tool.configure_sandbox(bool(sandbox.allow_unisolated), tuple(str(p) for p in sandbox.packages))


def _one_turn(limits: AgentLimits) -> AgentLimits:
    return replace(limits, max_assistant_turns=1)


def trajectory_meta(trajs: Sequence[Trajectory]) -> Dict[str, list]:
    """The per-row meta lists of a multi-turn rollout Batch (portrl/agent/trajectory.py META_*)."""
    return {META_NUM_TURNS: [t.num_turns for t in trajs], META_TOOL_CALLS: [t.tool_calls for t in trajs],
            META_TOOL_ERRORS: [t.tool_errors for t in trajs], META_TURN_REWARDS: [list(t.turn_rewards) for t in trajs],
            META_TURN_ENDS: [list(t.turn_ends) for t in trajs], META_TRACE: [t.trace for t in trajs]}


# cfg: Any, not a Protocol: the run config, or a worker's copy of some of its sections, whose ``sandbox`` section
# it reads with DictConfig's get (absent: none); agent/ sits below the config, so it names no schema class
def agent_rollout(cfg: Any, tokenizer: Any) -> Optional[AgentRollout]:
    """The run's AgentRollout when ``rollout.multi_turn.enable``, else None."""
    multi_turn = cfg.rollout.multi_turn
    if not bool(multi_turn.enable):
        return None
    return AgentRollout(multi_turn, int(cfg.data.max_response_length), tokenizer, cfg.get("sandbox"))


class _ToolSettings(Protocol):
    @property
    def enable(self) -> bool: ...

    @property
    def tool_config_path(self) -> Optional[str]: ...


class _MultiTurn(Protocol):
    @property
    def multi_turn(self) -> _ToolSettings: ...


class ToolsRun(Protocol):
    """What :func:`prompt_tools` reads of a run config: ``rollout.multi_turn`` (portrl.config.schema.PortRLConfig is
    one; agent/ sits below the config, so it names no schema class)."""

    @property
    def rollout(self) -> _MultiTurn: ...


def prompt_tools(cfg: ToolsRun) -> Optional[List[Dict[str, Any]]]:
    """The function schemas a multi-turn run's prompts list (None: not multi-turn, or no tools)."""
    multi_turn = cfg.rollout.multi_turn
    if not bool(multi_turn.enable) or not multi_turn.tool_config_path:
        return None
    return tool_schemas(load_tool_config(str(multi_turn.tool_config_path), open_files=False))
