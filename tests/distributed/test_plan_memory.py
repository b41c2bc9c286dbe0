"""The memory planner's parameter, gradient and optimizer byte counts equal what megatron-core allocates, and
its checkpoint byte counts what a training checkpoint writes (real megatron DDP and optimizers on gloo, TP2 /
PP2 / DP2, with and without the distributed optimizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.planning.checkpoint import stage_checkpoint
from dapo_megatron.planning.memory import stage_state_bytes
from tests.conftest import torchrun
from tests.distributed.plan_memory_worker import LAYOUTS, model_config

WORKER = Path(__file__).with_name("plan_memory_worker.py")
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("plan_memory") / "measured.json"
    torchrun(WORKER, 2, "--out", str(out))
    return json.loads(out.read_text())


CASES = [f"{name}-distopt{flag}" for name in LAYOUTS for flag in (0, 1)]


@pytest.mark.parametrize("case", CASES)
def test_planned_state_bytes_equal_megatron_allocations(measured: list[dict], case: str) -> None:
    for rank in measured:
        run = rank[case]
        real = run["measured"]
        tp_rank, pp_rank, dp_rank = real["coordinates"]
        parallel = ParallelConfig(
            tensor_model_parallel_size=run["tp"],
            pipeline_model_parallel_size=run["pp"],
            use_distributed_optimizer=run["distributed_optimizer"],
        )
        planned = stage_state_bytes(model_config(run["tied"]), parallel, dp=real["dp_size"], pp_rank=pp_rank)[
            dp_rank
        ]
        where = f"{case} rank (tp {tp_rank}, pp {pp_rank}, dp {dp_rank})"
        assert planned.parameters == real["parameters"], where
        assert planned.gradients == real["gradients"], where
        assert planned.main_parameters == real["main_parameters"], where
        assert planned.moments == real["moments"], where
        assert real["other_state"] == 0, f"{where}: the optimizer keeps state the planner does not count"


def test_the_layouts_differ_where_megatron_pads_and_shards(measured: list[dict]) -> None:
    # Guards the test above against comparing numbers that could not differ: the distributed optimizer
    # pads the buffers, and its two DP ranks own different numbers of elements.
    ranks = {tuple(rank["dp2-distopt1"]["measured"]["coordinates"]): rank for rank in measured}
    plain, sharded = (
        ranks[(0, 0, 0)]["dp2-distopt0"]["measured"],
        ranks[(0, 0, 0)]["dp2-distopt1"]["measured"],
    )
    assert sharded["gradients"] > plain["gradients"]
    assert (
        ranks[(0, 0, 0)]["dp2-distopt1"]["measured"]["moments"]
        != ranks[(0, 0, 1)]["dp2-distopt1"]["measured"]["moments"]
    )
    assert sharded["moments"] < plain["moments"]


@pytest.mark.parametrize("case", CASES)
def test_planned_checkpoint_bytes_equal_what_a_save_writes(measured: list[dict], case: str) -> None:
    """Every tensor once in all; per rank, as the planner splits the DP replicas' tensors (megatron-core's
    greedy balancing by size is within 1% of even here). TP rank 1 writes no TP-replicated norm."""
    run = measured[0][case]
    parallel = ParallelConfig(
        tensor_model_parallel_size=run["tp"],
        pipeline_model_parallel_size=run["pp"],
        use_distributed_optimizer=run["distributed_optimizer"],
    )
    dp = run["measured"]["dp_size"]
    stages = [
        stage_checkpoint(model_config(run["tied"]), parallel, dp=dp, pp_rank=r) for r in range(run["pp"])
    ]
    written = {
        tuple(rank[case]["measured"]["coordinates"]): rank[case]["measured"]["checkpoint_written"]
        for rank in measured
    }
    assert sum(written.values()) == sum(stage.weights + stage.optimizer for stage in stages)
    for (tp_rank, pp_rank, dp_rank), real in written.items():
        planned = stages[pp_rank].written[dp_rank]
        if tp_rank == 0:
            assert real == pytest.approx(planned, rel=0.01), (case, tp_rank, pp_rank, dp_rank)
        else:
            assert real <= planned, (case, tp_rank, pp_rank, dp_rank)
