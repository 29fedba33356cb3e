"""One agent trajectory and the rollout-Batch meta keys it fills.

A trajectory is ``prompt_ids`` followed by ``response_ids``: the model's turns and, between them, the tokens the
chat template adds for tool (or environment) messages. ``response_mask[t]`` is 1 on a model token and 0 on a tool
or environment token; ``logprobs[t]`` is the engine's log-prob of a model token (0.0 on the others; the log-prob
convention of portrl/rollout/types.py). ``turn_ends`` are the response positions of the last token of each model
turn, and ``turn_rewards`` the reward each turn's tool calls or environment reply gave (0.0 when none did), one per
model turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

# meta keys of a multi-turn rollout Batch (one entry per row); portrl/trainer reads them for metrics and traces
META_NUM_TURNS = "num_turns"  # int: model turns of the trajectory
META_TOOL_CALLS = "tool_calls"  # int: tool calls the model made
META_TOOL_ERRORS = "tool_errors"  # int: of those, the calls that failed (unknown tool, bad arguments, raised, timeout)
META_TURN_REWARDS = "turn_rewards"  # list[float]: one per model turn
META_TURN_ENDS = "turn_ends"  # list[int]: response position of each model turn's last token
META_TRACE = "trace"  # list[dict]: the decoded conversation, {"role", "content"} (+ "tool_calls" / "name")


@dataclass
class Trajectory:
    """What the agent loop returns for one row (module docstring)."""

    prompt_ids: List[int]
    response_ids: List[int] = field(default_factory=list)
    response_mask: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    turn_ends: List[int] = field(default_factory=list)
    turn_rewards: List[float] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: str = "stop"  # stop | length (the response-token budget ran out) | abort
    trace: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        return len(self.turn_ends)

    def add_model_tokens(self, ids: List[int], logprobs: List[float]) -> None:
        """Append a model turn's tokens (mask 1) and close the turn (an empty turn, an engine interrupted before its
        first token, is not a turn)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} model tokens but {len(logprobs)} log-probs")
        if not ids:
            return
        self.response_ids += ids
        self.response_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.turn_ends.append(len(self.response_ids) - 1)
        self.turn_rewards.append(0.0)

    def add_context_tokens(self, ids: List[int]) -> None:
        """Append tool or environment tokens (mask 0: context the model reads, never trains on)."""
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def check(self) -> None:
        n = len(self.response_ids)
        if not (len(self.response_mask) == len(self.logprobs) == n):
            raise ValueError(f"trajectory: {n} response ids, {len(self.response_mask)} mask entries, "
                             f"{len(self.logprobs)} log-probs")
        if len(self.turn_rewards) != len(self.turn_ends):
            raise ValueError(f"trajectory: {len(self.turn_ends)} turns but {len(self.turn_rewards)} turn rewards")
