"""Metrics of multi-turn agentic rollouts, from the meta keys a multi-turn rollout Batch carries per row
(portrl/agent/trajectory.py ``META_*``).

``agent_metrics(batch)``, logged every step (the training batch) and, prefixed ``val/``, by validation:

* ``agent/num_turns/{mean,max,min}``: model turns per trajectory;
* ``agent/tool_calls/mean``: tool calls per trajectory;
* ``agent/tool_call_rate``: the share of trajectories with at least one tool call;
* ``agent/tool_error_rate``: failed calls (unknown tool, bad arguments, raised, timed out) / calls; 0.0 when no
  call was made;
* ``agent/turn_reward/mean``: the mean reward of a model turn, over every turn of the batch (0.0 when no
  trajectory has a turn).

A single-turn batch (no ``num_turns`` meta) gives ``{}``: its runs log exactly what they logged before.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Union

from portrl.agent.trajectory import META_NUM_TURNS, META_TOOL_CALLS, META_TOOL_ERRORS, META_TURN_REWARDS
from portrl.workers.batch import Batch


def _column(batches: Sequence[Batch], key: str, default: Any) -> List[Any]:
    """The meta column ``key`` of every batch, in order; ``default`` for each row of a batch without it."""
    out: List[Any] = []
    for b in batches:
        out += list(b.meta[key]) if key in b.meta else [default] * len(b)
    return out


def agent_metrics(batch: Union[Batch, Sequence[Batch]], prefix: str = "") -> Dict[str, float]:
    """The ``<prefix>agent/*`` metrics (module docstring) of ``batch`` or of several batches together (validation's
    chunks); ``{}`` when no row carries ``num_turns`` (a single-turn rollout) or there are no rows. A missing
    ``tool_calls`` / ``tool_errors`` / ``turn_rewards`` column counts as 0 calls, 0 errors, no turn rewards."""
    batches = [batch] if isinstance(batch, Batch) else list(batch)
    batches = [b for b in batches if META_NUM_TURNS in b.meta and len(b) > 0]
    if not batches:
        return {}
    turns = [int(x) for x in _column(batches, META_NUM_TURNS, 0)]
    calls = [int(x) for x in _column(batches, META_TOOL_CALLS, 0)]
    errors = [int(x) for x in _column(batches, META_TOOL_ERRORS, 0)]
    rewards = [float(r) for row in _column(batches, META_TURN_REWARDS, []) for r in (row or [])]
    n = len(turns)
    p = prefix + "agent/"
    return {
        p + "num_turns/mean": sum(turns) / n,
        p + "num_turns/max": float(max(turns)),
        p + "num_turns/min": float(min(turns)),
        p + "tool_calls/mean": sum(calls) / n,
        p + "tool_call_rate": sum(1 for c in calls if c > 0) / n,
        p + "tool_error_rate": sum(errors) / sum(calls) if sum(calls) > 0 else 0.0,
        p + "turn_reward/mean": sum(rewards) / len(rewards) if rewards else 0.0,
    }
