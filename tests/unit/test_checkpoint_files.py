"""Checkpoint files without a process group: verification, fallback, retention, fsync and safe loading."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dapo_megatron import checkpoint
from dapo_megatron.distributed.layout import ParallelLayout


def make_checkpoint(root: Path, step: int, *, manifest: bool = True) -> Path:
    """A checkpoint directory as save_model leaves it (tiny stand-in shards carrying the real file names)."""
    directory = checkpoint.step_dir(root, step)
    directory.mkdir(parents=True)
    (directory / ".metadata").write_bytes(b"metadata")
    (directory / "__0_0.distcp").write_bytes(os.urandom(4096))
    torch.save({"step": step, "prompts": {"index": step}}, directory / checkpoint.TRAINER_STATE_FILE)
    if manifest:
        checkpoint.write_manifest(directory)
    return directory


def test_empty_or_cut_tracker_falls_back_to_the_newest_complete_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_checkpoint(tmp_path, 1)
    newest = make_checkpoint(tmp_path, 10)
    tracker = tmp_path / checkpoint.TRACKER_FILE
    for text in ("", "1", "1\x00"):  # empty, "10\n" cut to "1", garbage
        tracker.write_text(text)
        assert checkpoint.resolve(tmp_path) == newest
        assert f"skipped: {checkpoint.TRACKER_FILE}" in caplog.text
        caplog.clear()
    tracker.write_text("1\n")  # a complete tracker is followed, even to an older checkpoint
    assert checkpoint.resolve(tmp_path) == checkpoint.step_dir(tmp_path, 1)


def test_a_truncated_trainer_state_is_skipped_with_its_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    older = make_checkpoint(tmp_path, 5)
    damaged = make_checkpoint(tmp_path, 10)
    (tmp_path / checkpoint.TRACKER_FILE).write_text("10\n")
    state = damaged / checkpoint.TRAINER_STATE_FILE
    state.write_bytes(state.read_bytes()[:100])
    assert checkpoint.resolve(tmp_path) == older
    assert f"iter_0000010 ({checkpoint.TRAINER_STATE_FILE} has 100 bytes, the manifest says" in caplog.text
    with pytest.raises(ValueError, match="iter_0000010 is incomplete or damaged"):
        checkpoint.resolve(damaged)  # named explicitly: no silent substitute


def test_same_size_corruption_of_a_small_file_fails_its_checksum(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, 3)
    state = directory / checkpoint.TRAINER_STATE_FILE
    data = bytearray(state.read_bytes())
    data[-5] ^= 0xFF
    state.write_bytes(bytes(data))
    assert checkpoint.verify(directory) == f"{checkpoint.TRAINER_STATE_FILE} does not match its checksum"


def test_nothing_complete_names_every_skipped_checkpoint(tmp_path: Path) -> None:
    broken = make_checkpoint(tmp_path, 4)
    (broken / "__0_0.distcp").unlink()
    (tmp_path / checkpoint.TRACKER_FILE).write_text("4\n")
    with pytest.raises(FileNotFoundError, match=r"iter_0000004 \(__0_0.distcp is missing\)"):
        checkpoint.resolve(tmp_path)


def test_a_checkpoint_without_manifest_needs_its_metadata(tmp_path: Path) -> None:
    converted = make_checkpoint(tmp_path, 0, manifest=False)  # tools/convert_hf_to_megatron.py output
    assert checkpoint.verify(converted) is None
    (converted / ".metadata").unlink()
    assert checkpoint.verify(converted) == "no .metadata and no manifest"


def test_retention_keeps_the_last_n_and_milestones(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20, 25, 30, 40):
        make_checkpoint(tmp_path, step)
    damaged = make_checkpoint(tmp_path, 12)
    (damaged / ".metadata").write_bytes(b"")
    deleted = checkpoint.prune(tmp_path, 30, keep_last=2, keep_every=10)
    assert sorted(path.name for path in deleted) == ["iter_0000005", "iter_0000012", "iter_0000015"]
    # 25 and 30 are the last two, 10 and 20 milestones; 40 is newer than this run's step and not its to
    # delete.
    assert checkpoint.list_steps(tmp_path) == [10, 20, 25, 30, 40]


def test_retention_deletes_nothing_while_the_newest_is_incomplete(tmp_path: Path) -> None:
    for step in (1, 2):
        make_checkpoint(tmp_path, step)
    newest = make_checkpoint(tmp_path, 3)
    (newest / checkpoint.MANIFEST_FILE).write_text("{")
    assert checkpoint.prune(tmp_path, 3, keep_last=1) == []
    assert checkpoint.list_steps(tmp_path) == [1, 2, 3]


def test_manifest_and_tracker_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    directory = make_checkpoint(tmp_path, 7)
    checkpoint._write_atomically(tmp_path / checkpoint.TRACKER_FILE, "7\n")
    for path in (
        directory / "__0_0.distcp",
        directory / checkpoint.TRAINER_STATE_FILE,
        directory,
        directory / (checkpoint.MANIFEST_FILE + ".tmp"),
        tmp_path / (checkpoint.TRACKER_FILE + ".tmp"),
        tmp_path,
    ):
        assert str(path) in synced, path
    assert synced.index(str(directory / checkpoint.TRAINER_STATE_FILE)) < synced.index(
        str(directory / (checkpoint.MANIFEST_FILE + ".tmp"))
    )


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def one_rank_layout() -> ParallelLayout:
    from dapo_megatron.distributed.layout import ParallelLayout

    return ParallelLayout(
        world_size=1,
        rank=0,
        local_rank=0,
        node=0,
        master_addr="127.0.0.1",
        tp_size=1,
        pp_size=1,
        dp_size=1,
        tp_rank=0,
        pp_rank=0,
        dp_rank=0,
        pp_last_rank=0,
        device=torch.device("cpu"),
        backend="gloo",
    )


def test_training_state_loads_without_running_pickled_code(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, 2, manifest=False)
    marker = tmp_path / "code_ran"
    torch.save({"layout": None, "payload": _RunsCode(marker)}, directory / "rank_00000.pt")
    with pytest.raises(ValueError, match=r"cannot read .*rank_00000\.pt: UnpicklingError"):
        checkpoint.read_training_files(directory, one_rank_layout())
    assert not marker.exists()


def test_a_resume_refuses_model_only_and_per_rank_optimizer_checkpoints(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path, 2, manifest=False)
    with pytest.raises(
        FileNotFoundError, match=r"model-only checkpoint\): start from its weights alone with "
    ):
        checkpoint.require_training_state(directory)
    # What earlier versions wrote per rank: the optimizer's state_dict beside the RNG states.
    legacy = {"layout": {"world": 1}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}}, "rng": {}}
    torch.save(legacy, directory / "rank_00000.pt")
    with pytest.raises(ValueError, match=r"per-rank files, the format of earlier .* trainer\.resume=never"):
        checkpoint.require_training_state(directory)
    torch.save({"layout": {"world": 1}, "rng": {}}, directory / "rank_00000.pt")
    checkpoint.require_training_state(directory)


def test_training_state_round_trips_rng_state_and_package_records(tmp_path: Path) -> None:
    """What a trainer checkpoint holds besides tensors: numpy/python RNG states and this package's dataclasses
    (the backlog's records; a config dataclass stands in for them here as it does not move between
    modules)."""
    import random

    import numpy as np

    from dapo_megatron.trainer.config import TrainerConfig

    saved = {
        "step": 3,
        "rng": {"numpy": np.random.get_state(), "python": random.getstate()},
        "backlog": [TrainerConfig(total_steps=7)],
    }
    directory = make_checkpoint(tmp_path, 3, manifest=False)
    torch.save(saved, directory / checkpoint.TRAINER_STATE_FILE)
    loaded = checkpoint._load_state(directory / checkpoint.TRAINER_STATE_FILE)
    assert loaded["backlog"] == saved["backlog"] and loaded["rng"]["python"] == saved["rng"]["python"]
    assert np.array_equal(loaded["rng"]["numpy"][1], saved["rng"]["numpy"][1])


def test_records_saved_under_a_module_that_is_gone_still_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checkpoints pickle the backlog's records by class path; the records have moved into
    # dapo_megatron.records.
    import sys
    import types

    from dapo_megatron.records import Prompt

    old = "dapo_megatron.trainer.rollout"
    with monkeypatch.context() as patch:  # pickle writes the class under its module's name at save time
        patch.setitem(sys.modules, old, types.SimpleNamespace(Prompt=Prompt))
        patch.setattr(Prompt, "__module__", old)
        prompt = Prompt(**{f.name: None for f in __import__("dataclasses").fields(Prompt)})
        directory = make_checkpoint(tmp_path, 1, manifest=False)
        torch.save({"step": 1, "backlog": [prompt]}, directory / checkpoint.TRAINER_STATE_FILE)
    assert old not in sys.modules
    loaded = checkpoint._load_state(directory / checkpoint.TRAINER_STATE_FILE)
    assert type(loaded["backlog"][0]) is Prompt and loaded["backlog"][0] == prompt
