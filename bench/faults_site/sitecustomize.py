"""Imported at start-up by every Python process of a fault-injection run (bench/faults.py puts this folder on
PYTHONPATH): when DAPO_FAULT_ENOSPC_DIR names a directory, writes into files under it fail with ENOSPC once
DAPO_FAULT_ENOSPC_BYTES bytes have gone through, as on a disk that fills up mid-save. Files opened through
Python's `open` (and `Path.open`, which the checkpoint writers use) are affected; nothing else is."""

from __future__ import annotations

import builtins
import errno
import io
import os
from typing import Any

_TARGET = os.environ.get("DAPO_FAULT_ENOSPC_DIR")
_REPORT = os.environ.get("DAPO_FAULT_ENOSPC_REPORT")


class _FillingDisk:
    budget = int(os.environ.get("DAPO_FAULT_ENOSPC_BYTES", "0"))


class _FullDiskFile:
    """A writable file whose writes fail once the (process-wide) byte budget is spent."""

    def __init__(self, stream: Any, path: str) -> None:
        self._stream, self._path = stream, path

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes if not isinstance(data, str) else len(data.encode())
        if size > _FillingDisk.budget:
            if _REPORT:
                with _original_open(_REPORT, "a") as report:
                    report.write(f"{os.getpid()} {self._path}\n")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)
        _FillingDisk.budget -= size
        return self._stream.write(data)

    def __enter__(self) -> _FullDiskFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stream.close()

    def __iter__(self) -> Any:
        return iter(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_original_open = io.open


def _open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    stream = _original_open(file, mode, *args, **kwargs)
    if isinstance(file, (str, os.PathLike)) and any(flag in mode for flag in "wax+"):
        path = os.path.abspath(os.fspath(file))
        if _TARGET and path.startswith(_TARGET + os.sep):
            return _FullDiskFile(stream, path)
    return stream


if _TARGET:
    io.open = builtins.open = _open
