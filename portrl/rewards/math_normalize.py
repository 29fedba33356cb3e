"""Hand-written equivalence of final math answers (the fallback when math-verify is not installed).

``normalize(s)`` rewrites an answer into a canonical string: ``\\dfrac``/``\\tfrac`` -> ``\\frac``,
``\\frac12`` -> ``\\frac{1}{2}``, ``a/b`` -> ``\\frac{a}{b}``, ``\\left``/``\\right``, ``\\text{..}``
wrappers and trailing units, degrees, percent and dollar signs, spaces, ``x = `` prefixes,
thousands separators and trailing zeros (``2.50`` -> ``2.5``) are removed. ``is_equiv(a, b)`` is
true when the canonical strings are equal or both are the same rational number (``0.5`` and
``\\frac{1}{2}``). Inputs longer than MAX_CHARS only match when identical (bounded cost).
"""

from __future__ import annotations

import re
from fractions import Fraction

from portrl.rewards.text import last_boxed

MAX_CHARS = 1000

_UNIT_WORDS = (
    "units", "unit", "sq", "square", "cubic", "degrees", "degree", "cm", "mm", "km", "m", "meters", "meter",
    "inches", "inch", "in", "feet", "foot", "ft", "yards", "miles", "mph", "hours", "hour", "minutes", "minute",
    "seconds", "second", "days", "day", "weeks", "years", "dollars", "dollar", "cents", "cent", "pounds", "lbs",
    "kg", "g", "grams", "liters", "ml", "points", "ways", "students", "people", "books", "apples",
)
_UNIT_RE = re.compile(r"^([-+\d.,/{}\\a-z]*?\d\}?)\s*(?:" + "|".join(_UNIT_WORDS)
                      + r")(?:\^\{?[23]\}?)?\.?$")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_TRAILING_TEXT_RE = re.compile(r"\\(?:text|mbox)\s*\{\s+[^{}]*\}\s*$")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*(\d|\{[^{}]*\})\s*(\d|\{[^{}]*\})")
_SQRT_SHORT_RE = re.compile(r"\\sqrt\s*(\d|[a-z])")
_SLASH_FRAC_RE = re.compile(r"^(-?\d+)/(\d+)$")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL_RE = re.compile(r"\d*\.\d+")
_FRAC_VALUE_RE = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")


def _braced(arg: str) -> str:
    return arg if arg.startswith("{") else "{" + arg + "}"


def _trim_decimal(m: re.Match) -> str:
    s = m.group(0)
    if s.startswith("."):
        s = "0" + s
    s = s.rstrip("0").rstrip(".")
    return s or "0"


def normalize(answer: str) -> str:
    """The canonical string form of one final answer (see the module docstring)."""
    s = str(answer).strip()
    if len(s) > MAX_CHARS:
        return s
    s = s.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", " ")
    s = s.replace("{,}", "")
    s = re.sub(r"\\+\s*$", "", s)  # a stray trailing backslash
    if s.startswith(("\\boxed", "\\fbox")):
        s = last_boxed(s) or s
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("°", "").replace("\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    without_units = _TRAILING_TEXT_RE.sub("", s).strip()
    if without_units:  # "5\text{ cm}" -> "5", but "\text{ 7 }" alone is the answer itself
        s = without_units
    for _ in range(3):  # \text{\textbf{x}} unwraps in two passes
        s = _TEXT_CMD_RE.sub(r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    if "=" in s:
        lhs, _, rhs = s.partition("=")
        if len(lhs.strip()) <= 2 and "=" not in rhs:
            s = rhs.strip()
    m = _UNIT_RE.match(s)
    if m:
        s = m.group(1)
    s = s.replace(" ", "")
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    s = _FRAC_SHORT_RE.sub(lambda m: "\\frac" + _braced(m.group(1)) + _braced(m.group(2)), s)
    s = _SQRT_SHORT_RE.sub(lambda m: "\\sqrt{" + m.group(1) + "}", s)
    m = _SLASH_FRAC_RE.match(s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    s = _DECIMAL_RE.sub(_trim_decimal, s)
    if s.startswith("+"):
        s = s[1:]
    if s.startswith("{") and s.endswith("}") and s.count("{") == 1:
        s = s[1:-1]
    return s


def rational_value(canonical: str) -> Fraction | None:
    """The exact value of a canonical answer that is an integer, a decimal or \\frac{p}{q}; else None."""
    s = canonical
    if len(s) > 60:
        return None
    try:
        if re.fullmatch(r"-?\d+(?:\.\d+)?", s):
            return Fraction(s)
        m = _FRAC_VALUE_RE.match(s)
        if m and int(m.group(3)) != 0:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if s.startswith("-\\frac"):
            inner = rational_value(s[1:])
            return -inner if inner is not None else None
    except (ValueError, ZeroDivisionError):
        return None
    return None


def is_equiv(prediction: str | None, ground_truth: str) -> bool:
    """True when two final answers are the same after normalisation (string or rational value)."""
    if prediction is None:
        return False
    if prediction.strip() == str(ground_truth).strip():
        return True
    a, b = normalize(prediction), normalize(ground_truth)
    if a == b and a != "":
        return True
    va, vb = rational_value(a), rational_value(b)
    return va is not None and va == vb
