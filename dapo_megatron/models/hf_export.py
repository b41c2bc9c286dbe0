"""Write Hugging Face model directories tensor by tensor, with a bounded memory peak, published atomically.

Used by the offline converter (tools/convert_megatron_to_hf.py) and by the in-training export
(`weights.export_hf`). The pieces:

* `ShardWriter` takes tensors one at a time and writes a safetensors shard whenever the next tensor would
  push it past `max_shard_bytes`; at most one shard's tensors are held. The files are written here (the
  format is an 8-byte header length, a JSON header, then the raw bytes) straight from each tensor's memory:
  `safetensors.torch.save_file` first copies the whole shard into one bytes object, doubling the peak.
  `huggingface_hub.save_torch_state_dict` would write the same files and index, but it takes the whole
  state dict at once (a 32B model: 65 GB in bf16 on one process) and writes each shard with `save_file`;
  here tensors arrive one layer at a time from a torch_dist checkpoint or from the pipeline stages, and at
  most one shard is held.
* `export_config` is the base model's config.json with the dtype set to the exported tensors' and the
  shape fields set from the ModelConfig; every other field (bos/eos_token_id, rope_scaling, ...) is kept.
* `staging_dir` / `publish` write into `<out>.tmp-<pid>` beside the output and rename it into place once
  every file is on disk, so an interrupted export leaves any previous export intact and nothing
  half-written under the final name.
* `Progress` prints tensors and bytes done, the rate and an ETA on stderr every few seconds.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from dapo_megatron.models import hf_io, hf_mapping
from dapo_megatron.models.config import ModelConfig

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# The config.json fields that fix the tensors' shapes: always those of the weights being written.
_SHAPE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
    "head_dim",
)


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"cannot export {dtype} tensors; choose one of {sorted(DTYPE_NAMES.values())}")
    return DTYPE_NAMES[dtype]


# ---------------------------------------------------------------- config.json


def export_config(base: dict[str, Any] | None, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of an export whose tensors are `dtype`: `base` (the model's own config.json, parsed)
    with `torch_dtype` (and `dtype`, which transformers 5 writes, where present) set, and the shape fields
    taken from `cfg`; `cfg.to_hf_config()` without a base."""
    config = dict(base) if base is not None else cfg.to_hf_config()
    shapes = cfg.to_hf_config()
    config.update({key: shapes[key] for key in _SHAPE_FIELDS if key in shapes})
    config["torch_dtype"] = dtype_name(dtype)
    if "dtype" in config:
        config["dtype"] = dtype_name(dtype)
    return config


# ---------------------------------------------------------------- safetensors shards


@dataclass
class ShardFile:
    path: Path
    names: list[str]
    nbytes: int


