"""The tool contract: a :class:`Tool` has an OpenAI function schema and ``call(arguments, row_kwargs)``.

``arguments``: the JSON object the model wrote (already parsed, a dict); ``row_kwargs``: what the data row gives
this tool (verl's ``extra_info.tools_kwargs[<tool name>]``: its ``create_kwargs`` and ``execute_kwargs`` merged,
for example a ``ground_truth``). A call returns a :class:`ToolResult` (or a plain ``str``, taken as its text).
The agent loop turns a call that raises, times out, names an unknown tool or has bad arguments into an error
message the model reads as the tool's output (``error=True``); the run goes on. Except :class:`ToolUnusable`: a tool
that can no longer work for any call (the python tool's sandbox stopped starting programs) raises it, and the run
stops with its message instead of training on error messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple


class ToolUnusable(RuntimeError):
    """A tool's environment broke, so that no call of it can work any more (not the call's fault: the python tool's
    sandbox cannot start programs). The agent loop passes it on instead of making it a message for the model, and
    the run stops with it (one line, portrl.trainer.run_end). The message says what broke and why."""


@dataclass
class ToolResult:
    """What a tool call gives back: ``text`` for the model, an optional per-turn ``reward``, ``error`` when the call
    failed (counted in the tool error rate)."""

    text: str
    reward: Optional[float] = None
    error: bool = False


class Tool:
    """Base class of tools. ``name`` and ``schema`` (``{"type": "function", "function": {"name", "description",
    "parameters"}}``) are set by the subclass or its constructor; :meth:`call` does the work."""

    name: str = ""
    schema: Dict[str, Any] = {}
    config_paths: Tuple[str, ...] = ()  # config keys that name files, relative to the tool config's folder
    uses_sandbox: bool = False  # runs programs in the code sandbox: the preflight starts one there first

    def call(self, arguments: Dict[str, Any], row_kwargs: Dict[str, Any]) -> "ToolResult | str":
        raise NotImplementedError(f"tool {self.name!r} does not implement call")

    def configure_sandbox(self, allow_unisolated: bool, packages: Sequence[str]) -> None:
        """The run's ``sandbox`` settings (``allow_unisolated``, ``packages``), given to every tool when the run
        builds its tools (portrl.agent.rollout.AgentRollout); a tool that runs programs in the code sandbox applies
        them, the others ignore them."""

    def close(self) -> None:
        """Release what the tool holds (a sandbox, an index); called once when the rollout worker ends."""
