"""Read the model tensors of a torch_dist checkpoint in one process, a layer at a time, without megatron.

megatron-core saves each decoder parameter as one key with the layers stacked on axis 0
(`decoder.layers.mlp.linear_fc1.weight` [L, 2F, H]), written as chunks of one layer (or of a stage's layers)
each, further split by tensor-parallel rank. Reading a key whole puts L layers in memory at once (a 32B
model's fc1 is 36 GB in bf16); here a key is read one block of layers at a time, where a block is the
smallest run of layers that no stored chunk straddles, so each chunk is read once and the peak is one block
plus the chunk being copied.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dapo_megatron.models import hf_mapping

_STACKED = re.compile(r"decoder\.layers\.(\D.*)")  # no layer index: the layers are axis 0
_PER_LAYER = re.compile(r"decoder\.layers\.(\d+)\..*")  # non_homogeneous_layers keys
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


@dataclass(frozen=True)
class Block:
    key: str
    layers: range | None
    """The layers of a stacked key this block holds (axis 0); None for a key read whole."""
    shape: tuple[int, ...]


class _IntoBlock(LoadPlanner):
    """Copies every read into the one destination tensor (the block); nothing else is loaded."""

    def __init__(self, destination: torch.Tensor) -> None:
        self.destination = destination

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError("plans are built by TorchDistReader.read")

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise NotImplementedError(f"{read_item.dest_index.fqn} is not a tensor")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.destination
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class TorchDistReader:
    """The model tensors (no optimizer, RNG or `_extra_state` entries) of one torch_dist directory."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self._reader = dcp.FileSystemReader(str(directory))
        metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(metadata, True)
        self.tensors: dict[str, TensorStorageMetadata] = {
            key: meta
            for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
            and key.startswith(_MODEL_PREFIXES)
            and hf_mapping.canonical_megatron_name(key) is not None
        }
        if not self.tensors:
            raise ValueError(
                f"{directory} holds no model tensors (embedding.*, decoder.*, output_layer.*); "
                "pass a megatron-core torch_dist checkpoint directory"
            )

    def dtypes(self) -> set[torch.dtype]:
        return {meta.properties.dtype for meta in self.tensors.values()}

    def meta_tensors(self) -> dict[str, torch.Tensor]:
        """Every model key as a tensor without data, to check shapes before anything is read."""
        return {
            key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device="meta")
            for key, meta in self.tensors.items()
        }

    def blocks(self) -> list[Block]:
        """Every block, in model order: the embedding, then layer by layer, then the rest."""
        blocks = []
        for key, meta in self.tensors.items():
            size = tuple(meta.size)
            if _STACKED.fullmatch(key) is None:
                blocks.append(Block(key, None, size))
                continue
            for start, stop in _layer_runs(meta.chunks):
                blocks.append(Block(key, range(start, stop), (stop - start, *size[1:])))
        order = {key: i for i, key in enumerate(self.tensors)}
        return sorted(blocks, key=lambda block: _model_position(block, order[block.key]))

    def read(self, block: Block) -> torch.Tensor:
        meta = self.tensors[block.key]
        start = block.layers.start if block.layers is not None else 0
        offsets = (start, *([0] * (len(block.shape) - 1))) if block.shape else ()
        wanted = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(block.shape))
        destination = torch.empty(block.shape, dtype=meta.properties.dtype)
        items = create_read_items_for_chunk_list(block.key, meta, [wanted])
        try:
            self._reader.read_data(LoadPlan(items), _IntoBlock(destination)).wait()
        except Exception as error:
            part = "" if block.layers is None else f" (layers {block.layers.start}-{block.layers.stop - 1})"
            raise OSError(
                f"cannot read {block.key}{part} from {self.directory}: {error!r}; the checkpoint's "
                "data files are incomplete or damaged (was its save interrupted?)"
            ) from error
        return destination

    def named_tensors(self, block: Block) -> Iterator[tuple[str, torch.Tensor]]:
        """(Megatron name with a global layer index, tensor) for each layer of the block read."""
        tensor = self.read(block)
        if block.layers is None:
            yield block.key, tensor
            return
        suffix = _STACKED.fullmatch(block.key)[1]
        for layer, values in zip(block.layers, tensor.unbind(0), strict=True):
            yield f"decoder.layers.{layer}.{suffix}", values


def _layer_runs(chunks: list[ChunkStorageMetadata]) -> list[tuple[int, int]]:
    """Merge the chunks' layer intervals (axis 0) into the disjoint runs that no chunk straddles."""
    runs: list[list[int]] = []
    for start, stop in sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks):
        if runs and start < runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], stop)
        else:
            runs.append([start, stop])
    return [(start, stop) for start, stop in runs]


def _model_position(block: Block, key_index: int) -> tuple[int, int, int]:
    if block.key.startswith("embedding."):
        return 0, 0, key_index
    if block.layers is not None:
        return 1, block.layers.start, key_index
    per_layer = _PER_LAYER.fullmatch(block.key)
    if per_layer is not None:
        return 1, int(per_layer[1]), key_index
    return 2, 0, key_index
