"""The error policy every ``portrl`` command follows.

A mistake in what the user gave (a config key or value, a CLI flag, a data file or row, a model directory, a
checkpoint, a reward file, a device) raises :class:`UserError` (or a subclass). ``portrl.cli.main`` prints
it as one line and exits 2::

    portrl <command>: error: <what is wrong>; <what is valid or how to fix it>

never with a traceback (``--debug`` or ``PORTRL_DEBUG=1`` adds it). Any other exception is an internal error
and keeps its traceback. The message names where a value came from (``--device``, ``$PORTRL_DEVICE``, a
preset, the config file, an override) when that is known.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input from the user; the message is the whole explanation (one line, no trailing period needed)."""

    exit_code = EXIT_USER_ERROR


class DataError(UserError, ValueError):
    """A dataset file or row is malformed; the message names the file, the row and the field (raised by the
    readers in ``portrl/data/`` and by rewards that parse a row's ground truth)."""


class RunStopped(Exception):
    """A run stopped on purpose before its end (SIGINT, SIGTERM): ``portrl.cli.main`` prints the message as one
    line (where to resume from) and exits ``exit_code`` (130 for SIGINT, 143 for SIGTERM), no traceback."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = int(exit_code)


class RunFailed(RunStopped):
    """A run that cannot go on for a reason outside its config (its disk is full, its folder read-only): printed
    like RunStopped, one line naming the cause and the last good checkpoint, exit code 1."""

    def __init__(self, message: str):
        super().__init__(message, 1)


def yaml_problem(exc: Exception) -> str:
    """A YAML parse error in one line: what is wrong and where (line, column)."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem
