"""Symbolic and numeric equivalence of final math answers: the graders behind verl's ``prime_math`` (NuminaMath
sources) and ``geo3k`` rewards, written for portrl.

Two rules, both 1/0 verdicts on two answer strings (a prediction and a ground truth):

* :func:`grade_answer` (the PRM800K grading rule verl's geo3k and prime_math use first): equal after
  normalisation, or, element by element for tuples and intervals, equal as expressions. Two deliberate
  strictnesses of that rule are kept: an integer ground truth needs an integer answer (``\\frac{6}{2}`` is not
  ``3``), and two plain fractions ``a/b`` must be written the same (``2/4`` is not ``1/2``).
* :func:`math_equal` (the rule prime_math tries when the first fails): numbers equal within a relative
  tolerance of 1e-4, also against the ground truth times or divided by 100 (a percentage written either way:
  ``50`` scores ``0.5``, as in verl); tuples element-wise; else equal as expressions, or numerically
  equal when both are constants.

"Equal as expressions" is math-verify's verdict when it is installed (``pip install 'portrl[math]'``), or
sympy's (``simplify(a - b) == 0`` on a small LaTeX-to-sympy translation, verl's own check); without either only
the string and number checks above decide (sympy is imported lazily; it comes with torch, so it is normally
present; which one is used is logged once). Expressions are translated from a whitelist of LaTeX
(``\\frac``, ``\\sqrt``, ``\\pi``, ``\\cdot``, ``^``, ...); only expressions with at most two unknown letters,
at most 200 characters and small exponents reach sympy (no other text is parsed), and math-verify sees answers of
at most 200 characters without powers in exponents, so one check stays bounded on any model output.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import re
import warnings

from portrl.rewards.math_normalize import normalize
from portrl.rewards.math_reward import math_verify_available, math_verify_equiv

MAX_EXPR_CHARS = 200
REL_TOL = 1e-4
FUNCTIONS = ("sqrt", "pi", "sin", "cos", "tan", "log", "ln", "exp")  # FUNCTIONS[2:]: also \sin ... commands
_UNITS = ("degree", "centimeter", "cm", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard", "liter")
_UNIT_RE = re.compile(r"(?:" + "|".join(_UNITS) + r")(?:es)?s? *(?:\^[0-9]+)?")
_THOUSANDS_RE = re.compile(r"(\d),(\d\d\d)(?=$|\D)")
_PLAIN_FRACTION_RE = re.compile(r"^-?[0-9]+\.?/0*[1-9][0-9]*\.?$")
_IDENT_RE = re.compile(r"[A-Za-z]+")
_ALLOWED_RE = re.compile(r"^[0-9A-Za-z+\-*/().\s]*$")
_BIG_POWER_RE = re.compile(r"\*\*\s*\(?\s*[0-9]{3,}")
_ATTRIBUTE_RE = re.compile(r"\.\s*[A-Za-z_]")  # "x.n(...)" would call a method of the parsed object
MAX_EXPONENT = 100
_COSTLY_RE = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\(?\{?\s*\d{3,}")  # a power in an exponent; 3-digit exponents

_HAVE_SYMPY: bool | None = None
_said_which = False
log = logging.getLogger(__name__)


def sympy_available() -> bool:
    global _HAVE_SYMPY
    if _HAVE_SYMPY is None:
        _HAVE_SYMPY = importlib.util.find_spec("sympy") is not None
    return _HAVE_SYMPY


# ---------------------------------------------------------------- LaTeX -> sympy text

def _group(s: str, i: int) -> tuple[str, int] | None:
    """The argument of a LaTeX command starting at ``s[i]`` (a braced group or one character) and the index
    after it; None when there is none or the braces do not balance."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None
    if s[i] != "{":
        return (s[i], i + 1) if s[i] not in "}\\" else None
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return s[i + 1:j], j + 1
    return None


