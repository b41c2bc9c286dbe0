"""The fault suite's own bookkeeping (bench/faults.py `Checkpoints`): which checkpoint a resume must start
from, after damage on purpose and after the trainer writes a damaged step again."""

from __future__ import annotations

import shutil
from pathlib import Path

from dapo_megatron.checkpoint import write_manifest
from tests.conftest import load_bench_script

faults = load_bench_script("faults")


def _write(root: Path, step: int) -> None:
    """A complete checkpoint directory as the trainer leaves it: written beside, then renamed into place."""
    partial = root / f"iter_{step:07d}.partial"
    partial.mkdir(parents=True)
    (partial / "weights.bin").write_bytes(bytes(range(256)) * 4)
    write_manifest(partial)
    final = root / f"iter_{step:07d}"
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    (root / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")


def test_a_damaged_step_written_again_is_intact_again(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        _write(root, step)
    checkpoints = faults.Checkpoints(root)
    checkpoints.update()
    assert checkpoints.newest_intact() == 2

    (root / "iter_0000002" / "weights.bin").write_bytes(b"cut")
    checkpoints.damage(2)
    checkpoints.update()
    assert checkpoints.newest_intact() == 1, "the damaged newest is not where a resume starts"
    assert checkpoints.lost == set(), "damage on purpose is not a lost checkpoint"

    _write(root, 2)  # the resumed run reaches step 2 again and saves it
    checkpoints.update()
    assert checkpoints.newest_intact() == 2, "a step written again after its damage is the newest again"
    assert checkpoints.lost == set()


def test_a_tracker_with_flipped_bytes_commits_nothing_new(tmp_path: Path) -> None:
    """The chain damages the tracker too; a flipped byte may leave it invalid UTF-8."""
    root = tmp_path / "checkpoints"
    _write(root, 1)
    checkpoints = faults.Checkpoints(root)
    checkpoints.update()
    (root / "latest_checkpointed_iteration.txt").write_bytes(bytes([ord("1") ^ 0xFF, ord("\n")]))
    _write(root, 2)
    (root / "latest_checkpointed_iteration.txt").write_bytes(bytes([ord("2") ^ 0xFF, ord("\n")]))
    checkpoints.update()
    assert checkpoints.newest_intact() == 1
