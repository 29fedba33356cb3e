"""String helpers shared by the rule rewards: bounded tails, last number, last \\boxed{...}.

Every helper runs in time linear in its input (no regex with nested quantifiers), so a
megabyte of model output cannot stall the reward worker.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A signed number with optional thousands commas and decimals: "-1,234.50", "7", ".5".
# The quantifiers are over disjoint character classes, so matching never backtracks badly.
NUMBER_RE = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def tail(text: str, max_chars: int) -> str:
    """The last ``max_chars`` characters of ``text`` (all of it when shorter)."""
    return text[-max_chars:] if len(text) > max_chars else text


def last_number(text: str) -> str | None:
    """The last number in ``text`` with thousands commas removed and a trailing '.' dropped, or None."""
    found = None
    for found in NUMBER_RE.finditer(text):
        pass
    if found is None:
        return None
    return found.group(0).replace(",", "")


def canonical_number(text: str) -> str | None:
    """``text`` as a canonical decimal string ("18.00" -> "18", "-0" -> "0", "1,000" -> "1000"), else None."""
    s = text.strip().replace(",", "").replace("$", "")
    if s.endswith("."):
        s = s[:-1]
    if not s or len(s) > 400:
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def last_boxed(text: str, commands: tuple[str, ...] = ("\\boxed", "\\fbox")) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed X``) in ``text``.

    Braces are balanced by counting; an unbalanced last box yields None. Nested boxes return the
    outermost content of the last box that opens: ``\\boxed{\\boxed{2}}`` -> ``\\boxed{2}``.
    """
    start = max(text.rfind(cmd) for cmd in commands)
    if start < 0:
        return None
    cmd = next(c for c in commands if text.startswith(c, start))
    i = start + len(cmd)
    if text.startswith(" ", i) and not text.startswith("{", i):
        # "\boxed 5": the answer runs to the next '$' or whitespace.
        rest = text[i + 1:]
        m = re.match(r"[^\s$]+", rest)
        return m.group(0) if m else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        ch = text[j]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def ground_truth_text(truth: str | int | float) -> str:
    """A ground truth as the text the rewards compare against: a float that is a whole number is written as
    an integer (a parquet float column holds 57 as 57.0, which must still score "57"); other values unchanged."""
    if isinstance(truth, float) and truth.is_integer():
        return str(int(truth))
    return str(truth)
