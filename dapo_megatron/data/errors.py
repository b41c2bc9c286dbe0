"""What the prompt data sets raise: :class:`DatasetError` for a data file or row that cannot be used (the
file readers, the format parsers, tokenization and the data set's resume all raise it), and
:class:`RowProblem`, a format parser's complaint about one row that the loader turns into a
:class:`DatasetError` once it knows the file and row number."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DatasetError", "RowProblem"]


class DatasetError(ValueError):
    """A data file or row that cannot be used; the message names the file, the row and the fix."""

    def __init__(self, message: str, *, path: Path | str | None = None, row: int | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)
        self.row = row
        """1-based line for jsonl, 0-based row index for parquet, None for whole-file problems."""


class RowProblem(Exception):
    """What is wrong with one row; turned into a DatasetError once the row's location is known."""
