"""DAPO-Math reward (verl's ``math_dapo``): +1 when the answer after the last "Answer:" is right, -1 otherwise.

DAPO-Math-17k prompts ask for a last line "Answer: $Answer". The last 300 characters are searched (as verl
does) for the last case-insensitive "Answer:" followed by text on its line or, after blank space, the next
one. The answer is right when either check says so:

* verl's: both the answer text and the ground truth, normalised as in Minerva (Lewkowycz et al. 2022: the
  text after the last "=", spaces, units and other listed words, ``\\text{}`` / ``\\textbf{}`` /
  ``\\overline{}`` / ``\\boxed{}`` wrappers and dollar signs removed, ``\\frac12`` and ``\\sqrt2`` shorthand
  braced, thousands commas of a whole number removed), are the same string;
* portrl's more lenient one: the answer (a ``\\boxed{}`` in it unwrapped) is equivalent to the ground truth by
  portrl.rewards.math_reward.answers_equiv (equal rationals, math-verify when installed). When no "Answer:"
  line exists, a last ``\\boxed{}`` is accepted instead (verl scores such a response -1).
"""

from __future__ import annotations

import re

from portrl.rewards.math_reward import answers_equiv
from portrl.rewards.text import last_boxed, tail

CLIP_CHARS = 300
_ANSWER_RE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Minerva's normalisation lists (Lewkowycz et al. 2022, appendix D).
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DROP = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
         "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
         "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
         "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
         ",\\!", "{,}", '"', "\\dots")


def minerva_normalize(answer: str) -> str:
    """A final answer in Minerva's normal form (module docstring)."""
    s = answer.split("=")[-1]
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for word in _DROP:
        s = s.replace(word, "")
    first = s.find("$")
    second = s.find("$", first + 1) if first >= 0 else -1
    if second >= 0:  # keep only the first $...$ span
        s = "$" + s[first + 1:second] + "$"
    for cmd in ("text", "textbf", "overline"):
        s = re.sub(r"\\" + cmd + r"\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\boxed\{(.*)\}", r"\1", s)
    s = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", s)
    s = re.sub(r"sqrt([^{])", r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def answer_line(solution_str: str) -> str | None:
    """The text after the last "Answer:" in the response tail (as written), or None."""
    found = _ANSWER_RE.findall(tail(solution_str, CLIP_CHARS))
    return found[-1] if found else None


def extract_answer(solution_str: str) -> str | None:
    """The text after the last "Answer:" (boxed content unwrapped), else the last \\boxed{}; or None."""
    line = answer_line(solution_str)
    if line is not None:
        pred = line.strip()
        boxed = last_boxed(pred)
        pred = (boxed if boxed is not None else pred).strip().strip("$").strip()
        return pred or None
    return last_boxed(tail(solution_str, CLIP_CHARS))


def compute_score(solution_str: str, ground_truth: str, use_math_verify: bool | None = None) -> dict:
    """{"score": +1.0 or -1.0, "acc", "pred"}."""
    line = answer_line(solution_str)
    pred = extract_answer(solution_str)
    correct = (line is not None and minerva_normalize(line) == minerva_normalize(str(ground_truth))) \
        or answers_equiv(pred, str(ground_truth), use_math_verify)
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}
