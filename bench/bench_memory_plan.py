"""Memory plan of the 32B recipe: how many full-length rollouts one engine's KV cache holds against the
requests it is given at once, with the trainer's state offloaded during rollout and without; and its
checkpoint (bytes, per-rank share and host memory, save and load times) and time-limit stop lead.

Nothing runs on a GPU: the numbers are `dapo_megatron.planning.memory`'s arithmetic for
`experiment=dapo_qwen2.5_32b` (16 nodes x 8 GPUs of 80 GiB), the same plan `tools/plan_memory.py` prints.
They are the plan's promise, not a measurement; what only a GPU can confirm is listed in bench/RESULTS.md
('Rollout memory of the 32B recipe').

Usage: ``python bench/bench_memory_plan.py [hydra overrides]``. The last lines printed are
``kv_rollouts_held_vs_concurrency_32b`` (the recipe as configured) and
``kv_rollouts_held_vs_concurrency_32b_state_kept`` (the same engines with trainer.offload_during_rollout
flipped), then the planned seconds of one move of the trainer's state each way, the checkpoint's GB in all
and per rank, its save and load seconds, and the stop lead in seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from dapo_megatron import config as job_config  # noqa: E402
from dapo_megatron.planning.checkpoint import GB, plan_checkpoint  # noqa: E402
from dapo_megatron.planning.memory import plan_memory  # noqa: E402
from dapo_megatron.planning.report import format_checkpoint, format_plan, format_stop_lead  # noqa: E402
from dapo_megatron.planning.stop import plan_stop_lead  # noqa: E402


def main(argv: list[str]) -> int:
    job = job_config.to_job_config(job_config.compose(["experiment=dapo_qwen2.5_32b", *argv]))
    plan, checkpoint = plan_memory(job), plan_checkpoint(job)
    lead = plan_stop_lead(job, plan, checkpoint)
    print(format_plan(job, plan))
    print(format_checkpoint(checkpoint))
    print(format_stop_lead(job, lead))
    kept = plan.rollouts_held_alternative / plan.concurrent_rollouts
    state = "offloaded" if plan.offload else "kept on the GPU"
    print(
        f"\ntrainer state {state} during rollout: {plan.rollouts_held}/{plan.concurrent_rollouts} "
        f"full-length rollouts held per engine; flipped: "
        f"{plan.rollouts_held_alternative}/{plan.concurrent_rollouts}"
    )
    print(f"kv_rollouts_held_vs_concurrency_32b {plan.held_vs_concurrency:.4f}")
    print(f"kv_rollouts_held_vs_concurrency_32b_{'state_kept' if plan.offload else 'offloaded'} {kept:.4f}")
    print(f"offload_seconds_each_way_32b {plan.offload_seconds:.2f}")
    print(f"checkpoint_gb_32b {checkpoint.total / GB:.1f}")
    print(f"checkpoint_gb_written_per_rank_32b {checkpoint.written_per_rank / GB:.2f}")
    print(f"checkpoint_save_seconds_32b {checkpoint.save_seconds:.1f}")
    print(f"checkpoint_load_seconds_32b {checkpoint.load_seconds:.1f}")
    print(f"stop_lead_seconds_32b {lead.lead_s:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
