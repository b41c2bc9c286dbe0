"""Model checkpoints in megatron-core's `dist_checkpointing` (torch_dist) format.

Layout on disk (Megatron-LM's convention, so its tools recognise it):

    <root>/latest_checkpointed_iteration.txt     the step of the newest complete checkpoint
    <root>/iter_0000100/                         torch_dist shards (.metadata, __*.distcp, common.pt)
    <root>/iter_0000100/dapo_model.json          the ModelConfig the weights belong to
    <root>/iter_0000100/rank_00000.pt            training checkpoints: each rank's RNG states (restored
                                                 in the same layout only)
    <root>/iter_0000100/trainer_state.pt         training checkpoints: step, data position, dynamic-sampling
                                                 backlog
    <root>/iter_0000100/dapo_manifest.json       written last: every file's size, and a SHA-256 of the small
                                                 ones

torch_dist stores every tensor by its global shape, so a checkpoint written under one TP x PP layout
loads under any other. Training checkpoints store the optimizer there too, under the `training` key (Adam's
moments and fp32 masters by their parameters' global keys, beside the LR schedule), so a resume may change
TP, PP and DP; only the RNG states are per rank. Saves and loads are fully parallel over the data-parallel
group (megatron-core's FullyParallelSave/LoadStrategyWrapper): each tensor that DP replicas share is written
by one of them and read by one of them, in about equal shares, and the distributed optimizer's shards are
written and read by the ranks that own them (`trainer.optimizer.sharded_optimizer_state`), so no rank holds
more than it writes and a resume reads the checkpoint about once.

A step directory is written under a temporary name and renamed once every rank has finished, and the tracker
is updated last: a job killed mid-save leaves the previous checkpoint intact. Files, directories and the
tracker are fsynced before they are relied on.

A checkpoint is trusted only after it is verified against its manifest (one without a manifest, such as
tools/convert_hf_to_megatron.py output, needs its `.metadata`). Resolving a checkpoint root follows the
tracker, and when the tracker is unreadable or points to a checkpoint that fails verification, falls back to
the newest checkpoint that verifies, saying what it skipped and why. Training state is read with
`torch.load(weights_only=True)`, allowing only the few types this project stores.

torch and megatron-core load inside the functions that read or write tensors: the paths, the tracker and the
manifests are checked (`preflight.py`) before a CPU trainer imports torch (`train.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dapo_megatron.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from dapo_megatron.distributed.layout import ParallelLayout

log = logging.getLogger(__name__)


def install_warning_filters() -> None:
    """Loading a torch_dist checkpoint through megatron-core 0.16 / torch 2.13 repeats these deprecations once
    per tensor: they concern APIs megatron-core calls, not ours, and would fill a resumed job's first screen.
    Only these messages from those modules are silenced."""
    warnings.filterwarnings(
        "ignore",
        message="`load_state_dict` is deprecated",
        category=FutureWarning,
        module=r"megatron\.core\.dist_checkpointing",
    )
    warnings.filterwarnings(
        "ignore",
        message="Please use DTensor instead and we are deprecating ShardedTensor",
        category=FutureWarning,
        module=r"torch\.distributed\.checkpoint",
    )


install_warning_filters()

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MODEL_CONFIG_FILE = "dapo_model.json"
TRAINER_STATE_FILE = "trainer_state.pt"
TRAINING_KEY = "training"
MANIFEST_FILE = "dapo_manifest.json"
_CHECKSUM_MAX_BYTES = (
    16 << 20
)  # shards and optimizer states are size-checked only: hashing ~450 GB costs minutes
_STEP_DIR = re.compile(r"iter_(\d{7,})")
_TRACKER_TEXT = re.compile(
    r"(\d+)\n"
)  # the newline is written with the step: without it the file was cut short


class Resumable(Protocol):
    """What a training checkpoint saves besides the model (`trainer.actor.Actor`)."""

    def sharded_state_dict(self, model_state: dict[str, Any], *, is_loading: bool = False) -> dict[str, Any]:
        """Optimizer and schedule state as a sharded state dict keyed by `model_state`'s tensors."""
        ...

    def check_loadable(self, saved: dict[str, Any]) -> None:
        """Raise ValueError, naming the setting to change, when the state saved (its non-tensor part)
        cannot load into this one."""
        ...

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None: ...

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's state that only the same layout can restore (RNG)."""
        ...

    def load_rank_state_dict(self, state: dict[str, Any]) -> None: ...


