"""Prompt files: parquet (pyarrow) and JSON lines, read into PromptRecords.

Every problem is reported with the file and where in it: `line N` (from 1, as an editor counts)
for JSON lines, `row N` (from 0, as pandas' iloc counts) for parquet, `element N` for a .json
array. A broken row stops the load, or with on_bad_row="skip" is dropped and counted; a file
that cannot be read at all (missing, not parquet, a truncated JSON array, no prompt column)
always stops it, since skipping it would silently drop a whole source.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Iterator

from .records import BadRow, DataError, PromptRecord, record_from_row

logger = logging.getLogger(__name__)

# Columns a record is built from; parquet reads only these (other columns can be large).
RECORD_COLUMNS = ("data_source", "reward_model", "extra_info")

# (where, row) pairs; `row` is a BadRow when the row could not even be parsed.
Rows = Iterator[tuple[str, Any]]


def read_prompt_file(path: str, prompt_key: str, on_bad_row: str,
                     start_index: int = 0) -> tuple[list[PromptRecord], int]:
    """The records of one file, indexed from `start_index`, and the number of rows skipped
    (always 0 unless on_bad_row == "skip"). Raises DataError naming the file and row."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: prompt file not found")
    records, skipped, seen = [], 0, 0
    required = {prompt_key: "set data.prompt_key to the prompt column",
                "data_source": "the reward is chosen by it"}
    for where, row in iter_rows(path, (prompt_key,) + RECORD_COLUMNS, required):
        seen += 1
        try:
            if isinstance(row, BadRow):
                raise row
            records.append(record_from_row(row, prompt_key, start_index + len(records)))
        except BadRow as problem:
            if on_bad_row != "skip":
                raise DataError(f"{where}: {problem}") from None
            if not skipped:
                logger.warning("skipping bad rows of %s (data.on_bad_row=skip), the first: "
                               "%s: %s", path, where, problem)
            skipped += 1
    if not seen:
        raise DataError(f"{path}: the file has no rows")
    return records, skipped


def iter_rows(path: str, columns: tuple[str, ...], required: dict[str, str]) -> Rows:
    """(where, row) pairs of a parquet, JSON-lines or JSON-array file. Parquet reads only
    `columns` and fails fast when one of `required` (column -> why it is needed) is missing;
    JSON rows are checked by the caller."""
    if path.lower().endswith(".parquet"):
        return _parquet_rows(path, columns, required)
    if path.lower().endswith(".json") and _starts_with(path, b"["):
        return _json_array_rows(path)
    return _json_lines_rows(path)


def _parquet_rows(path: str, columns: tuple[str, ...], required: dict[str, str]) -> Rows:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"{path}: not a readable parquet file: {error}") from None
    names = parquet.schema_arrow.names
    for column, why in required.items():
        if column not in names:
            raise DataError(f"{path}: no {column!r} column (columns: {names}); {why}")
    present = [name for name in columns if name in names]
    row_number = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=present):
        for row in batch.to_pylist():
            yield f"{path} row {row_number}", row
            row_number += 1


def _json_lines_rows(path: str) -> Rows:
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            where = f"{path} line {line_number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield where, BadRow(f"not UTF-8: {error}")
                continue
            if not text.strip():
                continue  # blank lines (a trailing newline) are not rows
            try:
                yield where, json.loads(text)
            except json.JSONDecodeError as error:
                yield where, BadRow(f"malformed JSON: {error}")


def _json_array_rows(path: str) -> Rows:
    try:
        with open(path, encoding="utf-8") as handle:
            rows = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: malformed JSON array: {error} (JSON lines, one row per "
                        "line, let bad rows be skipped)") from None
    for position, row in enumerate(rows):
        yield f"{path} element {position}", row


def _starts_with(path: str, prefix: bytes) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4096).lstrip().startswith(prefix)
