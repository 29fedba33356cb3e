"""MATH raw rows ({"problem", "solution" with \\boxed{}, "level", "type"}) -> verl rows.

data_source DigitalLearningGmbH/MATH-lighteval (verl's name); the prompt is the problem, a space
and MATH_INSTRUCTION; the ground truth is the content of the solution's last \\boxed{}. A solution
without a box is skipped (counted in the log). ``max_level`` keeps problems of "Level k", k <= it.
"""

from __future__ import annotations

import logging

from portrl.data.schema import MATH_INSTRUCTION, DataError, field, make_row
from portrl.rewards.text import last_boxed

log = logging.getLogger(__name__)
DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"


def level_number(level: str | None) -> int | None:
    """"Level 3" -> 3; None (or "Level ?") -> None."""
    if not level:
        return None
    digits = "".join(ch for ch in str(level) if ch.isdigit())
    return int(digits) if digits else None


def convert(records: list[tuple[str, int, dict]], split: str, max_level: int | None = None) -> list[dict]:
    """verl rows from (file, row index, raw record) triples."""
    if max_level is not None and not 1 <= max_level <= 5:
        raise DataError(f"MATH difficulty (highest level kept) must be 1..5, got {max_level}")
    rows: list[dict] = []
    no_box, too_hard = 0, 0
    for where, i, rec in records:
        problem = field(rec, "problem", where, i)
        solution = field(rec, "solution", where, i)
        level, kind = rec.get("level"), rec.get("type")
        for name, value in (("level", level), ("type", kind)):
            if value is not None and not isinstance(value, str):
                raise DataError(f"{where}: row {i}: field {name!r} must be str, got {type(value).__name__}")
        lvl = level_number(level)
        if max_level is not None and (lvl is None or lvl > max_level):
            too_hard += 1
            continue
        truth = last_boxed(solution)
        if truth is None:
            no_box += 1
            continue
        rows.append(make_row(DATA_SOURCE, problem + " " + MATH_INSTRUCTION, truth.strip(), split, len(rows),
                             level=level or "", type=kind or ""))
    if no_box or too_hard:
        log.info("MATH %s: skipped %d rows without a \\boxed{} answer and %d above the level limit",
                 split, no_box, too_hard)
    return rows
