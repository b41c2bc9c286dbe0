"""The collective timeout covers the longest wait of the non-driving ranks (a whole rollout step, then an
evaluation), computed by hand from the recipe's numbers."""

from __future__ import annotations

import datetime

from dapo_megatron import config as C
from dapo_megatron.distributed.timeout import collective_timeout

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
    assert collective_timeout(job, world_size=128, device="cuda") == datetime.timedelta(
        minutes=30, seconds=18600
    )
    # Far beyond the fixed 30 minutes that a long step used to exceed.
    assert collective_timeout(job, world_size=128, device="cuda") > datetime.timedelta(hours=5)


def test_one_engine_on_cpu_without_evaluation() -> None:
    job = C.to_job_config(C.compose(["experiment=dapo_qwen2.5_32b", *PINNED, "eval.every=0"]))
    # On CPU one engine per job: 16 groups in flight, 1536 / 16 = 96 lifetimes per round.
    assert collective_timeout(job, world_size=128, device="cpu") == datetime.timedelta(
        minutes=30, seconds=10 * 96 * 600
    )
