"""Model checkpoints in megatron-core's `dist_checkpointing` (torch_dist) format.

Layout on disk (Megatron-LM's convention, so its tools recognise it):

    <root>/latest_checkpointed_iteration.txt     the step of the newest complete checkpoint
    <root>/iter_0000100/                         torch_dist shards (.metadata, __*.distcp, common.pt)
    <root>/iter_0000100/dapo_model.json          the ModelConfig the weights belong to
    <root>/iter_0000100/rank_00000.pt            training checkpoints: each rank's optimizer, LR
                                                 schedule and RNG states (resume in the same layout)
    <root>/iter_0000100/trainer_state.pt         training checkpoints: step, data position, dynamic-sampling backlog

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
from typing import TYPE_CHECKING, Any

import torch

from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.weights import unwrap_model

if TYPE_CHECKING:
    from dapo_megatron.distributed.layout import ParallelLayout

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_CONFIG_FILE = "dapo_model.json"
TRAINER_STATE_FILE = "trainer_state.pt"


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
               layout: ParallelLayout, *, rank_state: dict[str, Any] | None = None,
               shared_state: dict[str, Any] | None = None) -> Path:
    """Collective: write checkpoint `step` under `root`: the model's shards (torch_dist), and optionally
    this rank's training state (`rank_state`: optimizer, scheduler, RNG; resumable in the same layout)
    and rank 0's `shared_state` (step, data position, dynamic-sampling backlog)."""
    from megatron.core import dist_checkpointing

    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    if layout.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save(unwrap_model(model).sharded_state_dict(), str(partial))
    if rank_state is not None:
        torch.save({"layout": _layout_key(layout), **rank_state}, partial / f"rank_{layout.rank:05d}.pt")
    torch.distributed.barrier()
    if layout.rank == 0:
        (partial / MODEL_CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2))
        if shared_state is not None:
            torch.save(shared_state, partial / TRAINER_STATE_FILE)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        _write_atomically(Path(root) / TRACKER_FILE, f"{step}\n")
    torch.distributed.barrier()
    return final


def load_training_state(path: Path | str, layout: ParallelLayout) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this rank's state, the shared state) saved with `save_model`. The per-rank part resumes only in
    the layout it was written from."""
    directory = resolve(path)
    rank_file = directory / f"rank_{layout.rank:05d}.pt"
    if not rank_file.exists():
        raise FileNotFoundError(f"{directory} holds no training state for rank {layout.rank}: it is a model-only "
                                "checkpoint, or was written by a job with fewer ranks")
    rank_state = torch.load(rank_file, weights_only=False)
    saved = rank_state.pop("layout")
    if saved != _layout_key(layout):
        raise ValueError(f"{directory} was written under layout {saved}; this job runs {_layout_key(layout)}. "
                         "Optimizer state resumes only in the same layout: relaunch with that layout, or start "
                         "from the model alone with trainer.load=<dir> trainer.resume=never")
    return rank_state, torch.load(directory / TRAINER_STATE_FILE, weights_only=False)


def _layout_key(layout: ParallelLayout) -> dict[str, int]:
    return {"world": layout.world_size, "tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size}


def load_model(model: torch.nn.Module, path: Path | str) -> Path:
    """Collective: load this rank's shards (any saved layout) into `model`. Returns the directory read."""
    from megatron.core import dist_checkpointing

    directory = resolve(path)
    inner = unwrap_model(model)
    state = dist_checkpointing.load(inner.sharded_state_dict(), str(directory))
    inner.load_state_dict(state)
    return directory


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
