"""A wall-clock limit on scoring one batch of rewards (``reward.timeout_s``).

Reward functions run in this process (or, for large batches, in the reward manager's pool of spawned
processes). The limit is enforced in two ways that back each other up:

* :func:`call_with_time_limit` runs the scoring in the calling thread and, when the time is up, a timer
  thread sends SIGALRM to the main thread, whose handler raises :class:`TimeLimitReached` *inside* the
  reward function. This interrupts Python code: loops, ``time.sleep``, blocking socket or file reads (the
  signal ends the system call). It cannot interrupt a C extension that holds the GIL without checking for
  signals (a huge regular-expression match, a long native computation): the exception comes when it returns
  to Python. ``TimeLimitReached`` is a BaseException, so ``except Exception`` in the function does not
  swallow it. Off the main thread (where Python cannot handle signals) there is no interruption.
* The scoring loop checks the deadline before each row (:func:`check_deadline`), which also covers a
  function that caught the exception, or a signal taken by a handler of its own (math-verify uses SIGALRM
  for its own timeouts).

In the process pool the manager waits on its futures with the deadline and terminates the pool's
processes when it passes: that interrupts anything.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


class TimeLimitReached(BaseException):
    """Raised inside the scoring code when its time is up (a BaseException: ``except Exception`` lets it pass)."""


def check_deadline(deadline: Optional[float]) -> None:
    """Raise TimeLimitReached when ``time.monotonic()`` has passed ``deadline`` (None: never)."""
    if deadline is not None and time.monotonic() >= deadline:
        raise TimeLimitReached()


def call_with_time_limit(fn: Callable[[], T], timeout_s: Optional[float]) -> T:
    """``fn()``, interrupted with TimeLimitReached after ``timeout_s`` seconds (module docstring for what can
    and cannot be interrupted). ``timeout_s`` None: no limit."""
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        return fn()
    lock = threading.Lock()
    armed = [True]
    main = threading.get_ident()  # this is the main thread (checked above)

    def on_alarm(signum, frame):  # noqa: ARG001
        if armed[0]:
            raise TimeLimitReached()

    def fire():
        with lock:  # never signals once disarmed: SIGALRM's default action would end the process
            if armed[0]:
                signal.pthread_kill(main, signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    timer = threading.Timer(float(timeout_s), fire)
    timer.daemon = True
    timer.start()
    try:
        try:
            return fn()
        finally:
            with lock:
                armed[0] = False
    finally:
        timer.cancel()
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
