"""Colocated engines take GPU memory only once every rank has freed its part: no engine launches before every
rank has offloaded its state (an engine's TP ranks run on its peers' GPUs, and SGLang checks that they found
the same free memory), none resumes its weights before every rank has finished its update, none its KV cache
before every rank's state has left again, and no engine is asked to generate before every engine holds its KV
cache (SGLang does not refuse a request while it is released). Stand-in engines record when they are asked;
rank 1 is slow (`engine_memory_order_worker.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import torchrun

WORKER = Path(__file__).with_name("engine_memory_order_worker.py")


def events(directory: Path, layout: str) -> list[dict]:
    lines = [
        line for path in sorted(directory.glob(f"{layout}.*.jsonl")) for line in path.read_text().splitlines()
    ]
    return [json.loads(line) for line in lines]


def times(log: list[dict], event: str, rank: int | None = None) -> list[float]:
    return [e["t"] for e in log if e["event"] == event and (rank is None or e["rank"] == rank)]


@pytest.mark.distributed
def test_engines_take_memory_only_after_every_rank_freed_its_part(tmp_path: Path) -> None:
    torchrun(WORKER, 2, "--dir", str(tmp_path))

    shared = events(tmp_path, "shared")  # one engine over both ranks' GPUs, launched by rank 0
    set_up_offload, sync_offload = (
        max(times(shared, "offloaded", rank)[i] for rank in (0, 1)) for i in (0, 1)
    )
    [launch] = times(shared, "launch")
    assert launch >= set_up_offload, "an engine launched before every rank offloaded its state"
    [weights] = times(shared, "resume weights")
    assert weights >= max(times(shared, "updated")), "an engine resumed its weights during a peer's update"
    [kv_cache] = times(shared, "resume kv_cache,cuda_graph")
    assert kv_cache >= sync_offload, "an engine resumed its KV cache before every rank offloaded its state"
    assert times(shared, "push") and min(times(shared, "push")) >= weights

    apart = events(tmp_path, "apart")  # one engine per rank
    assert len(times(apart, "launch")) == 2
    assert min(times(apart, "synced")) >= max(times(apart, "resume kv_cache,cuda_graph")), (
        "a rank went on to generate before every engine had its KV cache back"
    )
