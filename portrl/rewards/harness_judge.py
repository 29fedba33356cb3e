"""The judge's side of an assert- or check()-style code test: runs the test in a sandbox of its own.

Embedded into its sandboxed file by portrl.rewards.code_judge (this module's text, with the import of
portrl.rewards.plain_data replaced by that module's text), then ``judge(preamble, setup, test, entry_point,
form)`` runs. The program never runs here: it runs in another sandbox (portrl/rewards/harness_program.py),
and portrl.rewards.code_judge relays this process's requests to it and its answers back, one JSON line each.

* The protocol moves off the test's way: answers come on a private copy of stdin (fd 0 becomes /dev/null),
  requests and the verdict go to a private copy of stdout (fd 1 becomes a copy of stderr).
* ``preamble`` and ``setup`` run here as in the program's file; a name the test uses that neither they nor
  the builtins define is the program's (``Solution``, ``f``): it is asked for. ``candidate`` is the program's
  ``entry_point`` (an expression evaluated on the program's side). ``form`` "asserts": ``test`` is one
  statement; "check": ``test`` defines ``check`` and ``check(candidate)`` runs.
* What the program gives back is plain data (portrl.rewards.plain_data), decoded here into builtins and this
  setup's own classes; anything else is a :class:`ProgramObject` that can be called or have attributes read
  (both run on the program's side) and is equal only to itself, with no truth value: a test that compares,
  tests or orders it fails.
* The verdict is the last line: ``{"verdict": "pass"}`` when the test ran to its end, else ``{"verdict":
  "fail", "error": ...}``.
"""

import builtins
import json
import os
from typing import Callable

from portrl.rewards.plain_data import Unencodable, decode, encode  # embedded: the codec's text


class ProgramGone(Exception):
    """The program stopped (or broke the protocol) before it answered."""


class ProgramObject:
    """A value of the program that is not plain data: it stays on the program's side."""

    __slots__ = ("_ref", "_ask")

    def __init__(self, ref, ask):
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_ask", ask)

    def __call__(self, *args, **kwargs):
        return self._ask({"op": "call", "ref": self._ref, "args": list(args), "kwargs": kwargs})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask({"op": "getattr", "ref": self._ref, "name": name})

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    __hash__ = object.__hash__

    def __bool__(self):
        raise TypeError("the program returned an object that is not plain data; it has no truth value here")

    def __repr__(self):
        return "<an object of the program>"


def judge(preamble, setup, test, entry_point, form):
    answers = os.fdopen(os.dup(0), "r", encoding="utf-8", errors="replace")
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)

    def send(message):
        out.write(json.dumps(message) + "\n")
        out.flush()

    scope = Scope(__name__="test")
    exec(compile(preamble + setup, "setup.py", "exec"), scope)
    classes = {name: value for name, value in scope.items()
               if isinstance(value, type) and value.__module__ == "test"}  # defined by the setup, not imported

    def handle_of(value):
        if type(value) is ProgramObject:
            return value._ref
        raise Unencodable(f"a {type(value).__name__} cannot be passed to the program")

    def ask(request):
        for key in ("args", "kwargs"):
            if key in request:
                request[key] = encode(request[key], classes, handle_of)
        send(request)
        line = answers.readline()
        try:
            reply = json.loads(line)
        except ValueError:
            raise ProgramGone("the program stopped before it answered") from None
        if type(reply) is not dict:
            raise ProgramGone("the program broke the protocol")
        if reply.get("missing") is True:
            raise KeyError(request.get("name"))
        if "raised" in reply:
            kind = getattr(builtins, str(reply.get("type")), None)
            kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
            raise kind(f"in the program: {str(reply['raised'])[:500]}")
        if type(reply.get("value")) is not str:
            raise ProgramGone("the program broke the protocol")
        return decode(reply["value"], classes=classes, handle=lambda ref: ProgramObject(ref, ask))

    scope.ask = ask
    try:
        if entry_point:
            scope["candidate"] = ask({"op": "eval", "expr": entry_point})
        if form == "check":
            exec(compile(test, "test.py", "exec"), scope)
            scope["check"](scope["candidate"])
        else:
            exec(compile(test, "test.py", "exec"), scope)
    except BaseException as exc:  # noqa: BLE001 - any failure of the test is the verdict "fail"
        send({"verdict": "fail", "error": f"{type(exc).__name__}: {exc}"[:500]})
        return
    send({"verdict": "pass"})


class Scope(dict):
    """The test's globals: a name that is neither defined here nor a builtin is looked up in the program."""

    ask: "Callable[[dict], object] | None" = None

    def __missing__(self, name):
        if hasattr(builtins, name) or self.ask is None or name.startswith("__"):
            raise KeyError(name)
        return self.ask({"op": "global", "name": name})
