"""The built-in ``calculator`` tool: evaluates an arithmetic expression exactly, safely (no ``eval``).

Accepted: numbers (ints of any size up to :data:`MAX_DIGITS` digits, floats), ``+ - * / // % **``, unary ``-`` and
``+``, parentheses. Ints stay exact: ``/`` of two ints that divide evenly is an int, else a float. Refused, with
an error message for the model: anything else (names, calls, ``^`` -- with a hint to use ``**``), a power whose
result would pass :data:`MAX_DIGITS` digits (found before computing it), any result over that, a division by
zero, a float result that is not finite (overflow). The value comes back as text: ``str(int)``, ``repr(float)``.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Dict

from portrl.agent.tools.base import Tool, ToolResult

MAX_DIGITS = 4000  # below Python's int-to-str limit (4300 digits)
MAX_EXPRESSION_CHARS = 20000
_LIMIT = 10 ** MAX_DIGITS  # the smallest int with more than MAX_DIGITS digits
_LIMIT_BITS = _LIMIT.bit_length()

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}
_UNARY = (ast.USub, ast.UAdd)


class CalculatorError(ValueError):
    """An expression the calculator refuses (the message is for the model)."""


def evaluate(expression: str) -> "int | float":
    """The value of ``expression`` (module docstring); CalculatorError when it is refused."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except ValueError:  # an int literal past Python's int-to-str limit
        raise CalculatorError(f"a number has more than {MAX_DIGITS} digits") from None
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"not an arithmetic expression ({getattr(exc, 'msg', None) or exc})") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("the result is too large for a float") from None


def _eval(node: ast.AST) -> "int | float":
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        operand = _eval(node.operand)  # checked; its negation fits too
        return -operand if isinstance(node.op, ast.USub) else +operand
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if isinstance(node.op, ast.Div):
            if isinstance(left, int) and isinstance(right, int) and right != 0 and left % right == 0:
                return left // right
            return _checked(left / right)
        if type(node.op) in _BINARY:
            return _checked(_BINARY[type(node.op)](left, right))
        if isinstance(node.op, ast.BitXor):
            raise CalculatorError("'^' is not a power here: write ** (2**10)")
    raise CalculatorError(f"only numbers, + - * / // % **, and parentheses are allowed, not "
                          f"{ast.unparse(node)[:60]!r}")


def _power(base: "int | float", exponent: "int | float") -> "int | float":
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exponent > _LIMIT_BITS:  # a lower bound of the result's bits
            raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    if isinstance(exponent, int) and exponent < 0 and isinstance(base, int):
        return float(base) ** exponent
    result = base ** exponent
    if isinstance(result, complex):
        raise CalculatorError("a negative number to a fractional power is not a real number")
    return result


def _checked(value: "int | float") -> "int | float":
    if isinstance(value, int) and abs(value) >= _LIMIT:
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise OverflowError
    return value


class CalculatorTool(Tool):
    """``calculator(expression)``: the value of an arithmetic expression (module docstring). No config."""

    name = "calculator"

    def __init__(self) -> None:
        self.schema = {"type": "function", "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly (integers of any size): numbers, + - * / "
                           "// % ** and parentheses.",
            "parameters": {"type": "object", "properties": {
                "expression": {"type": "string", "description": "the expression, for example (123456789 * 987654321) - 42"}},
                "required": ["expression"]}}}

    def call(self, arguments: Dict[str, Any], row_kwargs: Dict[str, Any]) -> ToolResult:
        try:
            value = evaluate(str(arguments["expression"]))
        except CalculatorError as exc:
            return ToolResult(text=f"Error: {exc}", error=True)
        return ToolResult(text=str(value) if isinstance(value, int) else repr(value))
