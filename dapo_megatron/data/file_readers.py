"""Reading the rows of a data file, one undecoded payload at a time, before any format is applied.

``.jsonl`` (one JSON object per line; blank lines are ignored) and ``.parquet`` files are read. Rows are
numbered like an editor does for jsonl (line 1 is the first line) and from 0 for parquet (the index pandas
and pyarrow show), and every error names the file and that number. :data:`READERS` maps a file suffix to
its reader and the word for its row numbers; :func:`as_object` decodes one payload into a row's fields.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dapo_megatron.data.errors import DatasetError, RowProblem

__all__ = ["READERS", "as_object", "check_file"]


@dataclass(frozen=True)
class _JsonLine:
    """An undecoded jsonl line: decoding happens per row so a bad line can be skipped and counted."""

    data: bytes


def _jsonl_rows(path: Path) -> Iterator[tuple[int, _JsonLine]]:
    try:
        with path.open("rb") as handle:
            for line_number, data in enumerate(handle, start=1):
                if data.strip():
                    yield line_number, _JsonLine(data)
    except OSError as error:
        raise DatasetError(f"{path}: cannot read the file ({error}).", path=path) from error


def _parquet_rows(path: Path) -> Iterator[tuple[int, object]]:
    index = 0
    try:
        # Streamed in batches: the public DAPO-Math-17k parquet has 1.79M rows, ~99% duplicates,
        # and only the unique ones should ever be held in memory.
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                yield index, row
                index += 1
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(
            f"{path}: cannot read parquet data after row {index} ({error}). "
            "Fix: re-download or re-create the file (tools/prepare_data.py).",
            path=path,
        ) from error


READERS: dict[str, tuple[Callable[[Path], Iterator[tuple[int, object]]], str]] = {
    ".jsonl": (_jsonl_rows, "line"),
    ".parquet": (_parquet_rows, "row"),
}


def check_file(path: Path) -> None:
    if not path.exists():
        raise DatasetError(
            f"{path}: no such file (relative paths start at {Path.cwd()}). Fix: correct the "
            "path, or download the public data sets with tools/prepare_data.py.",
            path=path,
        )
    if not path.is_file():
        raise DatasetError(f"{path}: is not a file; list the data files themselves.", path=path)
    if path.suffix not in READERS:
        raise DatasetError(
            f"{path}: unsupported file type {path.suffix!r}; expected one of {sorted(READERS)}.", path=path
        )


def as_object(payload: object) -> Mapping[str, Any]:
    if isinstance(payload, _JsonLine):
        try:
            payload = json.loads(payload.data.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise RowProblem(f"is not UTF-8 text ({error.reason} at byte {error.start})") from None
        except json.JSONDecodeError as error:
            raise RowProblem(
                f"is not valid JSON ({error.msg} at column {error.colno}); each line of a "
                ".jsonl file must be one complete JSON object"
            ) from None
        except (ValueError, RecursionError) as error:  # a number of over 4300 digits, absurd nesting
            raise RowProblem(f"cannot be decoded as JSON ({error})") from None
    if not isinstance(payload, Mapping):
        raise RowProblem(f"is a JSON {type(payload).__name__}, not an object with named fields")
    return payload
