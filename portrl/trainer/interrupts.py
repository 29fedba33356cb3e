"""SIGINT and SIGTERM during a run: finish the step, save, stop with one line (issue 16, item 6).

:func:`stop_signals` installs handlers for SIGINT and SIGTERM for the duration of a ``with`` block (the whole
of ``run_training``, the start of Ray and the workers included) and restores the previous ones after it:

* While the run starts (:attr:`StopSignals.at_once`: Ray and the workers starting, a checkpoint loading, the
  SFT warm start, value pretraining) there is nothing to finish, so the first signal already stops at once, as
  a second one does later (below), with the line ``stopped by SIGINT before step 1 of N; no checkpoint was
  written ...``, whatever start-up wait the driver is in. It is not raised as an exception: raised from the
  handler inside Ray's waits it comes out as a SystemError.
* From validation before training on, the first signal only sets a flag (:attr:`StopSignals.requested`) and
  prints one line on stderr saying so. The trainer checks the flag between steps: the running step finishes, a
  checkpoint is written when one is due or ``trainer.save_on_interrupt`` asks for it, the workers are shut down
  and the run raises :class:`portrl.errors.RunStopped` (exit code ``128 + signal``: 130 for SIGINT, 143 for
  SIGTERM) whose message says where to resume from. A step that cannot finish is abandoned: a worker that stops
  answering is ended by the time limit below; Ray's own processes gone (a SIGTERM sent to the whole process
  group, as systemd and Slurm do, reaches them too) are noticed between 1 s waits (or, when Ray's client blocks,
  Ray ends the driver after 60 s without its GCS). The run then stops the same way, naming the last checkpoint.
* A second signal stops at once: one line on stderr (from :attr:`StopSignals.abort_message`), the
  :attr:`StopSignals.on_abort` hooks (the trainer's stops a local Ray), and ``os._exit(128 + signal)``:
  no traceback, no ``finally`` blocks. What was finished is safe: every metrics line is flushed when
  written and checkpoints are renamed into place only once complete.

Handlers can only be installed from the main thread; elsewhere the block runs without them. Ray workers
need nothing: Ray starts them in process groups of their own with SIGINT blocked, so a Ctrl-C in the
terminal reaches only the driver, which decides. ``ray.init`` installs its own SIGTERM handler
(``sys.exit``) in the driver; ``init_ray`` puts ours back. A driver that cannot act on a signal (``kill -9``
of the driver alone) still takes its local Ray with it: the watchdog of portrl.workers.ray_watchdog ends
every process of that Ray within seconds.

Hangs: :func:`worker_timeout` is the time limit on each call to Ray workers during RL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Callable, Iterator, Optional

from portrl.errors import UserError

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_active: Optional["StopSignals"] = None


def exit_code(signum: int) -> int:
    """The shell's exit status for a process ended by ``signum`` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _say(line: str) -> None:
    """One line on stderr, written with os.write: safe inside a signal handler (print may re-enter a
    buffered stream the interrupted code was writing to, and raise)."""
    try:
        os.write(2, (line.rstrip("\n") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


class StopSignals:
    """The state of one run's signal handling (see the module docstring).

    ``notice``: what the first signal prints (called with the signal's name). ``abort_message``: the line a
    second signal prints before the process ends (set by the trainer; it says where to resume from).
    """

    def __init__(self, notice: Optional[Callable[[str], str]] = None):
        self.signum: Optional[int] = None
        self.notice = notice or (lambda name: f"portrl: {name} received: stopping before the next step "
                                              f"(send it again to stop at once)")
        self.abort_message: Callable[[str], str] = lambda name: f"portrl: stopped at once by a second {name}"
        self.on_abort: list = []  # callables run (quickly, errors ignored) before the process ends at once
        self.at_once = False  # the first signal already stops at once (while the run starts: module docstring)
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        """A stop was asked for (the first signal arrived)."""
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal_name(self.signum) if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum) if self.signum is not None else 1

    def _handle(self, signum: int, frame) -> None:  # noqa: ARG002 - the signal module's signature
        if self.signum is None:
            self.signum = signum
            if not self.at_once:
                _say(self.notice(signal_name(signum)))
                return
        try:
            line = self.abort_message(signal_name(signum))
        except Exception:  # noqa: BLE001 - the process must end whatever the message does
            line = f"portrl: stopped at once by a second {signal_name(signum)}"
        _say(line)
        for hook in self.on_abort:
            try:
                hook()
            except Exception:  # noqa: BLE001
                pass
        os._exit(exit_code(signum))

    def install(self) -> bool:
        """Install the handlers (again: ``ray.init`` replaces SIGTERM's). False off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for s in SIGNALS:
            current = signal.getsignal(s)
            if current != self._handle:
                self._previous.setdefault(s, current)
                signal.signal(s, self._handle)
        return True

    def restore(self) -> None:
        """Put back the handlers found by the first :meth:`install`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}


@contextlib.contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """SIGINT / SIGTERM handling for the block (module docstring). Nested blocks share the outer block's
    :class:`StopSignals` (re-installing its handlers); the outermost one restores the previous handlers."""
    global _active
    if _active is not None:
        _active.install()
        yield _active
        return
    stop = StopSignals()
    _active = stop
    try:
        stop.install()
        yield stop
    finally:
        _active = None
        stop.restore()


# --------------------------------------------------------------------------------------------- hangs
STEP_FACTOR = 5.0  # a call may take this many times the slowest RL step seen so far
FIRST_STEP_FACTOR = 3.0  # before any step is measured (warm-up, compilation): this many times the base limit


def worker_timeout(base_s: Optional[float], slowest_step_s: Optional[float]) -> Optional[float]:
    """The time limit on one call to the workers during RL, in seconds (None = wait forever).

    ``base_s`` is ``trainer.worker_timeout_s`` (None or 0: no limit). Before the first step is measured the
    limit is ``FIRST_STEP_FACTOR x base_s``; after it, ``max(base_s, STEP_FACTOR x the slowest step so far)``,
    so runs whose steps take minutes are not cut short while a frozen worker in a fast run is found quickly.
    """
    if base_s is None:
        return None
    base = float(base_s)
    if base < 0:
        raise UserError(f"trainer.worker_timeout_s={base_s} is negative; give seconds > 0 (0 or null: no limit)")
    if base == 0:
        return None
    if slowest_step_s is None:
        return FIRST_STEP_FACTOR * base
    return max(base, STEP_FACTOR * float(slowest_step_s))


def stopped_message(signal_name: str, step: int, total: int, resume: str, checkpoint: Optional[Path],
                    at_once: bool = False, abandoned: str = "") -> str:
    """One line: what stopped the run (a signal after ``step`` of ``total``; a second signal mid-step, ``at_once``;
    a step that could not finish, ``abandoned`` = why), and how to resume from ``checkpoint`` given
    ``trainer.resume`` (``resume``)."""
    if abandoned:
        what = f"stopped by {signal_name} during step {step + 1} of {total}, which could not finish ({abandoned})"
    elif at_once:
        what = f"stopped at once by a second {signal_name} during step {step + 1} of {total}"
    else:
        when = f"after step {step}" if step else "before step 1"
        what = f"stopped by {signal_name} {when} of {total}"
    if checkpoint is None:
        return f"{what}; no checkpoint was written: rerun the same command to start again"
    how = ("rerun the same command (trainer.resume=auto)" if resume == "auto"
           else "rerun the same command with trainer.resume=auto")
    return f"{what}; to resume from the checkpoint {checkpoint}, {how}"
