"""Code tests judged outside the program's process: the sandboxed program answers with plain data, and the
expected values, the comparison and the verdict stay where it cannot reach them.

* call-based (:func:`call_source`, :func:`read_call_result`): the program's file is portrl/rewards/harness_program.py
  serving one ``call_fn`` request on stdin; its answer, the last protocol line of stdout, is decoded here
  (portrl.rewards.plain_data) and compared by portrl.rewards.code with the expected value, which never leaves
  this process. Works on the local sandbox and on SandboxFusion alike (one run, stdin in, stdout out).
* assert- and check()-style (:func:`run_judged`): two sandboxes, the program's (harness_program.py) and the
  test's (portrl/rewards/harness_judge.py). This process relays each request of the test to the program and each
  answer back (one JSON line each, at most ``limits.output_bytes``), and reads the test's verdict. The program
  never sees the test, its expected values or the verdict; the test sees only plain data of the program's.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from portrl.rewards.plain_data import Undecodable, decode
from portrl.rewards.sandbox import RunResult, SandboxLimits, Started, finish, start_program

_HERE = Path(__file__).parent
_CODEC_IMPORT = "from portrl.rewards.plain_data import "  # the harness line the codec's text replaces


@lru_cache(maxsize=None)
def _harness(name: str) -> str:
    """A harness file's text with the codec's import replaced by the codec's own text."""
    codec = (_HERE / "plain_data.py").read_text(encoding="utf-8")
    text = (_HERE / name).read_text(encoding="utf-8")
    line = next(x for x in text.splitlines() if x.startswith(_CODEC_IMPORT))
    return text.replace(line, codec, 1)


def program_source(program: str, setup: str) -> str:
    """The sandboxed file of the program's side (harness_program.serve)."""
    return _harness("harness_program.py") + f"\nserve({program!r}, {setup!r})\n"


def judge_source(preamble: str, setup: str, test: str, entry_point: str | None, form: str) -> str:
    """The sandboxed file of the test's side (harness_judge.judge)."""
    return _harness("harness_judge.py") + f"\njudge({preamble!r}, {setup!r}, {test!r}, {entry_point!r}, {form!r})\n"


def call_request(fn_name: str, args_text: str) -> str:
    """The stdin of a call-based run: one request (``args_text``: plain-data text of the argument list)."""
    return json.dumps({"op": "call_fn", "fn_name": fn_name, "args": args_text}) + "\n"


_MISSING = object()


def read_call_result(result: RunResult) -> object:
    """The value the program returned in a call-based run, decoded; ``_MISSING`` when it ran but gave no plain
    value (it raised, returned something that is not plain data, or broke the protocol)."""
    if result.status != "ok":
        return _MISSING
    lines = result.stdout.rstrip("\n").splitlines()
    if not lines:
        return _MISSING
    try:
        reply = json.loads(lines[-1])
        if type(reply) is not dict or type(reply.get("value")) is not str:
            return _MISSING
        return decode(reply["value"])
    except (ValueError, RecursionError, Undecodable):
        return _MISSING


def is_missing(value: object) -> bool:
    return value is _MISSING


# ------------------------------------------------------------------------------------------ judged tests
class _Pipe:
    """A process's output pipe read into a buffer, and the lines complete so far."""

    def __init__(self, stream, cap: int):
        self.fd, self.buffer, self.cap, self.closed, self.total = stream.fileno(), bytearray(), cap, False, 0
        os.set_blocking(self.fd, False)

    def read(self) -> None:
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self.closed = True
        self.total += len(chunk)
        self.buffer += chunk

    def line(self) -> bytes | None:
        end = self.buffer.find(b"\n")
        if end < 0:
            return None
        line = bytes(self.buffer[:end + 1])
        del self.buffer[:end + 1]
        return line


