"""When the colocated engines take GPU memory, against when every rank has freed its part (run under torchrun,
2 processes on gloo): the fleet's GPU path (`device="cuda"`) with stand-in engines and a stand-in weight push
that record, instead of doing, what they are asked; CPU torch makes `torch.cuda.empty_cache` a no-op.

Rank 1 is the slow one: its offload of the trainer's state and its update take SLOW_S longer than rank 0's.
Two layouts run one after the other:
- `shared`: one engine of TP 2 over both ranks' GPUs, launched by rank 0 (the 32B recipe's case: an engine's
  TP ranks run on its peers' GPUs);
- `apart`: one engine per rank (what the driving rank's requests to another rank's engine wait for).
Each rank appends `{"event", "rank", "t"}` lines (wall-clock time: the ranks share the host) to
`<dir>/<layout>.<rank>.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from dapo_megatron import backends
from dapo_megatron import config as C
from dapo_megatron.trainer import fleet as fleet_module
from dapo_megatron.trainer.fleet import EngineFleet

SLOW_S = 1.0


class Log:
    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.rank = path, rank

    def __call__(self, event: str) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": event, "rank": self.rank, "t": time.time()}) + "\n")


def stand_in_engine(log: Log) -> type:
    class StandInEngine:
        """What the fleet asks of an `SGLangEngine`, recorded."""

        def __init__(self, model_path: str, cfg: Any, **kwargs: Any) -> None:
            pass

        def launch(self) -> StandInEngine:
            log("launch")
            return self

        def release_memory(self, tags: list[str] | None = None) -> None:
            log("release")

        def resume_memory(self, tags: list[str]) -> None:
            log("resume " + ",".join(tags))

    return StandInEngine


class StandInPush:
    def __init__(self, log: Log) -> None:
        self.log = log

    def sync(self, model: object, version: str) -> None:
        self.log("push")


def run(layout: str, directory: Path, rank: int) -> None:
    log = Log(directory / f"{layout}.{rank}.jsonl", rank)
    engines = {"shared": ["rollout.engine_tp_size=2"], "apart": ["rollout.engine_tp_size=1"]}[layout]
    job = C.load(
        [*engines, "rollout.sync_check=off", f"output_dir={directory / layout}", "model.hf_dir=m"],
        world_size=2,
    )
    fleet_module.SGLangEngine = stand_in_engine(log)  # what `EngineFleet.launch` makes

    def offload() -> float:
        time.sleep(SLOW_S if rank == 1 else 0.0)
        log("offloaded")
        return 0.0

    fleet = EngineFleet(
        job, rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1", backend=backends.CUDA
    )
    # The set-up's order on GPUs (trainer/setup.py): the policy is built and its state offloaded, then the
    # engines launch.
    offload()
    fleet.launch()
    fleet.sync = StandInPush(log)  # type: ignore[assignment]
    # A step's order (train.py): the engines step aside, the update, the sync with the state's offload.
    fleet.release_memory()
    time.sleep(SLOW_S if rank == 1 else 0.0)
    log("updated")
    fleet.sync_weights(SimpleNamespace(model=None), None, 1, offload=offload)  # type: ignore[arg-type]
    log("synced")  # the driving rank's probe and rollouts go to every engine from here


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    try:
        for layout in ("shared", "apart"):
            run(layout, args.dir, rank)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
