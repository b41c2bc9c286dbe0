"""Megatron (TP2 x PP2 for the tensor path, PP2 for the distributed one; two engines on two nodes, and on one)
-> bucketed weight sync -> real SGLang engines on CPU.

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
    check_report(json.loads((tmp_path / "report.json").read_text()), engines=1)


def test_pp2_trainer_syncs_into_sglang_over_a_process_group(tmp_path: Path) -> None:
    """Each pipeline stage broadcasts its own layers over its own group with the engine."""
    torchrun(WORKER, 2, "--pp", "2", "--method", "distributed", "--dir", str(tmp_path), timeout=900)
    check_report(json.loads((tmp_path / "report.json").read_text()), engines=1)


def test_two_nodes_relay_each_stage_to_the_other_nodes_engine(tmp_path: Path) -> None:
    """PP2 over two nodes with an engine on each: every stage pushes into its own node's engine and relays its
    buckets to the other node's engine rank, which pushes them into its engine (shared memory does not cross
    nodes). Both engines end up with the whole model; one stream spreads its groups over both."""
    torchrun(WORKER, 1, "--pp", "2", "--engines", "2", "--dir", str(tmp_path), timeout=900, nodes=2)
    report = json.loads((tmp_path / "report.json").read_text())
    check_report(report, engines=2)
    assert sorted(report["relayed_to"]) == [0, 1], "each stage relays to the other node's engine rank"


def test_two_engines_on_one_node_take_a_broadcast_from_each_stage(tmp_path: Path) -> None:
    """DP2 with an engine per rank, distributed sync: the sender broadcasts into both engines at once."""
    torchrun(WORKER, 2, "--engines", "2", "--method", "distributed", "--dir", str(tmp_path), timeout=900)
    report = json.loads((tmp_path / "report.json").read_text())
    check_report(report, engines=2)
    assert report["relayed_to"] == []


def check_report(report: dict[str, Any], *, engines: int) -> None:
    assert len(report["after_sync"]) == engines
    assert min(report["before_sync"]) > 0.1, (
        "the engines must start from other weights, or the test proves nothing"
    )
    assert max(report["after_sync"]) < 1e-4
    assert report["buckets"] > 1, "the tiny model must span several buckets"
    assert report["greedy_engines"] == [report["greedy_trainer"]] * engines

    assert report["trainer_change"] > 1e-2, "the optimizer steps must move the policy"
    assert min(report["stale_engine"]) > 1e-2
    assert max(report["after_second_sync"]) < 1e-4
    assert report["greedy_engines_2"] == [report["greedy_trainer_2"]] * engines
    assert report["weight_version"] == "step-1"
    assert report["engines_used"] == sorted(report["urls"]), "one stream must use every engine"
