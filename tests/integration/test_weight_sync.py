"""Megatron (TP2 x PP2 for the tensor path, PP2 for the distributed one) -> bucketed weight sync -> a real
SGLang engine on CPU.

The engine starts from unrelated weights; after a sync its log-probs and greedy continuations equal the
trainer's; after optimizer steps the stale engine differs, and a second sync makes it follow again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import torchrun

WORKER = Path(__file__).with_name("weight_sync_worker.py")
pytestmark = [pytest.mark.sglang, pytest.mark.distributed]


def test_tp2_pp2_trainer_syncs_into_sglang(tmp_path: Path) -> None:
    torchrun(WORKER, 4, "--tp", "2", "--pp", "2", "--dir", str(tmp_path), timeout=900)
    check_report(json.loads((tmp_path / "report.json").read_text()))


def test_pp2_trainer_syncs_into_sglang_over_a_process_group(tmp_path: Path) -> None:
    """Each pipeline stage broadcasts its own layers over its own group with the engine."""
    torchrun(WORKER, 2, "--pp", "2", "--method", "distributed", "--dir", str(tmp_path), timeout=900)
    check_report(json.loads((tmp_path / "report.json").read_text()))


def check_report(report: dict[str, Any]) -> None:
    assert report["before_sync"] > 0.1, "the engine must start from other weights, or the test proves nothing"
    assert report["after_sync"] < 1e-4
    assert report["buckets"] > 1, "the tiny model must span several buckets"
    assert report["greedy_engine"] == report["greedy_trainer"]

    assert report["trainer_change"] > 1e-2, "the optimizer steps must move the policy"
    assert report["stale_engine"] > 1e-2
    assert report["after_second_sync"] < 1e-4
    assert report["greedy_engine_2"] == report["greedy_trainer_2"]
    assert report["weight_version"] == "step-1"