def step_dir(root: Path | str, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def resolve(path: Path | str) -> Path:
    """A verified torch_dist directory from either itself or a checkpoint root.

    For a root, the tracker's checkpoint if it verifies, else the newest one that does (with a warning
    naming what was skipped and why).

    Raises:
        ValueError: `path` is a checkpoint directory that fails verification.
        FileNotFoundError: nothing under `path` verifies.
    """
    path = Path(path)
    if (path / ".metadata").exists() or (path / MANIFEST_FILE).exists():
        problem = verify(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} is incomplete or damaged: {problem}")
        return path
    skipped: list[str] = []
    tracked = _tracked_step(path, skipped)
    candidates = sorted(list_steps(path), reverse=True)
    if tracked is not None:
        candidates = [tracked] + [step for step in candidates if step != tracked]
    for step in candidates:
        directory = step_dir(path, step)
        problem = verify(directory)
        if problem is None:
            if skipped:
                log.warning("checkpoint: using %s; skipped: %s", directory, "; ".join(skipped))
            return directory
        skipped.append(f"{directory.name} ({problem})")
    if not skipped and not (path / TRACKER_FILE).exists():
        raise FileNotFoundError(
            f"{path} is neither a torch_dist checkpoint (no .metadata) nor a checkpoint root "
            f"(no {TRACKER_FILE}, no iter_* directories)"
        )
    raise FileNotFoundError(f"no complete checkpoint under {path}: " + "; ".join(skipped))


def list_steps(root: Path | str) -> list[int]:
    """The steps of the `iter_*` directories under `root` (complete or not), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for entry in root.iterdir() if (m := _STEP_DIR.fullmatch(entry.name)))


def _tracked_step(root: Path, skipped: list[str]) -> int | None:
    tracker = root / TRACKER_FILE
    if not tracker.exists():
        return None
    text = tracker.read_text(errors="replace")
    match = _TRACKER_TEXT.fullmatch(text)
    if match is None:
        skipped.append(
            f"{tracker.name} (holds {text[:20]!r}, not a step and a newline: cut short or damaged)"
        )
        return None
    return int(match.group(1))


def verify(directory: Path | str, *, checksums: bool = True) -> str | None:
    """Why `directory` is not a complete checkpoint, or None if it is: with a manifest, every listed file
    must exist with its size (and checksum, for small files, unless `checksums` is off); without one,
    `.metadata` must exist."""
    directory = Path(directory)
    manifest_file = directory / MANIFEST_FILE
    if not manifest_file.exists():
        return None if (directory / ".metadata").exists() else "no .metadata and no manifest"
    try:
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as error:
        return f"unreadable {MANIFEST_FILE}: {error}"
    for name, entry in files.items():
        file = directory / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']}"
        if checksums and "sha256" in entry and _sha256(file) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def read_model_config(path: Path | str) -> ModelConfig | None:
    """The ModelConfig saved beside the weights, if the checkpoint was written by this project."""
    config_file = resolve(path) / MODEL_CONFIG_FILE
    if not config_file.exists():
        return None
    return ModelConfig(**json.loads(config_file.read_text()))


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written: its `.partial` directory stays, the committed ones are untouched."""


WRITE_PROBE_BYTES = 4 << 20
"""What a failed save writes once more to name the cause: torch's serializer reports a failed write as
`unexpected pos`, with the OS error (a full disk, an exceeded quota) lost on the way."""


def _write_failure(
    error: BaseException, partial: Path, root: Path, step: int, rank: int
) -> CheckpointWriteError:
    """The error a failed save raises: why (a test write into the same directory, and the free space there),
    which checkpoint is still the newest committed one, and what to do."""
    where = partial if partial.is_dir() else root
    probe = where / f".write_probe_{rank}"
    try:
        with probe.open("wb") as stream:
            stream.write(bytes(WRITE_PROBE_BYTES))
            stream.flush()
            os.fsync(stream.fileno())
        cause = "the writer failed, though a test write there succeeds"
    except OSError as probe_error:
        test = f"a {WRITE_PROBE_BYTES >> 20} MiB test write there fails too"
        cause = f"{probe_error.strerror or probe_error} ({test})"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    try:
        free = f"{shutil.disk_usage(where).free / 2**30:.1f} GiB free"
    except OSError:
        free = "free space unknown"
    committed = _tracked_step(root, skipped=[])
    kept = (
        f"checkpoint step {committed} stays the newest committed one"
        if committed is not None
        else "no checkpoint is committed"
    )
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[-1][:300]
    return CheckpointWriteError(
        f"checkpoint step {step} could not be written to {partial}: {cause}; {free}. {kept}. Free space "
        "there and run again with trainer.resume=auto, which resumes from it. "
        f"The writer said: {first_line}"
    )


def save_model(
    model: torch.nn.Module,
    root: Path | str,
    step: int,
    model_cfg: ModelConfig,
    layout: ParallelLayout,
    *,
    training: Resumable | None = None,
    shared_state: dict[str, Any] | None = None,
    keep_last: int = 0,
    keep_every: int = 0,
) -> Path:
    """Collective: write checkpoint `step` under `root`: the model's shards (torch_dist), optionally the
    `training` state (optimizer and schedule in the same torch_dist checkpoint, each rank's RNG beside it)
    and rank 0's `shared_state` (step, data position, dynamic-sampling backlog). Once it is complete,
    older checkpoints are pruned per `keep_last` / `keep_every` (see `prune`; 0: keep all)."""
    import torch
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from dapo_megatron.models.weights import finish_param_gather, unwrap_model

    finish_param_gather(model)  # parallel.overlap_param_gather: else 1/DP of the update is saved
    final = step_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    if layout.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    torch.distributed.barrier()
    model_state = unwrap_model(model).sharded_state_dict()
    state = dict(model_state)
    if training is not None:
        state[TRAINING_KEY] = training.sharded_state_dict(model_state)
    try:
        dist_checkpointing.save(state, str(partial), sharded_strategy=_save_strategy())
        if training is not None:
            rank_file = partial / f"rank_{layout.rank:05d}.pt"
            torch.save({"layout": _layout_key(layout), **training.rank_state_dict()}, rank_file)
            _fsync(rank_file)
        torch.distributed.barrier()
        if layout.rank == 0:
            (partial / MODEL_CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(model_cfg), indent=2))
            if shared_state is not None:
                torch.save(shared_state, partial / TRAINER_STATE_FILE)
            write_manifest(partial)
    # torch.distributed.checkpoint's CheckpointException, which a failed shard write becomes, is a
    # BaseException.
    except (Exception, CheckpointException) as error:
        raise _write_failure(error, partial, Path(root), step, layout.rank) from error
    if layout.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        _fsync(Path(root))
        _write_atomically(Path(root) / TRACKER_FILE, f"{step}\n")
        prune(root, step, keep_last=keep_last, keep_every=keep_every)
    torch.distributed.barrier()
    return final


