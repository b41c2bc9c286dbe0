"""The driver's stop protocol without SGLang (run as `python -m tests.distributed.stop_worker OVERRIDES`).

Like `dapo_megatron.train`: the job config for this world size, the parallel layout, the tiny policy,
resuming from the latest checkpoint, and `StopRequest` checked at every step boundary. Like its process
tree too: every rank starts an "engine" child before the stop request is installed (SGLang is started
before the training loop) and a spawned "reward worker" after it. A step is a "rollout" (rank 0 works
while the others wait in a broadcast, as they wait for generation) and an "update" (every rank works, then
an all-reduce); each phase lasts long enough for the test to signal inside it. Rank 0 writes
`<output_dir>/phase` ("rollout 3", "update 3") and `<output_dir>/steps_done` for the test to watch.

On stop: the checkpoint is written, the children must still be alive (a signal that killed one fails the
run) and are shut down cleanly, and the process exits 0.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

PHASE_S = 1.5
ENGINE = "import sys; sys.stdin.read()"  # lives until its stdin closes, then exits 0


def reward(value: int) -> int:
    return value + 1


def main() -> int:
    import torch

    from dapo_megatron import checkpoint
    from dapo_megatron import config as job_config
    from dapo_megatron.distributed.launch import process_env
    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.distributed.stop import StopRequest
    from dapo_megatron.models.qwen2 import build_gpt_model

    job = job_config.load(sys.argv[1:], world_size=process_env().world_size)
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdin=subprocess.PIPE)
    layout = initialize(job.parallel, job.seed)
    out, root = Path(job.output_dir), Path(job.output_dir) / "checkpoints"
    try:
        model = build_gpt_model(job.model, job.parallel, layout)
        step = 0
        if (root / checkpoint.TRACKER_FILE).exists():
            checkpoint.load_model(model, root)
            step = int((root / checkpoint.TRACKER_FILE).read_text())
            if layout.is_logging_rank:
                print(f"resumed from step {step}", flush=True)
        stop = StopRequest()
        rewards = multiprocessing.get_context("spawn").Pool(1)
        reward_worker = rewards.apply(os.getpid)  # a pool replaces dead workers: compare pids at the end
        while step < job.trainer.total_steps and not stop.requested():
            step += 1
            mark(layout.is_logging_rank, out, "phase", f"rollout {step}")
            objects = [None]
            if layout.is_logging_rank:
                time.sleep(PHASE_S)
                objects = [rewards.apply(reward, (step,))]
            torch.distributed.broadcast_object_list(objects, src=0)
            mark(layout.is_logging_rank, out, "phase", f"update {step}")
            time.sleep(PHASE_S)
            torch.distributed.all_reduce(torch.tensor([objects[0]]))
            mark(layout.is_logging_rank, out, "steps_done", str(step))
            if engine.poll() is not None:
                raise RuntimeError(
                    f"the engine child died during step {step}: exit status {engine.returncode}"
                )
        saved = checkpoint.save_model(model, root, step, job.model, layout)
        if rewards.apply(os.getpid) != reward_worker:
            raise RuntimeError("the reward worker died and was replaced")
        rewards.close()
        rewards.join()
        engine.stdin.close()
        if engine.wait() != 0:
            raise RuntimeError(f"the engine child exited with status {engine.returncode}")
        if layout.is_logging_rank:
            print(
                f"stopped at step {step} of {layout.world_size} ranks; checkpoint {saved}; children exited "
                f"cleanly",
                flush=True,
            )
    finally:
        if engine.poll() is None:
            engine.kill()
        shutdown()
    return 0


def mark(logging_rank: bool, out: Path, name: str, text: str) -> None:
    if logging_rank:
        (out / name).write_text(text)


if __name__ == "__main__":
    sys.exit(main())
