"""Reading a sandboxed run (portrl/rewards/sandbox.py starts and finishes it): its pipes, its report, its status.

* :func:`communicate`: writes stdin as the program reads it and reads stdout and stderr, until the deadline, the
  output cap (stdout up to ``output_bytes``; more stdout or stderr than that stops the run), or shortly after the
  program exits (a background process it left holding the pipes does not keep the run going); stderr keeps its
  last ``stderr_bytes``;
* :func:`exited_by`: whether the launcher exits before the deadline (it passes the program's status on);
* :func:`read_status`: the child's report, JSON lines on the status pipe merged into one dict (a line that is not
  JSON becomes "error");
* :func:`classify_exit`: the run's status, one of :data:`STATUSES` ("wrong" is a scorer's, never returned here).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time

STATUSES = ("ok", "wrong", "timeout", "memory", "output_limit", "runtime_error", "syntax_error")


def exited_by(proc: subprocess.Popen, deadline: float) -> bool:
    """Whether ``proc`` exits before ``deadline`` (time.monotonic()); waits until then at most."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False


def read_status(fd: int) -> dict:
    """The child's report: every JSON line read from ``fd`` up to EOF, merged (``fd`` is closed)."""
    chunks = []
    try:
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    report: dict = {}
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        try:
            report.update(json.loads(line))
        except json.JSONDecodeError:
            report["error"] = f"unreadable status {line[:200]!r}"
    return report


def communicate(proc: subprocess.Popen, data: bytes, output_bytes: int, stderr_bytes: int,
                deadline: float) -> tuple[bytes, bytes, bool, bool]:
    """(stdout, stderr tail, timed out, stdout or stderr over ``output_bytes``). Writes stdin as the program
    reads it, reads both pipes, and stops at the deadline, at the cap, or shortly after the program exits (a
    background process it left holding the pipes does not keep the run going)."""
    stdin_pipe, stdout_pipe, stderr_pipe = proc.stdin, proc.stdout, proc.stderr
    if stdin_pipe is None or stdout_pipe is None or stderr_pipe is None:
        raise ValueError("communicate needs a process started with stdin, stdout and stderr pipes")
    sel = selectors.DefaultSelector()
    for stream in (stdin_pipe, stdout_pipe, stderr_pipe):
        os.set_blocking(stream.fileno(), False)
    if data:
        sel.register(stdin_pipe, selectors.EVENT_WRITE)
    else:
        stdin_pipe.close()
    sel.register(stdout_pipe, selectors.EVENT_READ)
    sel.register(stderr_pipe, selectors.EVENT_READ)
    out, err = bytearray(), bytearray()
    view, timed_out, over, exited_at, err_total = memoryview(data), False, False, None, 0
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break
            for key, _ in sel.select(min(deadline - now, 0.05)):
                if key.fileobj is stdin_pipe:
                    try:
                        view = view[os.write(stdin_pipe.fileno(), view[:65536]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the program closed its stdin
                        view = view[:0]
                    if not view:
                        sel.unregister(stdin_pipe)
                        stdin_pipe.close()  # EOF: reading past it gets "" / EOFError
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.fileobj is stdout_pipe:
                    out += chunk
                    if len(out) > output_bytes:
                        over = True
                else:
                    err += chunk
                    err_total += len(chunk)
                    del err[:-stderr_bytes]
                    over = over or err_total > output_bytes
            if over:
                break
    finally:
        sel.close()
        for stream in (stdin_pipe, stdout_pipe, stderr_pipe):
            if not stream.closed:
                stream.close()
    return bytes(out[:output_bytes]), bytes(err), timed_out, over


def classify_exit(returncode: int | None, stderr: str, timed_out: bool, over: bool, elapsed: float,
                  cpu_s: int) -> str:
    """The status of a run (one of STATUSES, never "wrong") from its exit code, stderr, whether a limit stopped it,
    its wall time and its CPU limit."""
    if over:
        return "output_limit"
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode == 0:
        return "ok"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if last.startswith("MemoryError"):
        return "memory"
    if last.startswith(("SyntaxError", "IndentationError", "TabError")) and "Traceback" not in stderr:
        return "syntax_error"  # a compile error of the program itself prints no traceback
    if returncode == -signal.SIGKILL and elapsed >= cpu_s:
        return "timeout"  # the hard CPU limit
    return "runtime_error"
