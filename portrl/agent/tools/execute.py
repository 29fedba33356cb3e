"""Running the tool calls of one model turn: :func:`run_calls` (:func:`run_calls_many`: of many trajectories at
once); the row's kwargs per tool (:func:`merge_tools_kwargs`); cutting a long tool output (:func:`truncate_text`).

Every failure becomes a :class:`ToolResult` with ``error=True`` whose text tells the model what went wrong (and
the run goes on): a call the parser could not read, an unknown tool (the message lists the valid names),
arguments that do not fit the tool's schema (portrl.agent.tools.schema.argument_problem), an exception in the
tool (its type and message, no traceback), a call still running after ``timeout_s``, and a call past
``max_parallel``. Except :class:`portrl.agent.tools.base.ToolUnusable` (the tool's environment broke: the python
tool's sandbox cannot start programs any more): it is raised again from :func:`run_calls_many`, so that the run
stops with its reason instead of going on training on error messages.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from portrl.agent.tools.base import Tool, ToolResult, ToolUnusable
from portrl.agent.tools.schema import argument_problem
from portrl.errors import DataError

TRUNCATION_MARKERS = {"left": "...(truncated)", "right": "(truncated)...", "middle": "...(truncated)..."}


def _error(text: str) -> ToolResult:
    return ToolResult(text="Error: " + " ".join(text.split()), error=True)


def run_calls(tools: Mapping[str, Tool], calls: Sequence[Any], row_kwargs: Optional[Mapping[str, Dict]] = None,
              timeout_s: Optional[float] = 10.0, max_parallel: int = 1) -> List[ToolResult]:
    """One :class:`ToolResult` per call of ``calls`` (one model turn's), in order.

    ``calls``: objects with ``.name``, ``.arguments`` (a dict, or None: no arguments) and ``.error`` (a message
    when the parser could not read the call, else None). ``row_kwargs``: {tool name: kwargs the row gives it}
    (:func:`merge_tools_kwargs`). The first ``max_parallel`` calls run, concurrently, each in a thread of its own;
    the later ones are not run and get an error saying the limit (as verl, which drops them).

    ``timeout_s`` (None or <= 0: no limit) bounds each call's wall time; the calls start together, so it bounds
    the turn's too. A Python thread cannot be killed: a call past the limit gets a timeout error, but its daemon
    thread runs on until the function returns (its result is dropped), holding what it holds; a tool that can
    hang must bound itself (the python tool's sandbox kills its program at its own limit).
    """
    return run_calls_many(tools, [calls], [row_kwargs or {}], timeout_s, max_parallel)[0]


def run_calls_many(tools: Mapping[str, Tool], calls_per_row: Sequence[Sequence[Any]],
                   row_kwargs_per_row: Sequence[Optional[Mapping[str, Dict]]], timeout_s: Optional[float] = 10.0,
                   max_parallel: int = 1) -> List[List[ToolResult]]:
    """:func:`run_calls` for the current turn of many trajectories at once (all their calls start together):
    ``calls_per_row[r]`` with ``row_kwargs_per_row[r]``; ``max_parallel`` counts per row. A call that raised
    :class:`ToolUnusable` raises it here (the first one, once the calls before it in order are done)."""
    if len(calls_per_row) != len(row_kwargs_per_row):
        raise ValueError(f"{len(calls_per_row)} rows of calls but {len(row_kwargs_per_row)} rows of kwargs")
    results: List[List[Optional[ToolResult]]] = [[None] * len(calls) for calls in calls_per_row]
    running = []
    for r, (calls, row_kwargs) in enumerate(zip(calls_per_row, row_kwargs_per_row)):
        for i, call in enumerate(calls):
            if i >= max(1, int(max_parallel)):
                results[r][i] = _error(f"at most {max_parallel} tool call(s) run per turn; call {i + 1} "
                                       f"({getattr(call, 'name', None)!r}) was not run")
                continue
            problem = _call_problem(tools, call)
            if problem is not None:
                results[r][i] = _error(problem)
                continue
            kwargs = dict((row_kwargs or {}).get(call.name) or {})
            running.append((r, i, call.name, _start(tools[call.name], dict(call.arguments or {}), kwargs)))
    deadline = time.monotonic() + timeout_s if timeout_s and timeout_s > 0 else None
    for r, i, name, (thread, box) in running:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            results[r][i] = _error(f"tool {name!r} timed out after {timeout_s:g} s")
        elif "error" in box:
            exc = box["error"]
            if isinstance(exc, ToolUnusable):  # not the call's fault: no call of this tool can work any more
                raise exc
            results[r][i] = _error(f"tool {name!r} raised {type(exc).__name__}: {exc}")
        else:
            results[r][i] = _as_result(name, box.get("value"))
    return [[x if x is not None else _error("the call was not run") for x in row] for row in results]


def _call_problem(tools: Mapping[str, Tool], call: Any) -> Optional[str]:
    """Why ``call`` cannot run (in words for the model), or None."""
    if getattr(call, "error", None):
        return f"the tool call could not be read: {call.error}"
    name = getattr(call, "name", None)
    if not isinstance(name, str) or name not in tools:
        return f"unknown tool {name!r}; valid tools: {', '.join(sorted(tools)) or 'none'}"
    problem = argument_problem(tools[name].schema, call.arguments if call.arguments is not None else {})
    return f"tool {name!r}: {problem}" if problem else None


def _start(tool: Tool, arguments: Dict[str, Any], kwargs: Dict[str, Any]):
    box: Dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = tool.call(arguments, kwargs)
        except BaseException as exc:  # SystemExit from a tool too: the run goes on (ToolUnusable: it stops)
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"portrl-tool-{tool.name}", daemon=True)
    thread.start()
    return thread, box


def _as_result(name: str, value: Any) -> ToolResult:
    if isinstance(value, str):
        return ToolResult(text=value)
    if isinstance(value, ToolResult) and isinstance(value.text, str):
        return value
    return _error(f"tool {name!r} returned a {type(value).__name__}, not a str or ToolResult")


def merge_tools_kwargs(tools_kwargs: Any, where: str = "a row") -> Dict[str, Dict[str, Any]]:
    """{tool name: kwargs} from verl's ``extra_info.tools_kwargs`` ({name: {"create_kwargs": {...},
    "execute_kwargs": {...}, ...}}): ``create_kwargs`` updated by ``execute_kwargs`` (the other verl keys,
    ``calc_reward_kwargs`` and ``release_kwargs``, are not used). None (or a missing part): {}. A value of the
    wrong shape: :class:`DataError` naming ``where`` (the row)."""
    if tools_kwargs is None:
        return {}
    if not isinstance(tools_kwargs, Mapping):
        raise DataError(f"{where}: extra_info.tools_kwargs is a {type(tools_kwargs).__name__}; valid: a mapping "
                        "{tool name: {create_kwargs: {...}, execute_kwargs: {...}}}")
    out: Dict[str, Dict[str, Any]] = {}
    for name, entry in tools_kwargs.items():
        if entry is not None and not isinstance(entry, Mapping):
            raise DataError(f"{where}: extra_info.tools_kwargs.{name} is a {type(entry).__name__}; valid: a "
                            "mapping with create_kwargs and/or execute_kwargs")
        merged: Dict[str, Any] = {}
        for part in ("create_kwargs", "execute_kwargs"):
            value = (entry or {}).get(part)
            if value is not None and not isinstance(value, Mapping):
                raise DataError(f"{where}: extra_info.tools_kwargs.{name}.{part} is a {type(value).__name__}, "
                                "not a mapping")
            merged.update(value or {})
        out[str(name)] = merged
    return out


def truncate_text(text: str, max_chars: int, side: str = "middle") -> str:
    """``text`` cut to ``max_chars`` characters plus a marker, as verl's tool agent loop does (same names, same
    output): ``left`` keeps the first ``max_chars`` ("...(truncated)" after them), ``right`` the last ones
    ("(truncated)..." before them), ``middle`` half of each end ("...(truncated)..." between). Text no longer
    than ``max_chars`` is returned as is. ValueError for another side."""
    if side not in TRUNCATION_MARKERS:
        raise ValueError(f"truncation side {side!r}; valid: {', '.join(TRUNCATION_MARKERS)}")
    if len(text) <= max_chars:
        return text
    if side == "left":
        return text[:max_chars] + TRUNCATION_MARKERS["left"]
    if side == "right":
        return TRUNCATION_MARKERS["right"] + (text[-max_chars:] if max_chars > 0 else "")
    half = max_chars // 2
    return text[:half] + TRUNCATION_MARKERS["middle"] + (text[-half:] if half > 0 else "")
