"""Write a megatron-core torch_dist checkpoint from a Hugging Face checkpoint one tensor at a time, in one
process, without the model in memory.

The model is built on the meta device: megatron-core's own `sharded_state_dict` then says which keys, global
shapes, layer-stacking and TP chunking torch_dist expects, with no data behind them. megatron-core's
`dist_checkpointing.save` runs with its torch_dist strategy, except that torch.distributed.checkpoint's writer
asks the planner for each tensor's data when it writes it: there the data is read from the HF checkpoint (that
parameter's tensors only), fused, cast, and dropped once written. The peak is a few of the largest parameter,
whatever the model's size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint as dcp

from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models import hf_mapping
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.qwen2 import build_gpt_model
from dapo_megatron.models.safetensors_reader import SafetensorsReader
from dapo_megatron.models.weights import local_params

if TYPE_CHECKING:
    from dapo_megatron.distributed.layout import ParallelLayout


def save_hf_as_torch_dist(
    hf_dir: Path | str,
    cfg: ModelConfig,
    layout: ParallelLayout,
    out_dir: Path | str,
    *,
    progress: Callable[[int, int, int], None] | None = None,
) -> None:
    """Write `hf_dir`'s weights to the torch_dist directory `out_dir` (megatron-core's files only). Needs a
    one-process TP1 x PP1 `layout` (initialised). `progress(done, total, bytes_read)` after each parameter."""
    if layout.world_size != 1:
        raise ValueError(f"save_hf_as_torch_dist runs in one process; this job has {layout.world_size} ranks")
    meta = dataclasses.replace(layout, device=torch.device("meta"))
    with torch.device("meta"):
        model = build_gpt_model(cfg, ParallelConfig(), meta)
    params = {param.untyped_storage()._cdata: name for name, param in local_params(model, cfg, meta)}
    with SafetensorsReader(hf_dir) as reader:
        hf_mapping.check_hf_shapes(reader.shapes(), cfg)
        source = _HFSource(reader, cfg, params, progress)
        dist_checkpointing.save(model.sharded_state_dict(), str(out_dir), sharded_strategy=_strategy(source))
    if len(source.done) != len(params):
        missing = sorted(set(params.values()) - source.done)
        raise RuntimeError(f"torch_dist writer never asked for {missing}; the checkpoint is incomplete")


class _HFSource:
    """The real values of the meta model's parameters, read from HF on demand. Keeps the last parameter, as
    torch_dist writes a parameter in parts (fc1's gate and up halves) one after the other."""

    def __init__(
        self,
        reader: SafetensorsReader,
        cfg: ModelConfig,
        params: dict[int, str],
        progress: Callable[[int, int, int], None] | None,
    ) -> None:
        self.reader, self.cfg, self.params, self.progress = reader, cfg, params, progress
        self.dtype = getattr(torch, cfg.params_dtype)
        self.done: set[str] = set()
        self._last: tuple[str, torch.Tensor] | None = None

    def resolve(self, meta: torch.Tensor) -> torch.Tensor:
        """The real tensor that the meta tensor `meta` (a view of a meta parameter) stands for."""
        name = self.params.get(meta.untyped_storage()._cdata)
        if name is None:
            raise RuntimeError(
                f"torch_dist asked for a meta tensor of shape {tuple(meta.shape)} that is no "
                "parameter of the model; the writer cannot produce it"
            )
        full = self._param(name)
        return full.as_strided(meta.shape, meta.stride(), meta.storage_offset())

    def _param(self, name: str) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = None  # drop the previous parameter before reading the next
            _release_freed_memory()
            parts = [
                self.reader.read(s.name, s.dim, s.start, s.stop)
                for s in hf_mapping.hf_slices_for_shard(name, self.cfg, 1, 0)
            ]
            value = hf_mapping.shard_from_hf_slices(name, parts, self.cfg, 1).to(self.dtype).contiguous()
            self._last = (name, value)
            if name not in self.done:
                self.done.add(name)
                if self.progress is not None:
                    self.progress(len(self.done), len(self.params), self.reader.bytes_read)
        return self._last[1]


def _release_freed_memory() -> None:
    """Hand freed heap memory back to the OS. glibc serves blocks below its (adaptive, up to 32 MiB) mmap
    threshold from the heap and keeps them when freed; tensor after tensor, that grows the resident set by
    several tensors' worth beyond what is alive."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME) if _LIBC_NAME and hasattr(ctypes.CDLL(_LIBC_NAME), "malloc_trim") else None


def _strategy(source: _HFSource) -> Any:
    """megatron-core's torch_dist save strategy, writing with torch's own (lazily resolving) writer."""

    class Planner(MCoreSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            data = super().resolve_data(write_item)
            return source.resolve(data) if isinstance(data, torch.Tensor) and data.is_meta else data

    class Strategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
            state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            # thread_count=1: torch's serial loader resolves one tensor, writes it, then resolves the next.
            dcp.save(
                mcore_to_pyt_state_dict(state_dict, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                planner=Planner(dedup_replicated_tensors=False, flatten_state_dict=False),
            )

    return Strategy("torch_dist", 1)