@dataclass
class ShardWriter:
    """Collects tensors into shards of at most `max_shard_bytes` (a larger tensor gets a shard of its own)
    and writes each as `<prefix><n>.safetensors` in `out_dir` as soon as the next tensor does not fit.
    `finish()` writes the last one. Tensors are cast to `dtype` and moved to CPU as they arrive."""

    out_dir: Path
    dtype: torch.dtype
    max_shard_bytes: int = 5 * 2**30
    prefix: str = "part-"
    progress: Progress | None = None
    files: list[ShardFile] = field(default_factory=list)
    _pending: dict[str, torch.Tensor] = field(default_factory=dict)
    _pending_bytes: int = 0
    _seen: set[str] = field(default_factory=set)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise ValueError(f"tensor {name!r} was written twice")
        self._seen.add(name)
        tensor = tensor.detach().to(device="cpu", dtype=self.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != nbytes:
            # A view (q of a fused qkv, the unpadded rows of the embedding) would keep its whole base alive.
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += nbytes
        if self.progress is not None:
            self.progress.advance(nbytes)

    def add_megatron(self, name: str, tensor: torch.Tensor, cfg: ModelConfig) -> None:
        """One full Megatron parameter (global layer index), as its HF tensors."""
        for hf_name, hf_tensor in hf_mapping.megatron_to_hf(name, tensor, cfg):
            self.add(hf_name, hf_tensor)

    def finish(self) -> list[ShardFile]:
        if self._pending:
            self._flush()
        return self.files

    def _flush(self) -> None:
        path = self.out_dir / f"{self.prefix}{len(self.files):05d}.safetensors"
        write_safetensors(path, self._pending)
        self.files.append(ShardFile(path, list(self._pending), self._pending_bytes))
        self._pending, self._pending_bytes = {}, 0


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file from contiguous CPU tensors, written from their memory and fsynced."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header with spaces to an 8-byte boundary
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for tensor in tensors.values():
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        _sync(f)


def _sync(f: IO[bytes]) -> None:
    f.flush()
    os.fsync(f.fileno())


def write_index(out_dir: Path, parts: list[ShardFile]) -> list[Path]:
    """Rename the parts, in order, to `model-0000i-of-0000N.safetensors` and write the index."""
    weight_map: dict[str, str] = {}
    paths = []
    for i, part in enumerate(parts, start=1):
        final = out_dir / f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        part.path.rename(final)
        weight_map.update(dict.fromkeys(part.names, final.name))
        paths.append(final)
    write_json(
        out_dir / hf_io.INDEX_FILE,
        {"metadata": {"total_size": sum(p.nbytes for p in parts)}, "weight_map": weight_map},
    )
    return paths


def write_json(path: Path, content: dict[str, Any]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(content, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def finish_directory(
    out_dir: Path, parts: list[ShardFile], config: dict[str, Any], assets_dir: Path | str | None
) -> list[Path]:
    """Index, tokenizer and other non-weight files of `assets_dir`, then config.json (ours wins over a copied
    one). Returns the shard paths."""
    paths = write_index(out_dir, parts)
    if assets_dir is not None:
        hf_io.copy_hf_assets(assets_dir, out_dir)
    write_json(out_dir / "config.json", config)
    return paths


# ---------------------------------------------------------------- atomic publication


def check_output(out_dir: Path | str, *, force: bool) -> Path:
    """Refuse a non-empty `out_dir` unless `force`; nothing is removed here (`publish` replaces it)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise FileExistsError(f"{out_dir} already exists and is not empty; pass --force to overwrite it")
    return out_dir


def make_staging(out_dir: Path | str) -> Path:
    """A fresh, empty `<out>.tmp-<pid>` beside `out_dir` (same filesystem, so `publish` is a rename).
    Leftovers of killed exports (their process gone) are cleared first: staging directories are removed, and
    a previous export that `publish` had renamed aside is put back if nothing took its place."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f"{out_dir.name}.tmp-*"):
        if not _process_alive(stale.name.rsplit("-", 1)[-1]):
            shutil.rmtree(stale, ignore_errors=True)
    for aside in out_dir.parent.glob(f"{out_dir.name}.old-*"):
        if not _process_alive(aside.name.rsplit("-", 1)[-1]):
            if out_dir.exists():
                _remove(aside)
            else:
                aside.rename(out_dir)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


@contextlib.contextmanager
def staging_dir(out_dir: Path | str) -> Iterator[Path]:
    """`make_staging`, removed again if the block raises."""
    tmp = make_staging(out_dir)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _process_alive(pid: str) -> bool:
    if not pid.isdigit():
        return True  # not one of ours: leave it alone
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def publish(tmp: Path, out_dir: Path | str) -> Path:
    """Move the finished `tmp` to `out_dir`, replacing a previous export there. The old directory is
    renamed aside first (a directory cannot be renamed over a non-empty one) and deleted after."""
    out_dir = Path(out_dir)
    _fsync_dir(tmp)
    old = None
    if out_dir.exists() or out_dir.is_symlink():
        old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(old)
    tmp.rename(out_dir)
    _fsync_dir(out_dir.parent)
    if old is not None:
        _remove(old)
    return out_dir


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- progress


@dataclass
class Progress:
    """Tensors and bytes done, rate and ETA as one line on `stream` every `every_s` seconds (and at the end),
    so a conversion that takes minutes shows that it is moving."""

    total_tensors: int
    total_bytes: int
    label: str = "export"
    every_s: float = 5.0
    stream: IO[str] = field(default_factory=lambda: sys.stderr)
    tensors: int = 0
    nbytes: int = 0
    _started: float = field(default_factory=time.monotonic)
    _last: float = field(default_factory=time.monotonic)

    def advance(self, nbytes: int) -> None:
        self.tensors += 1
        self.nbytes += nbytes
        now = time.monotonic()
        if now - self._last >= self.every_s or self.tensors == self.total_tensors:
            self._last = now
            self.report()

    def report(self) -> None:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = self.nbytes / elapsed
        eta = (self.total_bytes - self.nbytes) / rate if rate > 0 else float("inf")
        unit, scale = ("GiB", 2**30) if self.total_bytes >= 2**30 else ("MiB", 2**20)
        print(
            f"{self.label}: {self.tensors}/{self.total_tensors} tensors, {self.nbytes / scale:.2f}/"
            f"{self.total_bytes / scale:.2f} {unit}, {rate / 2**20:.0f} MiB/s, {elapsed:.0f}s elapsed, "
            f"ETA {eta:.0f}s",
            file=self.stream,
            flush=True,
        )


def publish_stages(
    staging: Path,
    out_dir: Path | str,
    reports: list[tuple[list[ShardFile], str | None]],
    config: dict[str, Any],
    assets_dir: Path | str | None,
) -> list[str]:
    """Rank 0 of a collective export: every rank's (shards written, error) -> the finished directory at
    `out_dir`, or the staging directory removed if any rank failed. Returns the errors (empty on success)."""
    errors = [error for _, error in reports if error is not None]
    if not errors:
        try:
            # Stages named their parts "stage<pp>-<n>": in that order the shards follow the model.
            parts = sorted((part for files, _ in reports for part in files), key=lambda part: part.path.name)
            finish_directory(staging, parts, config, assets_dir)
            publish(staging, out_dir)
        except Exception as error:  # reported to every rank, which raise it together
            errors.append(f"rank 0: {error!r}")
    if errors:
        shutil.rmtree(staging, ignore_errors=True)
    return errors


def stage_totals(cfg: ModelConfig, dtype: torch.dtype, pp_size: int = 1, pp_rank: int = 0) -> tuple[int, int]:
    """(HF tensors, bytes) that pipeline stage `pp_rank` exports: its layers, the embedding on the first
    stage, the final norm and the output layer on the last."""
    layers = hf_mapping.layer_range(cfg, pp_size, pp_rank)

    def on_stage(name: str) -> bool:
        layer = _HF_LAYER.match(name)
        if layer is not None:
            return int(layer[1]) in layers
        return pp_rank == 0 if name == "model.embed_tokens.weight" else pp_rank == pp_size - 1

    shapes = [shape for name, shape in hf_mapping.hf_param_shapes(cfg).items() if on_stage(name)]
    return len(shapes), sum(math.prod(shape) for shape in shapes) * dtype.itemsize