def run_judged(program_file: str, judge_file: str, limits: SandboxLimits) -> tuple[bool, RunResult]:
    """Run the program and the test in two sandboxes and relay between them until the test's verdict, the
    deadline (``limits.timeout_s`` for the whole case) or a limit: (the verdict is "pass", the program's run,
    whose status says why it failed when it did)."""
    program = start_program(program_file, limits)
    try:
        judge = start_program(judge_file, limits)
    except BaseException:
        finish(program, b"", b"", False, False)
        raise
    err, timed_out, over, ended = b"", False, False, True
    verdict: dict = {}
    judge_out, judge_err = b"", b""
    try:
        verdict, ended, err, timed_out, over, judge_out, judge_err = _relay(program, judge, limits)
        if ended and not (timed_out or over):
            timed_out = not _exited_by(program, program.deadline)
    finally:
        try:
            finish(judge, judge_out, judge_err, False, False)
        finally:
            result = finish(program, b"", err, timed_out, over)
    if not (ended or timed_out or over):
        result.status = "ok"  # alive and answering at the verdict: it was stopped afterwards, by the relay
    return verdict.get("verdict") == "pass" and not timed_out and not over, result


def _exited_by(started: Started, deadline: float) -> bool:
    """Whether a program whose stdout has closed exits on its own by ``deadline``: its exit status is its own,
    not the kill that ``finish`` sends (a loaded machine can take a while between the two)."""
    try:
        started.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    return True


def _relay(program: Started, judge: Started, limits: SandboxLimits):
    """(verdict, whether the program had ended, its stderr tail, timed out, over a limit, the judge's stdout and
    stderr tail)."""
    deadline = program.deadline
    cap = limits.output_bytes
    p_out, p_err = _Pipe(program.proc.stdout, cap), _Pipe(program.proc.stderr, cap)
    j_out, j_err = _Pipe(judge.proc.stdout, cap), _Pipe(judge.proc.stderr, cap)
    to_program, to_judge = bytearray(), bytearray()
    p_in, j_in = program.proc.stdin, judge.proc.stdin
    if p_in is None or j_in is None:
        raise ValueError("run_judged needs processes started with stdin pipes")
    for stream in (p_in, j_in):
        os.set_blocking(stream.fileno(), False)
    sel = selectors.DefaultSelector()
    for pipe in (p_out, p_err, j_out, j_err):
        sel.register(pipe.fd, selectors.EVENT_READ, pipe)
    verdict: dict = {}
    timed_out = over = False
    waiting = False  # a request went to the program and its answer has not come back
    try:
        while not verdict:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            for fd, buffer, stream in ((p_in.fileno(), to_program, p_in), (j_in.fileno(), to_judge, j_in)):
                if buffer and not stream.closed:
                    try:
                        del buffer[:os.write(fd, bytes(buffer[:65536]))]
                    except BlockingIOError:
                        pass
                    except (BrokenPipeError, OSError):
                        buffer.clear()
            for key, _ in sel.select(min(deadline - now, 0.05)):
                pipe = key.data
                pipe.read()
                if pipe.closed:
                    sel.unregister(key.fd)
            for pipe in (p_err, j_err):
                del pipe.buffer[:-limits.stderr_bytes]
            if p_out.total > cap or p_err.total > cap or j_err.total > cap or j_out.total > cap:
                over = True
                break
            while (line := j_out.line()) is not None:
                message = _message(line)
                if "verdict" in message:
                    verdict = message
                    break
                to_program += line
                waiting = True
            while (line := p_out.line()) is not None:
                to_judge += line
                waiting = False
            if waiting and p_out.closed and not p_out.buffer:
                to_judge += b'{"gone": true}\n'  # the judge reads it as the program's end
                waiting = False
            if j_out.closed and not j_out.buffer and not verdict:
                verdict = {"verdict": "fail", "error": "the test stopped without a verdict"}
    finally:
        sel.close()
    return (verdict, p_out.closed, bytes(p_err.buffer), timed_out, over, bytes(j_out.buffer),
            bytes(j_err.buffer))


def _message(line: bytes) -> dict:
    try:
        message = json.loads(line)
    except ValueError:
        return {"verdict": "fail", "error": "the test broke the protocol"}
    return message if type(message) is dict else {"verdict": "fail", "error": "the test broke the protocol"}
