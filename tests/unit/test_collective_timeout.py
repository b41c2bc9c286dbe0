"""The collective timeout covers the longest wait of the non-driving ranks (a whole rollout step, then an
evaluation), computed by hand from the recipe's numbers; the request timeout it is built from covers a
full-length group."""

from __future__ import annotations

import datetime

import pytest

from dapo_megatron import backends
from dapo_megatron import config as C
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.trainer.fleet import rollout_config
from dapo_megatron.trainer.timeout import collective_timeout

# The numbers the hand computations use, pinned so a recipe edit does not silently change them.
PINNED = [
    "rollout.max_concurrent_requests=256",
    "rollout.request_timeout_s=600",
    "parallel.timeout_minutes=30",
    "trainer.max_gen_rounds=10",
    "trainer.gen_batch_size=1536",
    "rollout.n_samples_per_prompt=16",
    "rollout.engine_tp_size=4",
    "rollout.num_engines=0",
]


def test_32b_recipe_waits_for_ten_rounds_of_generation_and_an_evaluation() -> None:
    job = C.to_job_config(
        C.compose(
            [
                "experiment=dapo_qwen2.5_32b",
                *PINNED,
                "eval.every=10",
                "eval.num_problems=30",
                "eval.samples_per_problem=32",
            ]
        )
    )
    # 128 GPUs / TP 4 = 32 engines; 256 // 16 = 16 groups in flight per engine -> 512; 1536 prompts per
    # round = 3 request lifetimes of 600 s; 10 rounds = 18000 s. Evaluation: 256 // 32 = 8 per engine -> 256
    # in flight; 30 problems = 1 lifetime = 600 s. Plus the 30 minutes for everything else.
    assert collective_timeout(job, world_size=128, backend=backends.CUDA) == datetime.timedelta(
        minutes=30, seconds=18600
    )
    # Far beyond the fixed 30 minutes that a long step used to exceed.
    assert collective_timeout(job, world_size=128, backend=backends.CUDA) > datetime.timedelta(hours=5)


def test_one_engine_on_cpu_without_evaluation() -> None:
    job = C.to_job_config(C.compose(["experiment=dapo_qwen2.5_32b", *PINNED, "eval.every=0"]))
    # On CPU one engine per job: 16 groups in flight, 1536 / 16 = 96 lifetimes per round.
    assert collective_timeout(job, world_size=128, backend=backends.CPU) == datetime.timedelta(
        minutes=30, seconds=10 * 96 * 600
    )


# A decode step at 32B (TP 4, H100, a full KV cache of 20k-token rollouts), as estimated from memory
# bandwidth: the slow end of 25-35 ms.
SLOWEST_ESTIMATED_STEP_S = 0.035


@pytest.mark.parametrize(("experiment", "world_size"), [("dapo_qwen2.5_7b", 8), ("dapo_qwen2.5_32b", 128)])
def test_cluster_recipes_wait_for_a_full_length_group_that_queued_behind_another(
    experiment: str, world_size: int
) -> None:
    job = C.load([f"experiment={experiment}"], world_size=world_size)
    timeout = rollout_config(job).request_timeout_s
    full_length_group = job.rollout.max_response_length * SLOWEST_ESTIMATED_STEP_S  # 717 s
    assert timeout is not None and timeout > 2 * full_length_group  # 1434 s: decoded after another one
    # 2 x 20480 tokens x 40 ms + 120 s of prefill and first-request allowance, rounded up.
    assert timeout == 1759.0 == job.rollout.resolved_request_timeout_s


def test_the_request_timeout_is_derived_only_where_none_is_given() -> None:
    assert RolloutConfig(max_response_length=20480).resolved_request_timeout_s == 1759.0
    assert RolloutConfig(max_response_length=4096).resolved_request_timeout_s == 600.0  # the floor
    assert RolloutConfig(max_response_length=20480, request_timeout_s=900).resolved_request_timeout_s == 900
    job = C.load(["experiment=dapo_qwen2.5_32b", "rollout.request_timeout_s=900"], world_size=128)
    assert rollout_config(job).request_timeout_s == 900
    with pytest.raises(ValueError, match=r"rollout.request_timeout_s must be > 0; got 0"):
        RolloutConfig(request_timeout_s=0)


def test_cluster_recipes_collective_timeouts_as_the_cluster_runs_them() -> None:
    """The values slurm/README.md states, from the recipes as written at their cluster world sizes."""
    big = C.load(["experiment=dapo_qwen2.5_32b"], world_size=128)
    # 32 engines x 64 // 16 = 128 groups in flight: 1536 prompts = 12 request lifetimes a round, 10 rounds;
    # the evaluation's 30 problems x 32 samples, 64 // 32 x 32 = 64 in flight: 1 lifetime. Plus 30 minutes.
    assert collective_timeout(big, world_size=128, backend=backends.CUDA) == datetime.timedelta(
        minutes=30, seconds=(10 * 12 + 1) * 1759
    )  # 59 h 37 min 19 s
    small = C.load(["experiment=dapo_qwen2.5_7b"], world_size=8)
    # 8 engines x 256 // 16 = 128 in flight: 384 prompts = 3 lifetimes a round; evaluation 8 x 8 = 64: 1.
    assert collective_timeout(small, world_size=8, backend=backends.CUDA) == datetime.timedelta(
        minutes=30, seconds=(10 * 3 + 1) * 1759
    )  # 15 h 38 min 49 s


@pytest.mark.parametrize(("recipe", "world_size"), [("dapo_qwen2.5_32b", 128), ("dapo_qwen2.5_7b", 8)])
def test_slurm_readme_states_the_timeout_the_code_computes(recipe: str, world_size: int) -> None:
    """slurm/README.md tells a cluster user how long a hung collective holds the allocation: the code's
    figure for each recipe as written, to the minute."""
    from tests.conftest import REPO

    job = C.to_job_config(C.compose([f"experiment={recipe}"]))
    minutes = round(
        collective_timeout(job, world_size=world_size, backend=backends.CUDA).total_seconds() / 60
    )
    assert f"{minutes // 60} h {minutes % 60} min" in (REPO / "slurm" / "README.md").read_text().replace(
        "\n  ", " "
    )
