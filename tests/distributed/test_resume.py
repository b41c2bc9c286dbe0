"""Resuming from a checkpoint continues the policy update: bit-exactly in the same layout, and under another
layout as an uninterrupted run under that layout would (2 processes each)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dapo_megatron import checkpoint
from tests.conftest import torchrun

WORKER = Path(__file__).with_name("resume_worker.py")
# Layouts round differently and Adam divides by sqrt(v): for the key biases, whose gradient is ~0, resumed
# and uninterrupted weights differ by up to ~2.3e-6 (as much as uninterrupted runs under X and under Y do).
ATOL = 2e-5


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [["--pp", "2"], ["--distributed-optimizer"]], ids=["pp2", "dp2_zero1"])
def test_resumed_steps_equal_uninterrupted_ones(tmp_path: Path, layout: list[str]) -> None:
    """PP2, and DP2 with the distributed optimizer (Adam state sharded over DP, saved gathered)."""
    torchrun(WORKER, 2, "--mode", "continuous", *layout, "--dir", str(tmp_path))
    torchrun(WORKER, 2, "--mode", "resume", *layout, "--dir", str(tmp_path))
    continuous, resumed = torch.load(tmp_path / "continuous.pt"), torch.load(tmp_path / "resume.pt")
    assert checkpoint.list_steps(tmp_path / "checkpoints") == [2]  # retention removed step 1 after step 2
    assert checkpoint.verify(checkpoint.step_dir(tmp_path / "checkpoints", 2)) is None
    assert (checkpoint.step_dir(tmp_path / "checkpoints", 2) / checkpoint.MANIFEST_FILE).exists()
    assert sorted(resumed["losses"]) == [3, 4]
    assert resumed["losses"] == {step: continuous["losses"][step] for step in (3, 4)}
    for name, tensor in continuous["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), name


@pytest.mark.distributed
def test_a_resume_under_another_layout_makes_the_uninterrupted_update(tmp_path: Path) -> None:
    """ZeRO-1 at DP2 -> TP2 and TP2 -> PP2 (`resume_worker.RESHARD_CASES`): after the resume's step, the
    weights are those of an uninterrupted run under the new layout, which zeroed Adam moments are not. bf16
    at TP2, and at DP2 with the distributed optimizer (parameter groups mixing fp32 norms and bf16 weights):
    the fp32 masters and moments come back bit-exactly."""
    torchrun(WORKER, 2, "--mode", "reshard", "--dir", str(tmp_path))
    results = torch.load(tmp_path / "reshard.pt")
    assert sorted(results) == ["bf16_tp2", "bf16_zero1_dp2", "tp2_to_pp2", "zero1_dp2_to_tp2"]
    for case in ("bf16_tp2", "bf16_zero1_dp2"):
        for name, expected in results[case]["uninterrupted"].items():
            assert torch.equal(results[case]["resumed"][name], expected), (case, name)
    for case, weights in results.items():
        assert checkpoint.verify(checkpoint.step_dir(tmp_path / case / "checkpoints", 2)) is None
        for name, expected in weights["uninterrupted"].items():
            torch.testing.assert_close(
                weights["resumed"][name], expected, rtol=0, atol=ATOL, msg=f"{case} {name}"
            )
        lost = max((weights["moments_reset"][k] - v).abs().max() for k, v in weights["uninterrupted"].items())
        assert lost > 20 * ATOL, (case, lost)  # the tolerance would catch a resume that lost the moments


def test_a_checkpoint_interrupted_mid_write_is_never_picked(tmp_path: Path) -> None:
    complete = checkpoint.step_dir(tmp_path, 2)
    complete.mkdir(parents=True)
    (complete / ".metadata").write_bytes(b"")
    (tmp_path / checkpoint.TRACKER_FILE).write_text("2\n")
    # A job killed while writing step 4 leaves only the temporary directory; the tracker still says 2.
    partial = checkpoint.step_dir(tmp_path, 4).with_name("iter_0000004.partial")
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"")
    assert checkpoint.resolve(tmp_path) == complete
