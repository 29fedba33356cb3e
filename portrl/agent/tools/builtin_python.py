"""The built-in ``python`` tool: runs the model's code in the project's code sandbox (portrl.rewards.sandbox:
its own file system, no network, limits) and gives back what it printed.

Config (``{name: python, config: {...}}``): ``timeout_s`` (5), ``memory_mb`` (512), ``max_concurrent`` (the CPU
count: programs of this tool running at once, over all trajectories; a call waits for a free slot, and the wait
counts in the agent loop's per-call timeout). Each call is a fresh program (no state is kept between calls); a
``` fence around the code is removed.

The run's ``sandbox`` settings apply (:meth:`PythonTool.configure_sandbox`, called when the run builds its tools):
``sandbox.packages``, what a program may import besides the standard library, and ``sandbox.allow_unisolated``.

What the model reads: the program's stdout; when it failed, then the end of its stderr (the traceback, with the
sandbox's temporary path shortened to ``main.py``); when it printed nothing, :data:`NO_OUTPUT`.
``error=True`` (counted as a tool error) only when the sandbox stopped the program at a limit (time, memory,
output size). A program that raises or does not compile is a normal result (``error=False``): its traceback is
the feedback the model learns from, as in ReTool. When the sandbox itself cannot start a program (a
:class:`~portrl.rewards.sandbox.SandboxError`: it cannot build the program's root, the platform refuses its
isolation), no call can work: the call raises :class:`~portrl.agent.tools.base.ToolUnusable`, which the agent loop
passes on, and the run stops with that reason (one line) instead of training on error messages.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import replace
from typing import Any, Dict, Sequence

from portrl.agent.tools.base import Tool, ToolResult, ToolUnusable
from portrl.rewards.sandbox import SandboxError, SandboxLimits, run_program

NO_OUTPUT = "(no output: print() the values you want to see)"
_LIMIT_MESSAGES = {"timeout": "the program ran past the time limit of {timeout_s:g} s",
                   "memory": "the program ran out of memory (limit {memory_mb} MB)",
                   "output_limit": "the program printed more than the output limit"}
_SANDBOX_PATH = re.compile(r'"[^"\n]*portrl-sandbox-[^"\n/]*/main\.py"')
_FENCE = re.compile(r"^\s*```[A-Za-z0-9_+-]*\s*\n(.*?)\n?```\s*$", re.DOTALL)


class PythonTool(Tool):
    """``python(code)``: run ``code`` in the sandbox (module docstring)."""

    name = "python"
    uses_sandbox = True

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_concurrent: "int | None" = None) -> None:
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if not isinstance(memory_mb, int) or isinstance(memory_mb, bool) or memory_mb < 32:
            raise ValueError(f"memory_mb must be an integer >= 32, got {memory_mb!r}")
        slots = max_concurrent if max_concurrent is not None else os.cpu_count() or 1
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"max_concurrent must be an integer >= 1, got {max_concurrent!r}")
        self.limits = SandboxLimits(timeout_s=float(timeout_s), memory_mb=memory_mb)
        self.max_concurrent = slots
        self.slots = threading.BoundedSemaphore(slots)
        self.schema = {"type": "function", "function": {
            "name": "python",
            "description": "Run a Python program and return what it prints (stdout; the error when it fails). "
                           "Each call starts fresh; print() the results you need.",
            "parameters": {"type": "object", "properties": {
                "code": {"type": "string", "description": "the Python program to run"}},
                "required": ["code"]}}}

    def configure_sandbox(self, allow_unisolated: bool, packages: Sequence[str]) -> None:
        """The run's ``sandbox.allow_unisolated`` and ``sandbox.packages`` (module docstring)."""
        self.limits = replace(self.limits, allow_unisolated=bool(allow_unisolated),
                              packages=tuple(str(p) for p in packages))

    def __getstate__(self) -> Dict[str, Any]:
        """Picklable (a Ray task may carry the tool): the semaphore travels as its size."""
        state = dict(self.__dict__)
        state["slots"] = self.max_concurrent
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.slots = threading.BoundedSemaphore(state["slots"])

    def call(self, arguments: Dict[str, Any], row_kwargs: Dict[str, Any]) -> ToolResult:
        code = str(arguments["code"])
        fenced = _FENCE.match(code)
        if fenced:
            code = fenced.group(1)
        try:
            with self.slots:
                result = run_program(code, "", self.limits)
        except SandboxError as exc:  # the sandbox, not the program: no call can work (module docstring)
            raise ToolUnusable(f"the python tool's sandbox cannot run programs: {exc}") from exc
        if result.status == "ok":
            return ToolResult(text=result.stdout if result.stdout.strip() else NO_OUTPUT)
        text = result.stdout if not result.stdout or result.stdout.endswith("\n") else result.stdout + "\n"
        if result.status in _LIMIT_MESSAGES:
            message = _LIMIT_MESSAGES[result.status].format(timeout_s=self.limits.timeout_s,
                                                            memory_mb=self.limits.memory_mb)
            return ToolResult(text=text + f"Error: {message}", error=True)
        stderr = _SANDBOX_PATH.sub('"main.py"', result.stderr).strip()
        return ToolResult(text=text + (stderr or f"(the program stopped with exit code {result.returncode})"))
