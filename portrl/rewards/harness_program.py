"""The program's side of a code test: runs inside the sandbox, answers calls with plain data, judges nothing.

Embedded into the sandboxed file by portrl.rewards.code_judge (this module's text, with the import of
portrl.rewards.plain_data replaced by that module's text), then ``serve(program, setup)`` runs:

1. The protocol moves off the program's way: requests come on a private copy of stdin (fd 0 becomes
   /dev/null), replies go to a private copy of stdout (fd 1 becomes a copy of stderr, so whatever the program
   prints lands in stderr).
2. ``setup`` (the test's shared definitions: imports, LeetCode's ``ListNode``) and then the program run in one
   module namespace named ``solution`` (so a ``__main__`` guard does not run). The classes the setup defines
   are the ones exchanged as objects (portrl.rewards.plain_data).
3. Each request line (JSON) gets one reply line ``{"value": <plain-data text>}``, ``{"raised": "Type: message",
   "type": "Type"}`` or ``{"missing": true}``. Requests: ``{"op": "call_fn", "fn_name", "args"}`` (verl's
   lookup: the method of ``Solution()`` when the program defines that class and it has the method, else the
   module's function), ``{"op": "eval", "expr"}`` (a test's entry point, e.g. ``Solution().twoSum``),
   ``{"op": "global", "name"}``, ``{"op": "getattr", "ref", "name"}``, ``{"op": "call", "ref", "args",
   "kwargs"}``. A value that is not plain data is kept here and answered as a handle (``{"$ref": n}``) when
   the request allows it (every op but ``call_fn``); for ``call_fn`` it is an error.
4. At the end of the requests (EOF) it exits 0.

Nothing here is secret: the expected values and the verdict never enter this process, so a program that
patches, reads or replaces any of it can only change what it answers -- as if its function had returned that.
"""

import builtins
import json
import os
import sys

from portrl.rewards.plain_data import decode, encode  # embedded: the codec's text


def serve(program, setup):
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8", errors="replace")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    namespace: dict = {"__name__": "solution", "__builtins__": builtins}
    exec(compile(setup, "setup.py", "exec"), namespace)
    classes = {name for name, value in namespace.items()
               if isinstance(value, type) and value.__module__ == "solution"}  # defined by the setup, not imported
    exec(compile(program, "main.py", "exec"), namespace)
    # the setup's classes as the program left them (a program may define its own ListNode)
    decoded_classes = {c: namespace[c] for c in classes if isinstance(namespace.get(c), type)}
    handles = []

    def handle_of(value):
        handles.append(value)
        return len(handles) - 1

    def argument(text):
        return decode(text, classes=decoded_classes, handle=lambda n: handles[n])

    def answer(request):
        op = request["op"]
        if op == "call_fn":
            name = request["fn_name"]
            target = namespace.get("Solution")
            fn = getattr(target(), name) if isinstance(target, type) and hasattr(target, name) else namespace[name]
            result = fn(*argument(request["args"]))
            return {"value": encode(result, classes)}
        if op == "eval":
            result = eval(request["expr"], namespace)
        elif op == "global":
            if request["name"] not in namespace:
                return {"missing": True}
            result = namespace[request["name"]]
        elif op == "getattr":
            result = getattr(handles[request["ref"]], request["name"])
        elif op == "call":
            result = handles[request["ref"]](*argument(request["args"]), **argument(request["kwargs"]))
        else:
            raise ValueError(f"unknown request {op!r}")
        return {"value": encode(result, classes, handle_of)}

    for line in requests:
        try:
            reply = answer(json.loads(line))
        except Exception as exc:  # noqa: BLE001 - the program's own exception (or a value it cannot send) answers
            reply = {"raised": f"{type(exc).__name__}: {exc}"[:2000], "type": type(exc).__name__}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    sys.stdout.flush()
