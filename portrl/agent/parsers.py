"""Tool-call parsers: read the tool calls out of a model turn's decoded text, one parser per model family.

A parser is a :class:`ToolCallParser` subclass registered under a name with :func:`register_parser`; the
``rollout.multi_turn.format`` setting names it and :func:`get_parser` builds it. ``hermes`` (Qwen2.5, Qwen3,
NousResearch Hermes) is built in::

    Let me compute it.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123*456"}}
    </tool_call>

A call that cannot be read (malformed JSON, no name, arguments that are not an object, a ``<tool_call>`` that is
never closed) is still returned, as a :class:`ToolCall` with ``error`` set: the agent loop answers it with that
error as the tool's output, and the run goes on.

The parser only reads text: the agent loop never re-encodes the model's tokens (portrl/agent/chat_delta.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from portrl.errors import UserError


@dataclass
class ToolCall:
    """One tool call of a model turn: ``name`` and its ``arguments`` (a dict), or ``error`` (why the call could not be
    read; ``arguments`` is then None and ``name`` whatever could be read, possibly "")."""

    name: str
    arguments: Optional[Dict[str, Any]]
    error: Optional[str] = None

    def openai(self) -> Dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` entry, the shape chat templates render (only for a call without
        ``error``)."""
        if self.error is not None:
            raise ValueError(f"tool call {self.name!r} could not be read ({self.error}); it has no OpenAI form")
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser:
    """Base class: ``parse(text) -> (content, calls)``, ``content`` being the text outside the calls (stripped) and
    ``calls`` in the order they appear; ``format_calls(calls)`` writes calls back as the model family writes them."""

    name: str = ""

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        raise NotImplementedError(f"tool-call parser {self.name!r} does not implement parse")

    def format_calls(self, calls: List[ToolCall]) -> str:
        raise NotImplementedError(f"tool-call parser {self.name!r} does not implement format_calls")

    def assistant_message(self, text: str) -> Dict[str, Any]:
        """The chat message of a model turn whose decoded text is ``text`` (for traces and the strict tokenization
        check): ``{"role": "assistant", "content", "tool_calls"}`` when every call could be read, else the raw text
        as ``content`` (a template cannot render a call it cannot read)."""
        content, calls = self.parse(text)
        if not calls or any(c.error is not None for c in calls):
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}


_PARSERS: Dict[str, Type[ToolCallParser]] = {}


def register_parser(name: str) -> Callable[[Type[ToolCallParser]], Type[ToolCallParser]]:
    """Class decorator: register a :class:`ToolCallParser` subclass under ``name`` (its ``name`` is set to it)."""

    def deco(cls: Type[ToolCallParser]) -> Type[ToolCallParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
            raise TypeError(f"register_parser({name!r}) decorates a ToolCallParser subclass, not {cls!r}")
        if name in _PARSERS and _PARSERS[name] is not cls:
            raise ValueError(f"a tool-call parser named {name!r} is already registered ({_PARSERS[name].__name__})")
        cls.name = name
        _PARSERS[name] = cls
        return cls

    return deco


def parser_names() -> List[str]:
    """The registered parser names, sorted."""
    return sorted(_PARSERS)


def get_parser(name: str) -> ToolCallParser:
    """A new parser of the registered ``name``; an unknown name is a :class:`UserError` naming the valid ones."""
    cls = _PARSERS.get(name)
    if cls is None:
        raise UserError(f"rollout.multi_turn.format={name!r} is not a tool-call parser; "
                        f"valid: {', '.join(parser_names())}")
    return cls()


def _read_call(body: str) -> ToolCall:
    """One call from the JSON between the tags (``{"name": ..., "arguments": {...}}``; arguments given as a JSON
    string are read too, a missing ``arguments`` is ``{}``)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall("", None, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(obj, dict):
        return ToolCall("", None, f"the tool call is a JSON {type(obj).__name__}, not an object with a name and "
                                  "arguments")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", None, "the tool call has no \"name\" (a non-empty string)")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            return ToolCall(name, None, f"the arguments of {name!r} are a string that is not valid JSON ({exc.msg})")
    if not isinstance(args, dict):
        return ToolCall(name, None, f"the arguments of {name!r} are a JSON {type(args).__name__}, not an object")
    return ToolCall(name, args)


@register_parser("hermes")
class HermesParser(ToolCallParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several per turn (Qwen2.5's chat template
    writes them this way, one per line); a ``<tool_call>`` left open at the end of the text is an error call."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        calls: List[ToolCall] = []
        pieces: List[str] = []
        pos = 0
        for m in self._CALL.finditer(text):
            pieces.append(text[pos:m.start()])
            calls.append(_read_call(m.group(1).strip()))
            pos = m.end()
        rest = text[pos:]
        start = rest.find(self.OPEN)
        if start >= 0:
            calls.append(ToolCall("", None, "a <tool_call> is not closed by </tool_call>"))
            rest = rest[:start]
        pieces.append(rest)
        content = "\n".join(p.strip() for p in pieces if p.strip())
        return content, calls

    def format_calls(self, calls: List[ToolCall]) -> str:
        """The calls as Qwen2.5's template renders an assistant's ``tool_calls`` (keys in this order, JSON with
        ``", "`` / ``": "`` separators, non-ASCII kept), joined by a newline; the model's turn is
        ``content + "\\n" + format_calls(calls)`` (or ``format_calls(calls)`` alone without content)."""
        out = []
        for c in calls:
            if c.error is not None:
                raise ValueError(f"tool call {c.name!r} could not be read ({c.error}); it cannot be written back")
            out.append(f'{self.OPEN}\n{{"name": {json.dumps(c.name, ensure_ascii=False)}, '
                       f'"arguments": {json.dumps(c.arguments, ensure_ascii=False)}}}\n{self.CLOSE}')
        return "\n".join(out)
