"""Read whole tensors, or ranges of rows or columns of them, from a Hugging Face safetensors checkpoint,
touching only the bytes asked for.

A safetensors file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape,
data_offsets}}) and the raw row-major data. Reads go through `os.preadv` straight into the destination
tensor: no memory map (whose pages would count towards the process's RSS and survive the read) and no
staging copy. A column range is one read per row. `bytes_read` counts every byte read, headers included,
so callers can check that a rank read its share of the checkpoint and not the whole of it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from dapo_megatron.models.hf_io import checkpoint_files

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the tensor's data in `file`."""


class SafetensorsReader:
    """Sliced reads from the safetensors files of `hf_dir`. Use as a context manager (closes the files)."""

    def __init__(self, hf_dir: Path | str) -> None:
        self.bytes_read = 0
        self._fds: dict[Path, int] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            for file in checkpoint_files(hf_dir):
                self.tensors.update(self._read_header(file))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.tensors.items()}

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Tensor `name`, or its indices [start, stop) along `dim` (the whole tensor when `dim` is None), in
        the checkpoint's dtype."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(
                f"{name!r} is not in the checkpoint (it has {len(self.tensors)} tensors); check that "
                "the model config matches the checkpoint's config.json"
            )
        shape = info.shape
        if dim is None:
            dim, start, stop = 0, 0, shape[0] if shape else 1
            shape = shape or (1,)
        stop = shape[dim] if stop is None else stop
        if not (0 <= dim < len(shape) and 0 <= start <= stop <= shape[dim]):
            raise ValueError(f"cannot read [{start}:{stop}] along dim {dim} of {name!r}, shape {info.shape}")
        out = torch.empty((*shape[:dim], stop - start, *shape[dim + 1 :]), dtype=info.dtype)
        element = out.element_size()
        inner = math.prod(shape[dim + 1 :]) * element  # bytes of one index along `dim`
        chunk = (stop - start) * inner  # bytes contiguous in the file per outer index
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        fd = self._fd(info.file)
        for outer in range(math.prod(shape[:dim])):
            position = info.offset + outer * shape[dim] * inner + start * inner
            self._pread_into(fd, buffer[outer * chunk : (outer + 1) * chunk], position)
        return out.reshape(info.shape) if dim == 0 and start == 0 and stop == shape[0] else out

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def _pread_into(self, fd: int, buffer: memoryview, position: int) -> None:
        done = 0
        while done < len(buffer):  # the kernel caps one read at ~2 GiB
            count = os.preadv(fd, [buffer[done:]], position + done)
            if count == 0:
                raise OSError(
                    f"unexpected end of file at byte {position + done}: the checkpoint is truncated"
                )
            done += count
        self.bytes_read += done

    def _read_header(self, file: Path) -> dict[str, TensorInfo]:
        fd = self._fd(file)
        size = bytearray(8)
        self._pread_into(fd, memoryview(size), 0)
        (length,) = struct.unpack("<Q", size)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{file} is not a safetensors file (header length {length})")
        header_bytes = bytearray(length)
        self._pread_into(fd, memoryview(header_bytes), 8)
        header = json.loads(header_bytes)
        header.pop("__metadata__", None)
        tensors = {}
        for name, entry in header.items():
            if entry["dtype"] not in _DTYPES:
                raise ValueError(
                    f"{file}: tensor {name!r} has dtype {entry['dtype']}, which this reader does "
                    f"not know (known: {', '.join(_DTYPES)})"
                )
            tensors[name] = TensorInfo(
                file, _DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + entry["data_offsets"][0]
            )
        return tensors
