"""What the run is doing now, shown while a step or a validation runs, not only when a step ends.

A step on the CPU can take minutes (a 0.5B model generating 1024 tokens for a few hundred sequences), and the
console's progress bar moves only when a step is logged. So the trainer's phases are announced here:
:class:`portrl.trainer.metrics.Timer` opens one :func:`activity` per timed phase (``step``, ``gen``, ``reward``,
``old_log_prob``, ``ref``, ``adv``, ``update_actor``, ``sync``, ...) and validation opens ``validation``;
:class:`Heartbeat` (started by :class:`portrl.trainer.tracking.Tracker` for the ``console`` logger) shows
:func:`describe` every few seconds while one is open: in the bar's description (``train [step 2 > gen 42s]``), or
as a log line every ``LOG_EVERY_S`` seconds without a bar. The decode loops (portrl/rollout/) :func:`note` the
token they reached (``gen token 48/128 42s``). Only the trainer's process: a phase that runs inside a
Ray worker is shown as the trainer's phase that waits for it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

BAR_EVERY_S = 5.0  # the bar's description follows the phase this often
LOG_EVERY_S = 30.0  # without a bar: a log line this often while a phase runs

_lock = threading.Lock()
_open: List[list] = []  # [name, start (monotonic), detail], outermost first


@contextmanager
def activity(name: str) -> Iterator[list]:
    """Mark ``name`` as running for the block (phases nest). Yields its entry: ``entry[2]`` may hold a detail
    (``"chunk 2/5"``) shown after the name."""
    entry = [name, time.monotonic(), ""]
    with _lock:
        _open.append(entry)
    try:
        yield entry
    finally:
        with _lock:
            for i in range(len(_open) - 1, -1, -1):  # by identity: another thread may have opened one since
                if _open[i] is entry:
                    del _open[i]
                    break


def note(detail: str) -> None:
    """Set the detail of the innermost open phase (``"token 300/1024"``): for code that runs inside a phase and
    knows how far it got (a decode loop), without holding the phase's entry. Nothing when no phase is open."""
    with _lock:
        if _open:
            _open[-1][2] = detail


def _seconds(s: float) -> str:
    s = int(s)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s"


def describe(step: Optional[int] = None, now: Optional[float] = None) -> str:
    """The open phases, outermost first, with the innermost's time so far and the outermost's when they differ
    (``step 2 > gen 42s (step 1m15s)``); ``step`` numbers a ``step`` phase; "" when none is open."""
    now = time.monotonic() if now is None else now
    with _lock:
        entries = [list(e) for e in _open]
    if not entries:
        return ""
    names = []
    for name, _, detail in entries:
        label = f"{name} {step}" if name == "step" and step is not None else name
        names.append(f"{label} {detail}".strip())
    text = f"{' > '.join(names)} {_seconds(now - entries[-1][1])}"
    if len(entries) > 1:
        text += f" ({entries[0][0]} {_seconds(now - entries[0][1])})"
    return text


class Heartbeat:
    """A daemon thread calling ``show(describe(step()))`` every ``every_s`` seconds while a phase is open
    (``step``: the number of the step that runs, for its label). :meth:`stop` ends it."""

    def __init__(self, show: Callable[[str], None], step: Callable[[], Optional[int]], every_s: float) -> None:
        self._show, self._step, self._every = show, step, float(every_s)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="portrl-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._every):
            text = describe(self._step())
            if text:
                try:
                    self._show(text)
                except Exception:  # noqa: BLE001 - a console that cannot be written must not end the run
                    return

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
