"""`parallel.overlap_param_gather` (the 7B and 32B recipes): every reader of the weights after an update sees
the optimizer's new values, not 1/DP of them (`models.weights.finish_param_gather`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import torchrun

WORKER = Path(__file__).with_name("param_gather_worker.py")


@pytest.mark.distributed
def test_readers_after_a_deferred_param_gather_see_the_update(tmp_path: Path) -> None:
    torchrun(WORKER, 2, "--dir", str(tmp_path))
    per_rank = torch.load(tmp_path / "gaps.pt")
    # Without a reader the step leaves each rank's parameters partly old: the case can fail.
    assert all(gaps["stale"] > 1e-4 for gaps in per_rank), per_rank
    for rank, gaps in enumerate(per_rank):
        for reader in ("checkpoint", *(("export_hf", "gather_full_state") if rank == 0 else ())):
            assert gaps[reader] == 0.0, (rank, reader, gaps)
