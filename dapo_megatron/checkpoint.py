"""Model checkpoints in megatron-core's `dist_checkpointing` (torch_dist) format.

Layout on disk (Megatron-LM's convention, so its tools recognise it):

    <root>/latest_checkpointed_iteration.txt     the step of the newest complete checkpoint
    <root>/iter_0000100/                         torch_dist shards (.metadata, __*.distcp, common.pt)
    <root>/iter_0000100/dapo_model.json          the ModelConfig the weights belong to

torch_dist stores every tensor by its global shape, so a checkpoint written under one TP x PP layout
loads under any other. A step directory is written under a temporary name and renamed once every
rank has finished, and the tracker is updated last: a job killed mid-save leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dapo_megatron.models.config import ModelConfig

if TYPE_CHECKING:
    from dapo_megatron.distributed.layout import ParallelLayout

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_CONFIG_FILE = "dapo_model.json"


def step_dir(root: Path | str, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def resolve(path: Path | str) -> Path:
    """A torch_dist directory from either itself or a checkpoint root with a tracker file."""
    path = Path(path)
    if (path / ".metadata").exists():
        return path
    tracker = path / TRACKER_FILE
    if tracker.exists():
        resolved = step_dir(path, int(tracker.read_text().strip()))
        if (resolved / ".metadata").exists():
            return resolved
        raise FileNotFoundError(f"{tracker} points to {resolved}, which is not a complete checkpoint")
    raise FileNotFoundError(f"{path} is neither a torch_dist checkpoint (no .metadata) nor a checkpoint root "
                            f"(no {TRACKER_FILE})")


def read_model_config(path: Path | str) -> ModelConfig | None:
    """The ModelConfig saved beside the weights, if the checkpoint was written by this project."""
    config_file = resolve(path) / MODEL_CONFIG_FILE
    if not config_file.exists():
        return None
    return ModelConfig(**json.loads(config_file.read_text()))


def save_model(model: torch.nn.Module, root: Path | str, step: int, model_cfg: ModelConfig,
               layout: ParallelLayout) -> Path:
    """Collective: every rank writes its shards of `model` as checkpoint `step` under `root`."""
    from megatron.core import dist_checkpointing

    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    if layout.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save(_unwrap(model).sharded_state_dict(), str(partial))
    torch.distributed.barrier()
    if layout.rank == 0:
        (partial / MODEL_CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        _write_atomically(Path(root) / TRACKER_FILE, f"{step}\n")
    torch.distributed.barrier()
    return final


def load_model(model: torch.nn.Module, path: Path | str) -> Path:
    """Collective: load this rank's shards (any saved layout) into `model`. Returns the directory read."""
    from megatron.core import dist_checkpointing

    directory = resolve(path)
    inner = _unwrap(model)
    state = dist_checkpointing.load(inner.sharded_state_dict(), str(directory))
    inner.load_state_dict(state)
    return directory


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
