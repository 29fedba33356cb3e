"""Search-R1 question-answering reward (verl's ``search_r1_like_qa_em``, data_source ``searchR1_*``): exact
match of the last ``<answer>...</answer>`` with any of the gold answers.

Both sides are normalised as in SQuAD's evaluation (lower case, punctuation removed, the articles a / an / the
removed, whitespace collapsed). Score 1.0 on a match, 0.25 on a match in a response holding more than ten
``<answer>`` or ``</answer>`` tags (verl's guard against spraying answers), 0.0 otherwise (also with no answer).

The gold answers are the ground truth's ``target``: verl rows hold ``{"target": [...]}``; portrl also takes
that struct as JSON text (as portrl.data.schema passes it on), a list of answers, or one answer as a string.
"""

from __future__ import annotations

import json
import re
import string
from typing import Any

SEARCH_QA_SOURCES = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")  # verl's names
MAX_TAGS = 10
SPRAY_FACTOR = 0.25
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = str(text).lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def extract_answer(response: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>``, or None."""
    found = None
    for found in _ANSWER_RE.finditer(response):
        pass
    return found.group(1).strip() if found else None


def gold_answers(ground_truth: Any) -> list[str]:
    """The gold answers of a ground truth (module docstring for the forms); ValueError for another shape."""
    truth = ground_truth
    if isinstance(truth, str):
        try:
            parsed = json.loads(truth) if truth.lstrip().startswith("{") else None
        except ValueError:
            parsed = None
        if not (isinstance(parsed, dict) and "target" in parsed):
            return [truth]  # one answer, written as it is
        truth = parsed
    if isinstance(truth, dict):
        if "target" not in truth:
            raise ValueError(f"search QA ground truth needs a 'target' list of answers, got keys {sorted(truth)}")
        truth = truth["target"]
    if isinstance(truth, str):
        return [truth]
    if hasattr(truth, "tolist"):  # a numpy array, as pandas reads a parquet list
        truth = truth.tolist()
    if isinstance(truth, (list, tuple)) and truth and all(isinstance(t, (str, int, float)) for t in truth):
        return [str(t) for t in truth]
    raise ValueError("search QA ground truth must be {'target': [answers]} (at least one), a list or a string, "
                     f"got {ground_truth!r:.80}")


def target_text(ground_truth: dict) -> str:
    """A ``{"target": [answers]}`` ground truth as the JSON text the reward reads back (a row's ground truth
    travels as text); ValueError naming what is wrong."""
    return json.dumps({"target": gold_answers(ground_truth)})


def compute_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> dict:
    """{"score", "acc", "pred"}."""
    pred = extract_answer(solution_str)
    if pred is None:
        return {"score": 0.0, "acc": 0.0, "pred": None}
    want = normalize_answer(pred)
    correct = any(normalize_answer(g) == want for g in gold_answers(ground_truth))
    if not correct:
        return {"score": float(format_score), "acc": 0.0, "pred": pred}
    sprayed = solution_str.count("<answer>") > MAX_TAGS or solution_str.count("</answer>") > MAX_TAGS
    return {"score": float(score) * (SPRAY_FACTOR if sprayed else 1.0), "acc": 1.0, "pred": pred}
