"""TP2, PP2, TP2xPP2 and DP2 give the single-process loss and gradients (real megatron-core, gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import torchrun

WORKER = Path(__file__).with_name("parallel_equivalence_worker.py")
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("equivalence")
    weights, out = root / "weights.pt", root / "reference.pt"
    torchrun(WORKER, 1, "--weights", str(weights), "--save-weights", "--out", str(out))
    return weights, torch.load(out)


@pytest.mark.parametrize(("tp", "pp", "nproc"), [(2, 1, 2), (1, 2, 2), (2, 2, 4), (1, 1, 2)],
                         ids=["tp2", "pp2", "tp2xpp2", "dp2"])
def test_layout_matches_single_process(reference: tuple[Path, dict], tmp_path: Path, tp: int, pp: int,
                                       nproc: int) -> None:
    weights, expected = reference
    out = tmp_path / "result.pt"
    torchrun(WORKER, nproc, "--tp", str(tp), "--pp", str(pp), "--weights", str(weights), "--out", str(out))
    result = torch.load(out)

    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert result["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        assert grad.abs().max() > 0, f"{name} has a zero reference gradient; the test would prove nothing"
        torch.testing.assert_close(result["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
