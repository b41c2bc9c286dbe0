"""A training checkpoint with the distributed optimizer is written by every rank, each tensor once, in about
equal shares, without gathering the optimizer's state into host memory; a checkpoint in the format this
project wrote before still resumes, under another layout (`checkpoint_spread_worker.py`, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dapo_megatron import checkpoint
from tests.conftest import torchrun

WORKER = Path(__file__).with_name("checkpoint_spread_worker.py")
pytestmark = pytest.mark.distributed

SAVE_HOST_SLACK_BYTES = 32 << 20
"""What a save may allocate in host memory beyond the bytes its rank writes (metadata, pickling, gloo)."""


def spread(tmp_path: Path, tp: int, processes: int) -> tuple[list[dict], Path]:
    torchrun(WORKER, processes, "--mode", "spread", "--tp", str(tp), "--dir", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(processes)]
    return ranks, checkpoint.step_dir(tmp_path / "checkpoints", 1)


def stored_bytes(directory: Path) -> int:
    """The bytes of every tensor the checkpoint's metadata describes, each counted once."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata()
    return sum(
        entry.size.numel() * entry.properties.dtype.itemsize
        for entry in metadata.state_dict_metadata.values()
        if isinstance(entry, TensorStorageMetadata)
    )


@pytest.mark.parametrize(("tp", "processes"), [(1, 2), (2, 4)], ids=["dp2", "tp2_dp2"])
def test_every_rank_writes_an_equal_share_once(tmp_path: Path, tp: int, processes: int) -> None:
    """Before: DP rank 0 wrote the model and the whole gathered optimizer state, DP rank 1 nothing."""
    ranks, directory = spread(tmp_path, tp, processes)
    written = [rank["written_bytes"] for rank in ranks]
    assert all(written), written
    # Each stored tensor once: the files hold the tensors' bytes plus torch's per-chunk framing.
    assert stored_bytes(directory) <= sum(written) <= 1.02 * stored_bytes(directory)
    # Equal shares within a DP group: each rank writes its own optimizer shard and about half of its TP
    # slice's weights.
    assert max(written) <= 1.1 * sum(written) / processes, written


def test_a_save_holds_no_more_host_memory_than_its_rank_writes(tmp_path: Path) -> None:
    """Before: every rank gathered its TP x PP slice's whole optimizer state (12 bytes per parameter, here
    ~208 MB) into host memory, whatever it wrote (DP rank 1: nothing)."""
    ranks, _ = spread(tmp_path, 1, 2)
    for rank in ranks:
        assert rank["save_host_bytes"] <= rank["written_bytes"] + SAVE_HOST_SLACK_BYTES, rank


def test_a_checkpoint_of_the_earlier_format_resumes_under_another_layout(tmp_path: Path) -> None:
    """Written at DP 2 in megatron-core's `fully_reshardable` form, resumed at TP 2: the step after the resume
    makes exactly the weights that the same resume from a checkpoint of the current format makes."""
    torchrun(WORKER, 2, "--mode", "old_checkpoint", "--dir", str(tmp_path))
    results = torch.load(tmp_path / "old_checkpoint.pt")
    assert results["old"].keys() == results["new"].keys()
    for name, tensor in results["new"].items():
        assert torch.equal(results["old"][name], tensor), name