def latex_to_expr_text(answer: str) -> str | None:
    """``answer`` as text sympy's parser reads (``\\frac{a}{b}`` -> ``((a)/(b))``, a fraction of two integers
    -> ``a/b``, ``\\sqrt[n]{x}``, ``\\pi``, ``\\cdot``, ``^``), or None when it holds anything else."""
    s = answer.strip()
    if len(s) > MAX_EXPR_CHARS:
        return None
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""),
                     ("\\displaystyle", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""), ("$", ""),
                     ("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\\pi", " pi "), ("^\\circ", ""),
                     ("^{\\circ}", ""), *((f"\\{name}", f" {name}") for name in FUNCTIONS[2:])):
        s = s.replace(old, new)
    out: list[str] = []
    i = 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num = _group(s, i + 5)
            den = _group(s, num[1]) if num else None
            if num is None or den is None:
                return None
            a, b = latex_to_expr_text(num[0]), latex_to_expr_text(den[0])
            if a is None or b is None:
                return None
            plain = re.fullmatch(r"-?\d+", a.strip()) and re.fullmatch(r"\d+", b.strip())
            out.append(f"{a.strip()}/{b.strip()}" if plain else f"(({a})/({b}))")
            i = den[1]
        elif s.startswith("\\sqrt", i):
            j = i + 5
            index = None
            if s.startswith("[", j):
                close = s.find("]", j)
                if close < 0:
                    return None
                index, j = latex_to_expr_text(s[j + 1:close]), close + 1
            arg = _group(s, j)
            if arg is None:
                return None
            inner = latex_to_expr_text(arg[0])
            if inner is None:
                return None
            out.append(f"sqrt({inner})" if index is None else f"(({inner})**(1/({index})))")
            i = arg[1]
        elif s[i] == "\\":
            return None  # a command outside the whitelist
        else:
            out.append({"{": "(", "}": ")", "^": "**"}.get(s[i], s[i]))
            i += 1
    text = "".join(out).strip()
    return text if _ALLOWED_RE.match(text) else None


def _sympy_expr(text: str):
    """The sympy expression of whitelisted text, or None when it is not safe or not parsable."""
    if not text or len(text) > MAX_EXPR_CHARS or text.count("**") > 3 or _BIG_POWER_RE.search(text) \
            or _ATTRIBUTE_RE.search(text):
        return None
    letters = set()
    for word in _IDENT_RE.findall(text):
        if word in FUNCTIONS:
            continue
        if len(word) != 1:
            return None  # unknown words are text, not expressions
        letters.add(word)
    if len(letters) > 2:
        return None
    import sympy  # noqa: PLC0415  (sympy: only for symbolic answers)
    from sympy.parsing import sympy_parser  # noqa: PLC0415  (sympy: only for symbolic answers)

    local = {name: sympy.Symbol(name) for name in letters}  # "E", "I", "N", "S" stay plain symbols
    local.update({"ln": sympy.log, "pi": sympy.pi})
    transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    try:
        with warnings.catch_warnings():  # odd input makes sympy warn about deprecated forms: not the user's concern
            warnings.simplefilter("ignore")
            return _checked_parse(text, local, transformations)
    except Exception:  # noqa: BLE001 - any parser failure means "not an expression"
        return None


def _checked_parse(text: str, local: dict, transformations: tuple):
    import sympy  # noqa: PLC0415  (sympy: only for symbolic answers)
    from sympy.parsing import sympy_parser  # noqa: PLC0415  (sympy: only for symbolic answers)

    tree = sympy_parser.parse_expr(text, local_dict=local, transformations=transformations, evaluate=False)
    if not isinstance(tree, sympy.Expr):
        return None  # a tuple, a function object, ...
    for power in tree.atoms(sympy.Pow):  # 99^(99^99) would never finish evaluating
        exponent = power.exp
        if any(inner.exp != -1 for inner in exponent.atoms(sympy.Pow)):  # 1/3 is 3^-1: allowed
            return None
        if exponent.is_number and abs(complex(exponent)) > MAX_EXPONENT:
            return None
    expr = sympy_parser.parse_expr(text, local_dict=local, transformations=transformations)
    return expr if isinstance(expr, sympy.Expr) else None


