"""The start-up check of the code sandbox (portrl/rewards/sandbox.py), and the note a run without its isolation logs.

A run needs the local sandbox when

* its rows (``data.train_files``, ``data.val_files``) have a data_source the code reward scores
  (``portrl.rewards.code.CODE_SOURCES``) and the rule rewards score them (no ``reward.custom.path``, no
  ``reward.model_path``), unless ``reward.code.sandbox_fusion_url`` sends every case to a SandboxFusion service; or
* its multi-turn rollouts have a tool that runs programs in the sandbox (``Tool.uses_sandbox``: the built-in
  ``python`` tool).

Then, before any model loads, :func:`check_sandbox` (called by the preflight, portrl/trainer/preflight.py):

1. checks that every ``sandbox.packages`` entry is installed in the run's interpreter (a UserError naming the
   missing ones);
2. runs one one-line program through the sandbox, with the run's settings (``sandbox.allow_unisolated``,
   ``sandbox.packages``), once per check (about 0.1 s). A sandbox that cannot start a program
   (:class:`~portrl.rewards.sandbox.SandboxError`: its root cannot be built, the interpreter's folder cannot be
   mounted) or a platform that refuses its isolation without ``sandbox.allow_unisolated=true``
   (:class:`~portrl.rewards.sandbox.SandboxUnisolated`) is a UserError: one line saying why and how to fix it,
   exit code 2. So is a program that does not print what it should;
3. with ``sandbox.allow_unisolated=true`` on a platform that refuses parts of the isolation, the run goes on: the
   parts missing are logged once here, and :func:`unisolated_note` gives the text every validation line carries
   (portrl.trainer.validation).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Iterable, List, Mapping, Optional, Sequence

from portrl.errors import UserError
from portrl.rewards import sandbox
from portrl.rewards.code import CODE_SOURCES, judged_in_own_sandbox

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

log = logging.getLogger(__name__)

#: the program of the start-up check and what it prints
PROBE_SOURCE = "print('portrl sandbox ok')\n"
PROBE_OUTPUT = "portrl sandbox ok"
PROBE_TIMEOUT_S = 30.0  # generous: a loaded machine's first start; a working sandbox takes about 0.1 s
_note: Optional[str] = None  # the run's UNISOLATED note (set by the last check_sandbox of this process)


class SandboxUnusable(UserError):
    """The code sandbox cannot run the run's programs here (it cannot start one, or the platform refuses its
    isolation and ``sandbox.allow_unisolated`` is not set); the message says why and how to fix it."""


def sandbox_users(cfg: PortRLConfig, rows: Iterable[Sequence[Any]], tools: Optional[Mapping[str, Any]] = None) -> List[str]:
    """What in this run needs the local sandbox, in words (module docstring); [] when nothing does. ``rows``: the
    run's data rows (data_source second); ``tools``: the multi-turn tools (name -> Tool) the run builds."""
    users = []
    r = cfg.reward
    if not r.custom.path and not r.model_path and not r.code.sandbox_fusion_url:
        sources = sorted({str(row[1]) for row in rows if str(row[1]) in CODE_SOURCES})
        if sources:
            users.append(f"the code reward (data_source {', '.join(sources)})")
    for name, tool in (tools or {}).items():
        if getattr(tool, "uses_sandbox", False):
            users.append(f"the {name} tool (rollout.multi_turn.tool_config_path)")
    return users


def check_remote_code_rows(cfg: PortRLConfig, rows: Iterable[Sequence[Any]]) -> None:
    """With ``reward.code.sandbox_fusion_url`` (and the rule rewards scoring), a code row with assert- or
    check()-style tests is a UserError naming the row: its test is judged in a sandbox of its own beside the
    program's (portrl/rewards/code_judge.py), which a SandboxFusion service cannot run. ``rows``: (messages,
    data_source, ground truth, extra_info)."""
    r = cfg.reward
    if r.custom.path or r.model_path or not r.code.sandbox_fusion_url:
        return
    for index, row in enumerate(rows):
        if str(row[1]) in CODE_SOURCES and judged_in_own_sandbox(row[2]):
            raise UserError(f"data row {index} (data_source {row[1]}) has assert- or check()-style code tests, which "
                            "are judged in a sandbox beside the program's that a SandboxFusion service cannot run; "
                            "valid with reward.code.sandbox_fusion_url: stdin/stdout and call-based (fn_name) tests, "
                            "or drop reward.code.sandbox_fusion_url to use the local sandbox")


def check_sandbox(cfg: PortRLConfig, users: List[str]) -> None:
    """The start-up check for ``users`` (:func:`sandbox_users`; nothing to check when empty): SandboxUnusable
    (a UserError, one line) when the sandbox cannot run them here (module docstring)."""
    global _note
    _note = None
    if not users:
        return
    who = " and ".join(users)
    s = cfg.sandbox
    packages = tuple(str(p) for p in s.packages)
    try:
        _, missing = sandbox.exposed_packages(packages)
    except ValueError as exc:  # a name the config checks let through (portrl.config.checks.check_sandbox)
        raise SandboxUnusable(f"sandbox.packages: {_one_line(exc)}") from None
    if missing:
        raise SandboxUnusable(f"sandbox.packages has {', '.join(missing)}, which is not installed in this "
                              f"interpreter ({sys.prefix}) or cannot be bound into the sandbox (a namespace package "
                              f"spread over several folders); install it there, or drop it from sandbox.packages "
                              f"(needed by {who})")
    limits = sandbox.SandboxLimits(timeout_s=PROBE_TIMEOUT_S, allow_unisolated=bool(s.allow_unisolated), packages=packages)
    try:
        result = sandbox.run_program(PROBE_SOURCE, "", limits)
    except sandbox.SandboxUnisolated as exc:
        raise SandboxUnusable(f"{_one_line(exc)} (needed by {who})") from None
    except sandbox.SandboxError as exc:
        raise SandboxUnusable(f"the code sandbox cannot start a program here, and {who} needs it: {_one_line(exc)}; "
                              "fix that (docs/code-rl.md, 'The start-up check' says what each cause needs)") from None
    if result.status != "ok" or result.stdout.strip() != PROBE_OUTPUT:
        tail = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        raise SandboxUnusable(f"the code sandbox did not run the one-line start-up program here ({result.status}: "
                              f"{tail}), and {who} needs it; see docs/code-rl.md, 'The start-up check'")
    gone = result.missing
    if gone:  # only with sandbox.allow_unisolated=true: the sandbox refuses it otherwise
        why = _reason(result)
        _note = f"UNISOLATED (no {', '.join(gone)}{f': {why}' if why else ''})"
        log.warning("the code sandbox runs %s for %s: sandbox.allow_unisolated=true accepts it; programs can read "
                    "every file their uid may read (the checkout, the training data and its ground truths), reach the "
                    "network and see the machine's processes", _note, who)


def unisolated_note() -> Optional[str]:
    """``UNISOLATED (what is missing: why)`` when the run's sandbox runs without parts of its isolation (accepted by
    ``sandbox.allow_unisolated=true``), else None."""
    return _note


def _reason(result: Any) -> str:
    details = getattr(result, "details", None) or {}
    for key in ("ns_error", "root_error", "mnt_error", "seccomp_error"):
        if details.get(key):
            return " ".join(str(details[key]).split())
    return ""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


__all__ = ["PROBE_OUTPUT", "PROBE_SOURCE", "SandboxUnusable", "check_sandbox", "sandbox_users",
           "unisolated_note"]
