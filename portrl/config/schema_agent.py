"""The settings of multi-turn agentic rollouts, ``rollout.multi_turn`` (verl's names; part of the structured config
of portrl/config/schema.py). What each setting does: portrl/agent/loop.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TRUNCATE_SIDES = ("left", "right", "middle")  # rollout.multi_turn.tool_response_truncate_side
SANITY_CHECK_MODES = ("disable", "strict")  # rollout.multi_turn.tokenization_sanity_check_mode


@dataclass
class MultiTurnConfig:
    """A trajectory alternates model turns and tool turns until the model answers without a tool call, a limit is
    reached, or the response-token budget ``data.max_response_length`` (the whole trajectory's) runs out."""

    enable: bool = False  # rows run the agent loop their ``agent_name`` column names (default tool_agent)
    format: str = "hermes"  # the tool-call parser (portrl/agent/parsers.py)
    tool_config_path: Optional[str] = None  # YAML of the tools (verl's tool_config); None: no tools
    max_assistant_turns: Optional[int] = None  # None: until the budget runs out
    max_parallel_calls: int = 1  # tool calls of one model turn that run; the rest get an error message
    max_tool_response_length: int = 256  # characters of a tool's output the model reads
    tool_response_truncate_side: str = "middle"  # keep of a long output: left (its start) | right (its end) | middle (both ends)
    tool_timeout_s: float = 10.0  # wall-time limit of one tool call
    # strict: after every tool turn, compare the running ids with the chat template's tokenization of the whole
    # conversation and stop with an error on a mismatch (slower; for checking a new model's template)
    tokenization_sanity_check_mode: str = "disable"
    # environment turns: verl's interaction config (portrl/agent/interactions.py); a row's
    # extra_info.interaction_kwargs.name picks one; max_user_turns bounds its replies (None: no bound)
    interaction_config_path: Optional[str] = None
    max_user_turns: Optional[int] = None
    place_turn_rewards: bool = False  # a turn's reward (tool or environment) as a token reward at the turn's end