def sympy_equal(a: str, b: str, numeric_tol: float | None = None) -> bool:
    """True when the LaTeX answers ``a`` and ``b`` are equal under sympy (``simplify(a - b) == 0``), or, with
    ``numeric_tol``, when both are constants whose values agree within that relative tolerance."""
    if not sympy_available():
        return False
    ta, tb = latex_to_expr_text(a), latex_to_expr_text(b)
    if ta is None or tb is None:
        return False
    ea, eb = _sympy_expr(ta), _sympy_expr(tb)
    if ea is None or eb is None:
        return False
    import sympy  # noqa: PLC0415  (sympy: only for symbolic answers)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            diff = ea - eb
            if diff == 0 or sympy.simplify(diff) == 0:
                return True
            if numeric_tol is not None and not ea.free_symbols and not eb.free_symbols:
                va, vb = complex(sympy.N(ea)), complex(sympy.N(eb))
                return va.imag == vb.imag == 0 and math.isclose(va.real, vb.real, rel_tol=numeric_tol)
    except Exception:  # noqa: BLE001 - sympy raises many kinds on odd input: not shown equal
        return False
    return False


def math_verify_equal(given: str, truth: str) -> bool:
    """math-verify's verdict; False when it is not installed, and for answers over MAX_EXPR_CHARS or with a
    power in an exponent or a three-digit exponent (math-verify would spend its whole timeout on them)."""
    if not math_verify_available() or len(given) > MAX_EXPR_CHARS or len(truth) > MAX_EXPR_CHARS:
        return False
    if _COSTLY_RE.search(given) or _COSTLY_RE.search(truth):
        return False
    return math_verify_equiv(given, truth)


def expressions_equal(a: str, b: str, numeric_tol: float | None = None,
                      written: tuple[str, str] | None = None) -> bool:
    """Equal as expressions: math-verify (on ``written``, the answers as written, when given) or sympy."""
    global _said_which
    if not _said_which:
        _said_which = True
        if not math_verify_available():
            log.info("math-verify is not installed: answers are compared as expressions with %s "
                     "(pip install 'portrl[math]' adds math-verify)",
                     "sympy" if sympy_available() else "string and number checks only (no sympy either)")
    if math_verify_equal(*(written or (a, b))):
        return True
    return sympy_equal(a, b, numeric_tol)


# ---------------------------------------------------------------- the two grading rules

def _strip_thousands(s: str) -> str:
    while True:
        new = _THOUSANDS_RE.sub(r"\1\2", s)
        if new == s:
            return s
        s = new


def as_number(s: str) -> float | None:
    """The value of a plain decimal number (thousands commas and ``{,}`` allowed), else None."""
    text = _strip_thousands(s.strip().replace("{,}", ""))
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _is_integer_text(s: str) -> bool:
    value = as_number(s)
    return value is not None and abs(value - round(value)) <= 1e-7


def plain_form(answer: str) -> str:
    """An answer without its wrapping (``\\text{}``, ``$``, ``%``, units, degrees, outer braces), LaTeX turned
    into sympy text where it translates, spaces removed, lower case; a whole number as an integer."""
    s = answer.strip()
    m = re.fullmatch(r"\\text\{(.+?)\}", s)
    if m:
        s = m.group(1)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = s.replace(" or ", " , ").replace(" and ", " , ")
    s = _UNIT_RE.sub("", s)
    s = re.sub(r"\^ *\\circ|\^\{\\circ\}", "", s)
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
    s = re.sub(r",\\! *", "", s)
    if "\\" in s:
        s = latex_to_expr_text(s) or s
    s = s.replace(" ", "").replace("{", "").replace("}", "").lower()
    value = as_number(s) if _is_integer_text(s) else None
    if value is not None:
        s = str(round(value))
    return s


