"""verl's parquet row schema, and the check of one row.

A row: ``data_source`` (str, picks the reward), ``prompt`` (list of chat messages
``{"role", "content"}``), ``ability`` (str), ``reward_model`` (``{"style": "rule", "ground_truth": str}``),
``extra_info`` (dict with at least ``split`` and ``index``).
"""

from __future__ import annotations

import math
from typing import Any

from portrl.errors import DataError  # noqa: F401  (the readers' error, named here too)
from portrl.rewards.search_qa import SEARCH_QA_SOURCES, target_text
from portrl.rewards.text import ground_truth_text

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


class MissingDataFile(DataError, FileNotFoundError):
    """A dataset file that was named does not exist."""


def field(record: dict, name: str, where: str, index: int, kind: type = str):
    """``record[name]`` checked to be a ``kind``; DataError naming the file, row and field."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: row {index}: is a {type(record).__name__}, expected a record")
    value = record.get(name)
    if value is None:
        raise DataError(f"{where}: row {index}: field {name!r} is missing")
    if not isinstance(value, kind):
        raise DataError(f"{where}: row {index}: field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def make_row(data_source: str, content: str, ground_truth: str, split: str, index: int, ability: str = "math",
             **extra_info: Any) -> dict:
    """One verl-schema row whose prompt is a single user message."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": str(ground_truth)},
        "extra_info": {"split": split, "index": int(index), **extra_info},
    }


def check_row(row: Any, where: str, index: int, prompt_key: str = "prompt") -> tuple[list[dict], str, str, dict]:
    """(messages, data_source, ground_truth, extra_info) of a verl row; DataError naming the bad field.

    ``where`` is the file name. A numeric ground truth is accepted and turned into a string as the number it
    is (:func:`ground_truth_text`: 57.0 -> "57"); a NaN or empty ground truth is a DataError naming the row.
    """
    def bad(field: str, why: str) -> DataError:
        return DataError(f"{where}: row {index}: field {field!r} {why}")

    if not isinstance(row, dict):
        raise bad("<row>", f"is a {type(row).__name__}, expected a record")
    for key in ("data_source", prompt_key, "reward_model"):
        if row.get(key) is None:
            raise bad(key, "is missing")
    source = row["data_source"]
    if not isinstance(source, str) or not source:
        raise bad("data_source", f"must be a non-empty string, got {type(source).__name__}")
    messages = row[prompt_key]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise bad(prompt_key, f"must be a non-empty list of chat messages, got {type(messages).__name__}")
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise bad(f"{prompt_key}[{j}]", "must be a message {'role': str, 'content': str}")
    reward = row["reward_model"]
    if not isinstance(reward, dict):
        raise bad("reward_model", f"must be a struct with ground_truth, got {type(reward).__name__}")
    truth = reward.get("ground_truth")
    if truth is None:
        raise bad("reward_model.ground_truth", "is missing")
    if isinstance(truth, dict) and source in SEARCH_QA_SOURCES:  # {"target": [answers]} (rewards.search_qa)
        try:
            truth = target_text(truth)
        except ValueError as e:
            raise bad("reward_model.ground_truth", str(e)) from None
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise bad("reward_model.ground_truth", f"must be a string or a number, got {type(truth).__name__}")
    if isinstance(truth, float) and not math.isfinite(truth):
        raise bad("reward_model.ground_truth", f"is {'NaN' if math.isnan(truth) else truth} (not an answer); "
                                               "fix or drop the row")
    if isinstance(truth, str) and not truth.strip():
        raise bad("reward_model.ground_truth", "is empty; every row needs the answer it is scored against")
    extra = row.get("extra_info")
    if extra is None:
        extra = {}
    elif not isinstance(extra, dict):
        raise bad("extra_info", f"must be a struct, got {type(extra).__name__}")
    return [{"role": m["role"], "content": m["content"]} for m in messages], source, ground_truth_text(truth), dict(extra)