def write_manifest(directory: Path) -> None:
    """Fsync every file under `directory`, then record their sizes (and small files' checksums) in the
    manifest, written and fsynced last: its presence means everything it lists was on disk first."""
    files: dict[str, dict[str, Any]] = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
        _fsync(file)
        entry: dict[str, Any] = {"size": file.stat().st_size}
        if entry["size"] <= _CHECKSUM_MAX_BYTES:
            entry["sha256"] = _sha256(file)
        files[file.relative_to(directory).as_posix()] = entry
    for folder in {file.parent for file in directory.rglob("*")} | {directory}:
        _fsync(folder)
    _write_atomically(directory / MANIFEST_FILE, json.dumps({"files": files}, indent=1))


def prune(root: Path | str, newest: int, *, keep_last: int, keep_every: int = 0) -> list[Path]:
    """Delete checkpoints older than `newest` beyond the `keep_last` newest complete ones, keeping steps that
    are multiples of `keep_every` (milestones). Nothing is deleted unless `newest` itself verifies. Older
    checkpoints that fail verification count as deletable; newer ones than `newest` (another run's, kept with
    trainer.overwrite) are left alone. 0 disables each rule. Returns the deleted directories."""
    if keep_last <= 0 or verify(step_dir(root, newest)) is not None:
        return []
    older = [step for step in sorted(list_steps(root), reverse=True) if step <= newest]
    # Sizes suffice to tell a finished checkpoint from a cut one here; reading old ones again costs time.
    complete = [step for step in older if verify(step_dir(root, step), checksums=False) is None]
    kept = set(complete[:keep_last]) | {newest}
    if keep_every > 0:
        kept |= {step for step in complete if step % keep_every == 0}
    deleted = [step_dir(root, step) for step in older if step not in kept]
    for directory in deleted:
        shutil.rmtree(directory)
    if deleted:
        _fsync(Path(root))
    return deleted


