"""DAPO-Math-17k rows -> verl rows (data_source math_dapo).

DAPO-Math-17k is already in verl's layout: ``prompt`` (chat messages whose user turn asks for a last
line "Answer: $Answer"), ``reward_model.ground_truth``, ``extra_info.index``. Each problem appears
many times in the published parquet, so rows are deduplicated by prompt. The prompt is kept as is;
the row is rewritten with style "rule" and extra_info {split, index, source_index}. A record in the
simple form {"prompt": str, "solution"/"answer": str} is accepted too and given DAPO's instruction.
"""

from __future__ import annotations

import logging

from portrl.data.schema import DataError, make_row

log = logging.getLogger(__name__)
DATA_SOURCE = "math_dapo"
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def _prompt_text(rec: dict, where: str, i: int) -> str:
    prompt = rec.get("prompt")
    if isinstance(prompt, str):
        return DAPO_PREFIX + prompt + DAPO_SUFFIX
    if isinstance(prompt, (list, tuple)) and prompt:
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
        raise DataError(f"{where}: row {i}: field 'prompt' has no user message with string content")
    raise DataError(f"{where}: row {i}: field 'prompt' is missing or not a chat message list / string")


def _truth(rec: dict, where: str, i: int) -> str:
    reward = rec.get("reward_model")
    truth = reward.get("ground_truth") if isinstance(reward, dict) else rec.get("solution", rec.get("answer"))
    if truth is None:
        raise DataError(f"{where}: row {i}: field 'reward_model.ground_truth' is missing")
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise DataError(f"{where}: row {i}: field 'reward_model.ground_truth' must be str, got {type(truth).__name__}")
    return str(truth)


def convert(records: list[tuple[str, int, dict]], split: str) -> list[dict]:
    """verl rows from (file, row index, raw record) triples, one per distinct prompt."""
    rows: list[dict] = []
    seen: set[str] = set()
    for where, i, rec in records:
        if not isinstance(rec, dict):
            raise DataError(f"{where}: row {i}: is a {type(rec).__name__}, expected a record")
        text, truth = _prompt_text(rec, where, i), _truth(rec, where, i)
        if text in seen:
            continue
        seen.add(text)
        extra = rec.get("extra_info")
        extra = extra if isinstance(extra, dict) else {}
        rows.append(make_row(DATA_SOURCE, text, truth, split, len(rows), ability="MATH",
                             source_index=str(extra.get("index", i))))
    if len(seen) < len(records):
        log.info("DAPO-Math %s: %d duplicate rows dropped", split, len(records) - len(seen))
    return rows
