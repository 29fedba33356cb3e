"""OpenAI function schemas of tools: :func:`check_schema` validates one (what a tool config declares or a tool
class sets) and :func:`argument_problem` checks the arguments a model wrote against it.

A valid schema::

    {"type": "function",
     "function": {"name": "calculator",                    # letters, digits, _ and -, starting with a letter or _
                  "description": "Evaluate an expression",  # a string (optional; "" when left out)
                  "parameters": {"type": "object",          # optional; no parameters when left out
                                 "properties": {"expression": {"type": "string", "description": "..."}},
                                 "required": ["expression"]}}}

A property's ``type`` is a JSON type (:data:`JSON_TYPES`) or a list of them; a property without ``type`` (an
``enum`` / ``anyOf`` only) takes any value. The arguments check is the part of JSON schema that catches what models
get wrong: a missing required argument, an argument the schema does not declare, a value of the wrong JSON type,
a value outside ``enum``.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Dict, List, Optional

from portrl.errors import UserError

JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")
NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
_VALID = ('valid: {"type": "function", "function": {"name": ..., "description": ..., "parameters": '
          '{"type": "object", "properties": {...}, "required": [...]}}}')


class ToolSchemaError(UserError, ValueError):
    """A tool schema that is not a valid OpenAI function schema (the message names where it came from)."""


def check_schema(schema: Any, where: str) -> Dict[str, Any]:
    """A normalized deep copy of ``schema`` (``description`` and ``parameters`` filled in when left out), or
    :class:`ToolSchemaError` naming ``where`` (the file and entry), what is wrong and what is valid."""
    def bad(problem: str) -> ToolSchemaError:
        return ToolSchemaError(f"{where}: tool schema {problem}; {_VALID}")

    if not isinstance(schema, dict):
        raise bad(f"is a {type(schema).__name__}, not a mapping")
    if schema.get("type") != "function":
        raise bad(f"has type {schema.get('type')!r}, not 'function'")
    fn = schema.get("function")
    if not isinstance(fn, dict):
        raise bad("has no 'function' mapping")
    unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise bad(f"function has unknown key(s) {', '.join(map(repr, unknown))}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise bad(f"function.name {name!r} is not a name (letters, digits, _ and -, at most 64, not starting "
                  "with a digit or -)")
    if not isinstance(fn.get("description", ""), str):
        raise bad(f"function.description of {name!r} is a {type(fn['description']).__name__}, not a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    _check_parameters(params, name, bad)
    out = copy.deepcopy(schema)
    out["function"].setdefault("description", "")
    out["function"]["parameters"] = copy.deepcopy(params)
    out["function"]["parameters"].setdefault("properties", {})
    return out


def _check_parameters(params: Any, name: str, bad) -> None:
    if not isinstance(params, dict) or params.get("type") != "object":
        raise bad(f"function.parameters of {name!r} must be a mapping with type 'object'")
    props = params.get("properties", {})
    if not isinstance(props, dict):
        raise bad(f"function.parameters.properties of {name!r} is a {type(props).__name__}, not a mapping")
    for key, prop in props.items():
        if not isinstance(prop, dict):
            raise bad(f"property {key!r} of {name!r} is a {type(prop).__name__}, not a mapping")
        types = prop.get("type")
        listed = types if isinstance(types, list) else [types]
        if types is not None and not all(t in JSON_TYPES for t in listed):
            raise bad(f"property {key!r} of {name!r} has type {types!r}; valid types: {', '.join(JSON_TYPES)}")
        if "enum" in prop and not isinstance(prop["enum"], list):
            raise bad(f"property {key!r} of {name!r} has an enum that is not a list")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise bad(f"function.parameters.required of {name!r} must be a list of property names")
    missing = [r for r in required if r not in props]
    if missing:
        raise bad(f"function.parameters.required of {name!r} names {', '.join(map(repr, missing))}, which "
                  f"properties do not declare (declared: {', '.join(props) or 'none'})")


def json_type_of(value: Any) -> str:
    """The JSON type name of a parsed JSON value (bool is ``boolean``, not ``integer``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _fits(value: Any, json_type: str) -> bool:
    got = json_type_of(value)
    return got == json_type or (json_type == "number" and got == "integer")


def argument_problem(schema: Dict[str, Any], arguments: Dict[str, Any]) -> Optional[str]:
    """What is wrong with ``arguments`` for the (checked) ``schema``, in words for the model; None when they fit."""
    params = schema["function"].get("parameters") or {}
    props = params.get("properties") or {}
    if not isinstance(arguments, dict):
        return f"the arguments are a JSON {json_type_of(arguments)}, not an object"
    missing = [r for r in params.get("required", []) if r not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(map(repr, missing))}"
    unknown = [k for k in arguments if k not in props]
    if unknown and params.get("additionalProperties") is not True:
        return (f"unknown argument(s) {', '.join(map(repr, unknown))}; valid: "
                f"{', '.join(map(repr, props)) or 'none'}")
    for key, value in arguments.items():
        prop = props.get(key) or {}
        types = prop.get("type")
        listed: List[str] = types if isinstance(types, list) else [types] if isinstance(types, str) else []
        if listed and not any(_fits(value, t) for t in listed):
            return f"argument {key!r} must be of type {' or '.join(listed)}, got {json_type_of(value)}"
        if "enum" in prop and value not in prop["enum"]:
            return f"argument {key!r} must be one of {prop['enum']!r}, got {value!r}"
    return None
