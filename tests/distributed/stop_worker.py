"""The driver's stop protocol without SGLang (run as `python -m tests.distributed.stop_worker OVERRIDES`).

Like `dapo_megatron.train`: the job config for this world size, the parallel layout, the tiny policy, and
`StopRequest` checked at every step boundary; on SIGUSR1 every rank agrees, the checkpoint is written, and
the process exits 0. A "step" here only waits, so the test controls when the signal lands. Rank 0 writes
the number of finished steps to `<output_dir>/steps_done` for the test to watch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main() -> int:
    from dapo_megatron import checkpoint
    from dapo_megatron import config as job_config
    from dapo_megatron.distributed.launch import process_env
    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.train import StopRequest

    job = job_config.load(sys.argv[1:], world_size=process_env().world_size)
    layout = initialize(job.parallel, job.seed)
    out = Path(job.output_dir)
    try:
        model = build_gpt_model(job.model, job.parallel, layout)
        stop = StopRequest()
        step = 0
        while step < job.trainer.total_steps and not stop.requested():
            time.sleep(0.2)
            step += 1
            if layout.is_logging_rank:
                (out / "steps_done").write_text(str(step))
        saved = checkpoint.save_model(model, out / "checkpoints", step, job.model, layout)
        if layout.is_logging_rank:
            print(f"stopped at step {step} of {layout.world_size} ranks; checkpoint {saved}", flush=True)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
