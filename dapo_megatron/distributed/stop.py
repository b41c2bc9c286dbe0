"""A request to checkpoint and exit cleanly (the job's time limit is near).

Checked collectively at each step boundary (`requested`) and, by the driving rank alone, while a step
generates or evaluates (`seen_here`, polled by `trainer/rollout_side.py`, which then aborts the generation).
Two channels:

- the stop file named by `DAPO_STOP_FILE`: `slurm/launch.sh` creates it when SIGUSR1 reaches the node.
  Under Slurm a signal forwarded to a job step reaches *every* process of the step (torchrun, the trainer
  ranks, SGLang and its schedulers, reward workers), so the launcher starts all of them with SIGUSR1
  ignored and tells the trainers through this file instead. A trainer must keep the signal ignored:
  a process that handles a signal passes the default action (death) to the programs it `exec`s, so
  the SGLang and reward processes started later would die of it.
- SIGTERM and SIGUSR1 sent to the trainer process itself (a run outside the launcher), unless SIGUSR1
  was ignored when the process started (then the launcher owns it).

Every rank agrees before anyone acts (an all-reduce), so no collective is left half done.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch

STOP_FILE_ENV = "DAPO_STOP_FILE"


class StopRequest:
    """Install once per process from the main thread; `requested()` is collective."""

    def __init__(self) -> None:
        self._flag = False
        stop_file = os.environ.get(STOP_FILE_ENV)
        self._stop_file = Path(stop_file) if stop_file else None
        signal.signal(signal.SIGTERM, self._set)
        if signal.getsignal(signal.SIGUSR1) is not signal.SIG_IGN:
            signal.signal(signal.SIGUSR1, self._set)

    def _set(self, signum: int, frame: Any) -> None:
        self._flag = True

    def seen_here(self) -> bool:
        """This process's view, without asking the other ranks."""
        return self._flag or (self._stop_file is not None and self._stop_file.exists())

    def requested(self) -> bool:
        flag = torch.tensor([int(self.seen_here())])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