def split_elements(s: str) -> list[str]:
    """The elements of a tuple or interval written ``(a, b)`` / ``[a, b)`` (one element otherwise)."""
    s = _strip_thousands(s)
    if len(s) > 2 and s[0] in "([" and s[-1] in ")]" and not any(ch in s[1:-1] for ch in "()[]"):
        return [part.strip() for part in s[1:-1].split(",")]
    return [s] if s else []


def grade_answer(given: str | None, truth: str) -> bool:
    """The PRM800K rule (module docstring): normalised strings equal, or every element equal as expressions,
    with an integer needing an integer and plain fractions needing the same fraction."""
    if given is None:
        return False
    truth = str(truth)
    if normalize(given) == normalize(truth) and normalize(truth) != "":
        return True
    t, g = plain_form(truth), plain_form(given)
    if t == g:
        return True
    if not g:
        return False
    t_parts, g_parts = split_elements(t), split_elements(g)
    if len(t_parts) != len(g_parts) or (len(t_parts) > 1 and (t[0] != g[0] or t[-1] != g[-1])):
        return False
    for tp, gp in zip(t_parts, g_parts):
        if _PLAIN_FRACTION_RE.match(tp) and _PLAIN_FRACTION_RE.match(gp):
            ok = tp == gp  # an unreduced fraction is not the reduced one
        elif _is_integer_text(tp) != _is_integer_text(gp):
            ok = False  # an integer answer must be written as an integer
        else:
            ok = expressions_equal(gp, tp, written=(given, truth) if len(t_parts) == 1 else None)
        if not ok:
            return False
    return True


def numbers_close(given: str, truth: str, percentage: bool = True, rel_tol: float = REL_TOL) -> bool | None:
    """For two plain numbers: equal within ``rel_tol`` (also to the truth x100 and /100 with ``percentage``);
    None when either is not a plain number. ``$5`` and ``5%`` count as plain numbers."""
    def number(s: str) -> float | None:
        s = s.strip()
        if re.match(r"^\$\d+(\.\d+)?", s):
            s = s[1:]
        s = re.sub(r"^(\d+(?:\.\d+)?)\\?%$", r"\1", s)
        return as_number(s)

    g, t = number(given), number(truth)
    if g is None or t is None:
        return None
    targets = (t / 100, t, t * 100) if percentage else (t,)
    return any(math.isclose(x, g, rel_tol=rel_tol) for x in targets)


def math_equal(given: str | None, truth: str, depth: int = 0) -> bool:
    """prime_math's second rule (module docstring): numbers within 1e-4 (percentages either way), tuples and
    intervals element-wise, else equal as expressions or as constant values."""
    if given is None:
        return False
    given, truth = given.strip(), str(truth).strip()
    if given.lower() == truth.lower() or given.replace(" ", "") == truth.replace(" ", ""):
        return True
    close = numbers_close(given, truth)
    if close is not None:
        return close
    if not given:
        return False
    if depth < 2 and len(given) > 1 and given[0] in "([" and given[-1] in ")]" and given[0] == truth[:1] \
            and given[-1] == truth[-1:]:
        g_parts, t_parts = given[1:-1].split(","), truth[1:-1].split(",")
        if len(g_parts) == len(t_parts) and all(math_equal(g, t, depth + 1) for g, t in zip(g_parts, t_parts)):
            return True
    if depth < 2 and "," in given and "," in truth:
        g_parts, t_parts = given.split(","), truth.split(",")
        if len(g_parts) == len(t_parts):
            return all(math_equal(g, t, depth + 1) for g, t in zip(g_parts, t_parts))
    g_bare, t_bare = given, truth
    if (given[0] == "[" and given[-1] == "]" and not truth.startswith("(")) or \
            (given[0] == "(" and given[-1] == ")" and not truth.startswith("[")):
        g_bare, t_bare = given.strip("[]()"), truth.strip("[]()")
    if re.sub(r"[{}()]", "", g_bare) == re.sub(r"[{}()]", "", t_bare):
        return True
    return expressions_equal(given, truth, numeric_tol=REL_TOL)
