"""The trainer's state offloaded between optimizer steps changes nothing: DP2, bf16, distributed optimizer
(real megatron-core, gloo, torchrun; `resume_worker.py --mode offload`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import torchrun

WORKER = Path(__file__).with_name("resume_worker.py")


@pytest.mark.distributed
def test_a_run_that_offloads_between_steps_equals_one_that_does_not(tmp_path: Path) -> None:
    """Each rank moves its shard of the fp32 main parameters and Adam moments, its bf16 and fp32 parameter
    buffers and gradient buffers; each offload released every storage and each reload was bit-exact (the
    worker checks both on every rank), and the losses and weights of every step are those of the run that
    kept its state in place."""
    torchrun(WORKER, 2, "--mode", "offload", "--dir", str(tmp_path))
    results = torch.load(tmp_path / "offload.pt")
    assert results[True]["losses"] == results[False]["losses"]
    assert results[True]["weights"].keys() == results[False]["weights"].keys()
    for name, tensor in results[False]["weights"].items():
        assert torch.equal(results[True]["weights"][name], tensor), name
