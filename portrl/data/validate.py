"""Checks of dataset files before a run loads anything heavy (portrl.trainer.preflight).

:func:`read_verl_file` reads one verl-schema parquet the way RLDataset will and checks every row
(:func:`portrl.data.schema.check_row`, and for rows with images :func:`portrl.data.images.check_row_images`:
every image decodes, as many as ``<image>`` placeholders); :func:`count_fitting_prompts` counts prompts that fit
``max_prompt_length`` (image rows: the processor's expanded ids; stopping once enough are found);
:func:`check_sft_file` checks the columns ``portrl sft`` needs. Every problem is a :class:`~portrl.data.schema.DataError` (a user error) naming the
file, the config key or flag it came from and, for a row, its index.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from portrl.data.images import IMAGE_KEY, check_row_images, decode_image
from portrl.data.multimodal import encode_image_prompt
from portrl.data.rl_dataset import encode_messages
from portrl.data.schema import DataError, check_row
from portrl.data.table_rows import check_utf8, table_rows

VERL_COLUMNS = ("data_source", "prompt", "reward_model")
VERL_HINT = ("verl parquet has columns data_source (str), prompt (chat messages), reward_model "
             "({ground_truth}) and extra_info; `portrl preprocess` writes such files")


def _read_table(path: str | Path, key: str):
    p = Path(path)
    if not p.exists():
        raise DataError(f"{key}: dataset file {str(p)!r} does not exist")
    if not p.is_file():
        raise DataError(f"{key}: dataset file {str(p)!r} is not a file")
    try:
        return pq.read_table(p)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's input
        raise DataError(f"{p}: cannot be read as parquet ({type(exc).__name__}: {exc}); {key} takes parquet files"
                        ) from None


def _need_columns(path, table, columns, key: str, hint: str) -> None:
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DataError(f"{path} ({key}) has no column {missing[0]!r}; it has {', '.join(table.column_names) or 'none'}"
                        f"; {hint}")


def read_verl_file(path: str | Path, key: str, prompt_key: str = "prompt", image_key: str = IMAGE_KEY
                   ) -> list[tuple[list[dict], str, str, dict, list | None]]:
    """The checked rows ``(messages, data_source, ground_truth, extra_info, images)`` of one verl parquet file;
    ``images`` is None for a text row, else the row's stored images (each checked to decode)."""
    table = _read_table(path, key)
    columns = tuple(prompt_key if c == "prompt" else c for c in VERL_COLUMNS)
    _need_columns(path, table, columns, key, VERL_HINT)
    if table.num_rows == 0:
        raise DataError(f"{path} ({key}) has no rows")
    rows = []
    for i, rec in enumerate(table_rows(table, str(path))):
        checked = check_row(rec, str(path), i, prompt_key)
        rows.append((*checked, check_row_images(rec, str(path), i, checked[0], image_key)))
    return rows


def read_verl_files(files, key: str) -> tuple[list, str | None]:
    """The checked rows of several files (:func:`read_verl_file`), and where the first row with images is
    (``"FILE row N"``; None when every row is text)."""
    rows, first_image = [], None
    for f in files:
        file_rows = read_verl_file(f, key)
        if first_image is None:
            first_image = next((f"{f} row {i}" for i, r in enumerate(file_rows) if r[4] is not None), None)
        rows.extend(file_rows)
    return rows, first_image


def count_fitting_prompts(rows, tokenizer, max_prompt_length: int, enough: int, processor=None) -> int:
    """How many rows' prompts (chat template + generation prompt, as RLDataset encodes them; for a row with
    images the ``processor``'s ids, each image expanded) have at most ``max_prompt_length`` tokens; counting
    stops at ``enough``."""
    fitting = 0
    for messages, *rest in rows:
        images = rest[3] if len(rest) > 3 else None
        if images is not None:
            n = len(encode_image_prompt(processor, messages, [decode_image(im) for im in images]).ids)
        else:
            n = len(encode_messages(tokenizer, messages))
        if n <= max_prompt_length:
            fitting += 1
            if fitting >= enough:
                break
    return fitting


def check_sft_file(path: str | Path, key: str = "--train-files", prompt_key: str = "prompt",
                   response_key: str = "response") -> int:
    """The row count of one ``portrl sft`` parquet file, checked to have the prompt and response columns."""
    table = _read_table(path, key)
    _need_columns(path, table, (prompt_key, response_key), key,
                  "SFT parquet has columns prompt (chat messages) and response (str, or the conversation after "
                  "the prompt as chat messages); `portrl preprocess arith --sft` writes such files")
    if table.num_rows == 0:
        raise DataError(f"{path} ({key}) has no rows")
    check_utf8(table.select([prompt_key, response_key]), str(path))
    return table.num_rows
