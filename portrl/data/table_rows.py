"""The rows of an Arrow table as Python records, with text that is not UTF-8 named instead of a traceback.

Parquet and Arrow store a ``string`` column as bytes that should be UTF-8; a writer that did not check (or a
damaged file) leaves bytes that pyarrow only rejects when a value is turned into a Python ``str``, as a bare
``UnicodeDecodeError``. :func:`table_rows` checks every string column first (``Array.validate(full=True)``,
pyarrow's UTF-8 check, in C) and names the file, the column and the first bad row in a DataError.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from portrl.errors import DataError


def _first_bad_row(column: pa.ChunkedArray) -> int:
    offset = 0
    for chunk in column.chunks:
        for i in range(len(chunk)):
            try:
                chunk[i].as_py()
            except UnicodeDecodeError:
                return offset + i
        offset += len(chunk)
    return -1


def check_utf8(table: pa.Table, where: str) -> None:
    """DataError naming the first column (and row) whose text is not valid UTF-8; nothing when all is."""
    for name in table.column_names:
        column = table.column(name)
        try:
            for chunk in column.chunks:
                chunk.validate(full=True)
        except pa.ArrowInvalid:
            row = _first_bad_row(column)
            at = f"row {row}: " if row >= 0 else ""
            raise DataError(f"{where}: {at}column {name!r} holds text that is not valid UTF-8; re-encode the "
                            "file (text columns must be UTF-8)") from None


def table_rows(table: pa.Table, where: str) -> list[dict[str, Any]]:
    """``table.to_pylist()`` after :func:`check_utf8`; ``where`` (the file) names it in errors."""
    check_utf8(table, where)
    return table.to_pylist()


__all__ = ["check_utf8", "table_rows"]
