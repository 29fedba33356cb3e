"""Plain data: the only values that cross between a sandboxed program and the process that judges it.

The code reward never lets a program's objects into the process holding the expected values: what a function
returns is turned, inside the sandbox, into plain data (JSON text with a few tags), and the judging side
decodes that text into builtin values only -- ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``,
``bytes``, ``list``, ``tuple``, ``set``, ``frozenset``, ``dict`` -- and, where a test's setup code defines
classes (LeetCode's ``ListNode``, ``TreeNode``), instances of the judging side's own class of that name, built
with ``__new__`` and given the decoded attributes. Nothing of the program's code runs on the judging side, so
an object whose ``__eq__`` always answers True, a patched ``json`` or ``print`` and the like have no effect
there; whatever bytes the program writes instead, they decode to a plain value or are refused.

Encoding (:func:`encode`), from a value on the program's side:

* exact builtins as themselves (a float that is not finite as ``{"$float": "nan" | "inf" | "-inf"}``; bytes
  ``{"$bytes": base64}``, complex ``{"$complex": [re, im]}``, tuple ``{"$tuple": [...]}``, set ``{"$set":
  [...]}``, frozenset ``{"$frozenset": [...]}``, dict ``{"$dict": [[key, value], ...]}``, list as a list);
* other containers and numbers by what they hold: a ``dict`` subclass (``Counter``, ``defaultdict``) as a dict
  of its items, a ``list`` / ``tuple`` / ``set`` / ``str`` subclass or a ``deque`` as the builtin, an
  ``Integral`` as ``int``, a ``Real`` as ``float``, a numpy value through its ``tolist()``;
* an instance of a class named in ``classes`` (the setup's classes) as ``{"$obj": index}`` into a table of
  ``[class name, {attribute: value}]`` (its ``__dict__``), so linked lists and trees keep shared and cyclic
  references without deep nesting;
* anything else as ``{"$ref": handle_of(x)}`` where the caller keeps such objects (the program's side of a
  judged test: the judge may call it or read its attributes, never compare it), else :class:`Unencodable`.

Limits: nesting depth :data:`MAX_DEPTH`, :data:`MAX_ITEMS` values in all; the text's size is bounded by the
caller. This file uses the standard library only: the sandbox harnesses embed its source.
"""

import base64
import json
import math
import numbers

MAX_DEPTH = 200
MAX_ITEMS = 2_000_000


class Unencodable(TypeError):
    """A value that is not plain data (the message names its type)."""


class Undecodable(ValueError):
    """Text that is not plain data in this module's form."""


def encode(value, classes=(), handle_of=None):
    """The JSON text of ``{"value": ..., "objects": [...]}`` for ``value`` (module docstring)."""
    objects: list = []
    seen: dict = {}
    count = [0]

    def enc(x, depth):
        count[0] += 1
        if depth > MAX_DEPTH or count[0] > MAX_ITEMS:
            raise Unencodable("a value nested too deep or too large")
        t = type(x)
        if x is None or t is bool or t is int or t is str:
            return x
        if t is float:
            return x if math.isfinite(x) else {"$float": repr(x)}
        if t is list:
            return [enc(v, depth + 1) for v in x]
        if t is tuple:
            return {"$tuple": [enc(v, depth + 1) for v in x]}
        if t is dict:
            return {"$dict": [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]}
        if t is set or t is frozenset:
            return {"$" + t.__name__: [enc(v, depth + 1) for v in x]}
        if t is bytes:
            return {"$bytes": base64.b64encode(x).decode("ascii")}
        if t is complex:
            return {"$complex": [enc(x.real, depth + 1), enc(x.imag, depth + 1)]}
        if t.__name__ in classes:
            key = id(x)
            if key not in seen:  # its attributes are encoded after the value: no nesting per link of a list
                seen[key] = len(objects)
                objects.append(x)
            return {"$obj": seen[key]}
        try:
            return enc(_coerce(x), depth + 1)
        except Unencodable:
            if handle_of is None:
                raise
            return {"$ref": handle_of(x)}

    doc = {"value": enc(value, 0)}
    done = 0
    while done < len(objects):
        x = objects[done]
        attrs = getattr(x, "__dict__", None)
        if type(attrs) is not dict:
            raise Unencodable(f"a {type(x).__name__} without attributes")
        objects[done] = [type(x).__name__, {str(k): enc(v, 0) for k, v in list(attrs.items())}]
        done += 1
    doc["objects"] = objects
    text = json.dumps(doc, allow_nan=False, separators=(",", ":"))
    return text


