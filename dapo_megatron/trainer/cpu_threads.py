"""Intra-op threads of a CPU trainer that shares its cores with the rollout engine.

On CPU the SGLang engine and the policy compute on the same cores. While the engine generates beside an
update (the batch ahead, `trainer.overlap_rollout`) the trainer keeps to the threads it was started with
(OMP_NUM_THREADS; the demo sets 1, the engine takes 1; unset: the rank's share of the cores less the
engine's thread, not torch's default of every core): more would oversubscribe the cores and gained nothing
when measured (~30M parameters: 27.9 s per step with two passive-waiting trainer threads beside the engine,
against 28-30 s with one; beside an engine that spun a core, two threads trained 2.5x slower). Whenever the
engine has nothing to generate (a synchronous update, or the batch ahead is already complete) the trainer
takes this rank's whole share of the cores. On GPUs nothing changes.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch

from dapo_megatron.rollout.engine import CPU_ENGINE_THREADS


def cores_per_rank(ranks_on_node: int) -> int:
    """This process's share of the cores it may run on (its CPU affinity, which Slurm and taskset narrow)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, ranks_on_node))


class TrainerThreads:
    """torch's intra-op thread count for the two states of the engine. Call from the training thread: under
    OpenMP the count belongs to the calling thread's parallel regions."""

    def __init__(self, *, beside_engine: int, alone: int) -> None:
        if beside_engine < 1 or alone < beside_engine:
            raise ValueError(f"need 1 <= beside_engine <= alone threads; got {beside_engine} and {alone}")
        self.beside_engine, self.alone = beside_engine, alone
        self._batch: Future[Any] | None = None

    @classmethod
    def for_job(cls, device_type: str, *, use_idle_cores: bool, ranks_on_node: int) -> TrainerThreads:
        started_with = torch.get_num_threads()
        if device_type != "cpu":
            return cls(beside_engine=started_with, alone=started_with)
        share = cores_per_rank(ranks_on_node)
        # Without OMP_NUM_THREADS torch starts on every core, the engine's too: leave the engine the one thread
        # it is started with (CPU_ENGINE_THREADS; a count the user set goes to both).
        beside = started_with if os.environ.get("OMP_NUM_THREADS") else max(1, share - CPU_ENGINE_THREADS)
        return cls(beside_engine=beside, alone=max(beside, share) if use_idle_cores else beside)

    def engine_generating(self, batch: Future[Any] | None) -> None:
        """The engine now generates `batch` beside the update (None on ranks that do not hold it: they keep to
        their own threads until `engine_idle`)."""
        self._batch = batch
        torch.set_num_threads(self.beside_engine)

    def engine_idle(self) -> None:
        self._batch = None
        torch.set_num_threads(self.alone)

    def take_idle_cores(self) -> None:
        """Between optimizer steps: once the batch generated ahead is complete the engine is idle, and the
        rest of the update gets its cores."""
        if self._batch is not None and self._batch.done():
            self.engine_idle()
