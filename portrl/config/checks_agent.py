"""Checks of multi-turn agentic rollouts (``rollout.multi_turn``; portrl/agent/), before any model loads.

* ranges: ``max_assistant_turns`` null or >= 1, ``max_parallel_calls`` >= 1, ``max_tool_response_length`` >= 1,
  ``tool_timeout_s`` > 0; ``tool_response_truncate_side`` and ``tokenization_sanity_check_mode`` among their values;
* with ``enable``: ``format`` names a tool-call parser (portrl/agent/parsers.py), and ``tool_config_path`` (when set)
  is a tool config that loads: the file exists, its schemas are well formed, its tools import
  (portrl/agent/tools/config.py says what is wrong in one line); so is ``interaction_config_path``
  (portrl/agent/interactions.py). Files a tool reads (a search corpus) are data: like ``data.train_files`` they are
  checked when the run is (portrl/trainer/preflight.py), not when a config composes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from portrl.agent.interactions import load_interaction_config
from portrl.agent.parsers import get_parser
from portrl.agent.tools.config import load_tool_config
from portrl.config.schema_agent import SANITY_CHECK_MODES, TRUNCATE_SIDES
from portrl.errors import UserError

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig


def check_multi_turn(cfg: PortRLConfig) -> List[str]:
    """Every problem of ``cfg.rollout.multi_turn``, one line each."""
    m = cfg.rollout.multi_turn
    problems: List[str] = []
    if m.max_assistant_turns is not None and int(m.max_assistant_turns) < 1:
        problems.append(f"rollout.multi_turn.max_assistant_turns={m.max_assistant_turns} must be >= 1 (or null: "
                        "until data.max_response_length runs out)")
    if m.max_user_turns is not None and int(m.max_user_turns) < 0:
        problems.append(f"rollout.multi_turn.max_user_turns={m.max_user_turns} must be >= 0 (or null: no bound)")
    for key in ("max_parallel_calls", "max_tool_response_length"):
        if int(getattr(m, key)) < 1:
            problems.append(f"rollout.multi_turn.{key}={getattr(m, key)} must be >= 1")
    if not float(m.tool_timeout_s) > 0:
        problems.append(f"rollout.multi_turn.tool_timeout_s={m.tool_timeout_s} must be > 0 (seconds)")
    for key, valid in (("tool_response_truncate_side", TRUNCATE_SIDES),
                       ("tokenization_sanity_check_mode", SANITY_CHECK_MODES)):
        if getattr(m, key) not in valid:
            problems.append(f"rollout.multi_turn.{key}={getattr(m, key)!r} is not one of {', '.join(map(repr, valid))}")
    if not bool(m.enable):
        return problems
    try:
        get_parser(str(m.format))
    except UserError as exc:
        problems.append(str(exc))
    for path, load in ((m.tool_config_path, lambda p: load_tool_config(p, open_files=False)),
                       (m.interaction_config_path, load_interaction_config)):
        if path:
            try:
                load(str(path))
            except UserError as exc:
                problems.append(str(exc))
    return problems