def load_training_state(
    model: torch.nn.Module, path: Path | str, layout: ParallelLayout, training: Resumable
) -> dict[str, Any]:
    """Collective: restore `training` from checkpoint `path` (saved with `save_model`; load the model
    first) under this job's layout, whatever the saved one. Each rank's RNG states come back only in the
    layout they were saved from (the first rank says when they do not). Returns the shared state."""
    from megatron.core import dist_checkpointing

    from dapo_megatron.models.weights import unwrap_model

    directory = resolve(path)
    require_training_state(directory)
    rank_state, shared = read_training_files(directory, layout)
    training.check_loadable(dist_checkpointing.load_common_state_dict(str(directory))[TRAINING_KEY])
    template = training.sharded_state_dict(unwrap_model(model).sharded_state_dict(), is_loading=True)
    loaded = dist_checkpointing.load({TRAINING_KEY: template}, str(directory), _load_strategy(directory))
    training.load_sharded_state_dict(loaded[TRAINING_KEY])
    if rank_state is not None:
        training.load_rank_state_dict(rank_state)
    return shared


def require_training_state(directory: Path) -> None:
    """Refuse, naming the way on, a checkpoint without a resumable optimizer: a model-only one, or one
    whose optimizer state was written per rank by an earlier version of this project."""
    rank_files = sorted(directory.glob("rank_*.pt"))
    weights_only = f"start from its weights alone with trainer.load={directory} trainer.resume=never"
    if not rank_files:
        raise FileNotFoundError(
            f"{directory} holds no training state (a model-only checkpoint): {weights_only}"
        )
    if "optimizer" in _load_state(rank_files[0], mmap=True):  # mapped: an old file holds a rank's moments
        raise ValueError(
            f"{directory} keeps its optimizer state in per-rank files, the format of earlier versions of "
            f"dapo_megatron: resume it with the version that wrote it (same layout), or {weights_only} "
            "(Adam's moments restart from zero)"
        )


