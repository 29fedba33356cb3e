"""GSM8K raw rows ({"question", "answer": "...#### 72"}) -> verl rows (data_source openai/gsm8k).

The prompt is the question, a space and GSM8K_INSTRUCTION; the ground truth is the number after
"####" with thousands commas removed. extra_info keeps the raw question and worked answer.
"""

from __future__ import annotations

from portrl.data.schema import GSM8K_INSTRUCTION, DataError, field, make_row

DATA_SOURCE = "openai/gsm8k"


def extract_ground_truth(answer: str) -> str | None:
    """The final number of a GSM8K worked answer ("... #### 1,234" -> "1234"), or None."""
    marker = answer.rfind("####")
    if marker < 0:
        return None
    value = answer[marker + 4:].strip().replace(",", "").replace("$", "")
    return value or None


def convert(records: list[tuple[str, int, dict]], split: str) -> list[dict]:
    """verl rows from (file, row index, raw record) triples."""
    rows: list[dict] = []
    for where, i, rec in records:
        question = field(rec, "question", where, i)
        answer = field(rec, "answer", where, i)
        truth = extract_ground_truth(answer)
        if truth is None:
            raise DataError(f"{where}: row {i}: field 'answer' has no '#### <number>' final answer")
        rows.append(make_row(DATA_SOURCE, question + " " + GSM8K_INSTRUCTION, truth, split, len(rows),
                             answer=answer, question=question))
    return rows