def _coerce(x):
    """The builtin that a container or number stands for (its contents through its own protocol); Unencodable
    for anything else."""
    if isinstance(x, bool):
        return bool(x)
    if isinstance(x, dict):
        return dict(x.items())
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, (list, tuple, set, frozenset)) or type(x).__name__ == "deque":
        base = next(b for b in (list, tuple, set, frozenset) if isinstance(x, b)) \
            if isinstance(x, (list, tuple, set, frozenset)) else list
        return base(iter(x))
    if type(x).__module__ == "numpy" and hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    if isinstance(x, numbers.Complex):
        return complex(x)
    raise Unencodable(f"a {type(x).__name__} is not plain data")


def decode(text, classes=None, handle=None):
    """The value of :func:`encode`'s ``text``: builtins only; ``{"$obj"}`` as instances of ``classes[name]`` (a
    name missing there is refused); ``{"$ref": n}`` as ``handle(n)`` (refused without ``handle``)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise Undecodable(f"not JSON ({exc})") from None
    if type(doc) is not dict or set(doc) != {"value", "objects"} or type(doc["objects"]) is not list:
        raise Undecodable("not a plain-data document")
    classes = classes or {}
    built = []
    for entry in doc["objects"]:  # every instance first, then their attributes: links need no recursion
        if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not str or type(entry[1]) is not dict:
            raise Undecodable("a malformed object")
        cls = classes.get(entry[0])
        if cls is None:
            raise Undecodable(f"an object of class {entry[0]!r}, which the judge does not define")
        built.append(cls.__new__(cls))

    def obj(index):
        if type(index) is not int or not 0 <= index < len(built):
            raise Undecodable("an object index out of range")
        return built[index]

    def dec(x, depth):
        if depth > MAX_DEPTH:
            raise Undecodable("nested too deep")
        t = type(x)
        if x is None or t in (bool, int, str, float):
            return x
        if t is list:
            return [dec(v, depth + 1) for v in x]
        if t is not dict or len(x) != 1:
            raise Undecodable("a malformed value")
        (tag, body), = x.items()
        if tag == "$float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "$bytes" and type(body) is str:
            return base64.b64decode(body.encode("ascii"), validate=True)
        if tag == "$obj":
            return obj(body)
        if tag == "$ref" and handle is not None and type(body) is int:
            return handle(body)
        if type(body) is not list:
            raise Undecodable(f"a malformed {tag}")
        if tag == "$complex" and len(body) == 2:
            return complex(dec(body[0], depth + 1), dec(body[1], depth + 1))
        items = [dec(v, depth + 1) for v in body]
        try:
            if tag == "$tuple":
                return tuple(items)
            if tag == "$set":
                return set(items)
            if tag == "$frozenset":
                return frozenset(items)
            if tag == "$dict" and all(type(p) is list and len(p) == 2 for p in items):
                return {k: v for k, v in items}
        except TypeError as exc:  # an unhashable key or member
            raise Undecodable(str(exc)) from None
        raise Undecodable(f"a malformed value tagged {tag!r}")

    try:
        for instance, (_, attrs) in zip(built, doc["objects"]):
            for name, value in attrs.items():
                object.__setattr__(instance, name, dec(value, 0))
        return dec(doc["value"], 0)
    except (RecursionError, ValueError, TypeError) as exc:
        if isinstance(exc, Undecodable):
            raise
        raise Undecodable(str(exc)) from None