def read_training_files(
    directory: Path, layout: ParallelLayout
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(this rank's state, None unless it was saved under this very layout; the shared state), read without
    running pickled code."""
    rank_file = directory / f"rank_{layout.rank:05d}.pt"
    rank_state = _load_state(rank_file) if rank_file.exists() else None
    saved = None if rank_state is None else rank_state.pop("layout")
    if saved != _layout_key(layout):
        if layout.rank == 0:
            log.warning(
                "checkpoint: %s was written under layout %s, this job runs %s: model and optimizer "
                "reshard, RNG states start afresh",
                directory,
                saved,
                _layout_key(layout),
            )
        rank_state = None
    return rank_state, _load_state(directory / TRAINER_STATE_FILE)


def _allowed_types(file: Path) -> list[Any]:
    """What unpickling training state may build besides tensors: numpy's RNG state, and the dataclasses of
    this package that the checkpoint names (the dynamic-sampling backlog, the batch generated ahead). Those
    are plain records, found by name; a name whose module is gone is looked up in `dapo_megatron.records`,
    where every record now lives, so checkpoints written before a record moved there still load."""
    import numpy as np
    import torch

    numpy_core = getattr(np, "_core", None) or np.core  # renamed in numpy 2
    # The MT19937 key is a uint32 array: unpickling it needs the array, dtype and uint32 dtype classes.
    allowed: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), numpy_core.multiarray._reconstruct]
    for name in torch.serialization.get_unsafe_globals_in_checkpoint(str(file)):
        module, _, attribute = name.rpartition(".")
        if module.split(".")[0] != __name__.split(".")[0]:
            continue
        try:
            found = getattr(importlib.import_module(module), attribute, None)
        except ModuleNotFoundError:
            found = getattr(importlib.import_module(f"{__name__.split('.')[0]}.records"), attribute, None)
        if isinstance(found, type) and dataclasses.is_dataclass(found):
            # Under the name the checkpoint uses, which is not the class's own once it has moved.
            allowed.append(found if f"{found.__module__}.{found.__qualname__}" == name else (found, name))
    return allowed


def _load_state(file: Path, *, mmap: bool = False) -> dict[str, Any]:
    import torch

    try:
        with torch.serialization.safe_globals(_allowed_types(file)):
            return torch.load(file, weights_only=True, mmap=mmap)
    except Exception as error:
        raise ValueError(f"cannot read {file}: {type(error).__name__}: {str(error)[:500]}") from error


def _layout_key(layout: ParallelLayout) -> dict[str, int]:
    return {"world": layout.world_size, "tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size}


def load_model(model: torch.nn.Module, path: Path | str) -> Path:
    """Collective: load this rank's shards (any saved layout) into `model`. Returns the directory read."""
    from megatron.core import dist_checkpointing

    from dapo_megatron.models.weights import unwrap_model

    directory = resolve(path)
    inner = unwrap_model(model)
    state = dist_checkpointing.load(inner.sharded_state_dict(), str(directory), _load_strategy(directory))
    state.pop(TRAINING_KEY, None)  # the optimizer's non-tensor state, which every load returns
    inner.load_state_dict(state)
    return directory


def _spread_over() -> Any:
    """The data-parallel group over which a save spreads its writes and a load its reads, as Megatron-LM's
    --ckpt-fully-parallel-save/load do; None without one (a single process, or DP 1)."""
    import torch
    from megatron.core import parallel_state

    if not (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return group if torch.distributed.get_world_size(group) > 1 else None


def _save_strategy() -> Any:
    """torch_dist with its writes spread over the DP ranks: a tensor every DP replica holds (the model's
    weights, a non-distributed optimizer's state) is written by one of them, chosen so that each writes about
    as much; without it DP rank 0 writes them all (at 32B, TP 8: the ranks of node 0). None: the default."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    group = _spread_over()
    if group is None:
        return None
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), group)


def _load_strategy(directory: Path) -> Any:
    """torch_dist with its reads spread over the DP ranks: each tensor that several DP ranks need is read by
    one of them and sent to the others, so a resume reads the checkpoint about once instead of once per DP
    replica. None: the default."""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    group = _spread_over()
    if group is None:
        return None
    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(directory)), group)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries (a rename or new file), to stable storage."""
    descriptor = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
