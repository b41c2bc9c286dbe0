"""GPU memory per rank and phase of a training job, from its config alone (no GPU, nothing allocated).

    dapo-plan-memory experiment=dapo_qwen2.5_32b [hydra overrides, e.g.
        parallel.tensor_model_parallel_size=4 cluster.gpu_memory_gib=141 trainer.micro_batch_size=2]

Takes the trainer's own overrides; the GPUs come from `cluster.nodes`, `cluster.gpus_per_node` and
`cluster.gpu_memory_gib`. Prints, for the busiest rank, what each phase (training, rollout, weight sync,
checkpoint) holds, whether it fits, and the nearest layout that fits when it does not; then the checkpoint's
bytes, host memory and times, and the lead the time-limit signal needs. Exit status: 0 fits,
1 does not fit, 2 invalid config. The formulas and their sources: dapo_megatron/planning/memory.py.
"""

from __future__ import annotations

import argparse
import sys

from dapo_megatron import config as job_config
from dapo_megatron.cli import reports_config_errors
from dapo_megatron.planning.memory import validate_for_cluster
from dapo_megatron.planning.report import report


@reports_config_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _, overrides = parser.parse_known_args(argv)
    job = job_config.to_job_config(job_config.compose(overrides))
    validate_for_cluster(job)  # an impossible layout is reported here, as every entry point reports it
    return report(job, show_ranks=False)


if __name__ == "__main__":
    sys.exit(main())
