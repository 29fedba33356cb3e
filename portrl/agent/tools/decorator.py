"""``@tool``: a :class:`~portrl.agent.tools.base.Tool` from a plain Python function.

::

    @tool
    def lookup(city: str, year: int = 2024) -> str:
        '''Population of a city.

        Args:
            city: the city's English name
        '''
        ...

    @tool(name="check", description="Check an answer")
    def check_answer(answer: str, *, ground_truth: str) -> ToolResult:
        return ToolResult("correct" if answer == ground_truth else "wrong", reward=float(answer == ground_truth))

The schema comes from the signature: each positional-or-keyword parameter is a property, typed from its
annotation (str: string, int: integer, float: number, bool: boolean, list / tuple: array, dict: object;
``Optional[X]`` / ``X | None`` as X; ``list[X]`` gives ``items``); a parameter without a default is
``required``; a property's description comes from a Google-style ``Args:`` section of the docstring. The tool's
description is ``description`` or the docstring's first paragraph; its name ``name`` or the function's name.
Keyword-only parameters are not in the schema: they are filled from the row's kwargs (``row_kwargs``, verl's
``extra_info.tools_kwargs[<name>]``, e.g. ``ground_truth``) when the row gives them, else their default; one
without a default that the row does not give makes the call fail (an error message for the model).

The function returns a ``str`` or a :class:`ToolResult`; a dict or list is written as JSON, anything else with
``str()``. A parameter without an annotation (or of a type not listed), ``*args`` or ``**kwargs`` is a
``TypeError`` when the decorator runs.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Dict, Optional

from portrl.agent.tools.base import Tool, ToolResult

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", tuple: "array",
               dict: "object"}


class FunctionTool(Tool):
    """A tool made by :func:`tool` (module docstring): ``fn`` called with the model's arguments and the row's
    keyword-only ones."""

    def __init__(self, fn: Callable[..., Any], name: str, schema: Dict[str, Any], row_params: Dict[str, bool]):
        self.fn = fn
        self.name = name
        self.schema = schema
        self.row_params = row_params  # keyword-only parameter -> whether it has a default

    def call(self, arguments: Dict[str, Any], row_kwargs: Dict[str, Any]) -> "ToolResult | str":
        kwargs = dict(arguments)
        for param, has_default in self.row_params.items():
            if param in row_kwargs:
                kwargs[param] = row_kwargs[param]
            elif not has_default:
                raise TypeError(f"the row gives no {param!r} for tool {self.name!r} (extra_info.tools_kwargs."
                                f"{self.name}.create_kwargs or execute_kwargs)")
        out = self.fn(**kwargs)
        if isinstance(out, (ToolResult, str)):
            return out
        if isinstance(out, (dict, list)):
            return json.dumps(out, ensure_ascii=False, default=str)
        return str(out)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The decorated function stays callable as itself."""
        return self.fn(*args, **kwargs)


def tool(fn: Optional[Callable[..., Any]] = None, *, description: Optional[str] = None,
         name: Optional[str] = None) -> Any:
    """``@tool`` or ``@tool(description=..., name=...)``: a :class:`FunctionTool` (module docstring)."""
    def make(f: Callable[..., Any]) -> FunctionTool:
        tool_name = name or f.__name__
        doc = inspect.getdoc(f) or ""
        summary = description if description is not None else _first_paragraph(doc)
        properties, required, row_params = _parameters(f, _arg_docs(doc))
        schema = {"type": "function", "function": {
            "name": tool_name, "description": summary,
            "parameters": {"type": "object", "properties": properties, "required": required}}}
        return FunctionTool(f, tool_name, schema, row_params)

    return make(fn) if fn is not None else make


def _parameters(fn: Callable[..., Any], docs: Dict[str, str]):
    """(properties, required, keyword-only parameters) of ``fn``'s signature."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an annotation that does not resolve
        raise TypeError(f"@tool {fn.__name__}: cannot read its annotations ({type(exc).__name__}: {exc})") from None
    properties: Dict[str, Any] = {}
    required, row_params = [], {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"@tool {fn.__name__}: *{p.name} / **{p.name} cannot be described in a schema; "
                            "name each argument")
        if p.kind == p.KEYWORD_ONLY:
            row_params[p.name] = p.default is not p.empty
            continue
        if p.kind == p.POSITIONAL_ONLY:
            raise TypeError(f"@tool {fn.__name__}: parameter {p.name!r} is positional-only; tools are called "
                            "with keyword arguments")
        if p.name not in hints:
            raise TypeError(f"@tool {fn.__name__}: parameter {p.name!r} has no annotation; annotate it with "
                            "str, int, float, bool, list or dict")
        prop = _json_schema(hints[p.name], fn.__name__, p.name)
        if p.name in docs:
            prop["description"] = docs[p.name]
        properties[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    return properties, required, row_params


def _json_schema(annotation: Any, fn_name: str, param: str) -> Dict[str, Any]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _json_schema(rest[0], fn_name, param)
    elif origin in (list, tuple) and len(set(args) - {Ellipsis}) == 1:
        item = next(a for a in args if a is not Ellipsis)
        return {"type": "array", "items": _json_schema(item, fn_name, param)}
    base = origin if origin is not None else annotation
    if base in _JSON_TYPES:
        return {"type": _JSON_TYPES[base]}
    raise TypeError(f"@tool {fn_name}: parameter {param!r} is annotated {annotation!r}; valid: str, int, float, "
                    "bool, list, dict (or Optional of one)")


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.split("\n\n", 1)[0].split()) if doc else ""


_ARG_LINE = re.compile(r"^\s{0,8}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _arg_docs(doc: str) -> Dict[str, str]:
    """Parameter descriptions from a Google-style ``Args:`` section (continuation lines indented deeper)."""
    match = re.search(r"^(Args|Arguments|Parameters):\s*$", doc, re.MULTILINE)
    if not match:
        return {}
    out: Dict[str, str] = {}
    current, indent = None, None
    for line in doc[match.end():].splitlines()[1:]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if width == 0:
            break  # the next section
        hit = _ARG_LINE.match(line)
        if hit and (indent is None or width <= indent):
            indent, current = width, hit.group(1)
            out[current] = hit.group(2).strip()
        elif current is not None:
            out[current] = (out[current] + " " + line.strip()).strip()
    return out
