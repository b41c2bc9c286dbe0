"""Intra-op threads of a CPU trainer that shares its cores with the rollout engine.

On CPU the SGLang engine and the policy compute on the same cores, so each takes the rank's whole share of
them only while the other is idle, and otherwise keeps to the threads it was started with. What each side
does is documented where it is switched on: `trainer.cpu_idle_cores` (the trainer, set here from the
training thread) and `rollout.cpu_idle_cores` (the engine, told through `backends/engine_threads.py`). On GPUs
nothing changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dapo_megatron.backends.base import Backend
from dapo_megatron.backends.cpu import CPU_ENGINE_THREADS

if TYPE_CHECKING:
    from dapo_megatron.rollout.engine import SGLangEngine


def cores_per_rank(ranks_on_node: int) -> int:
    """This process's share of the cores it may run on (its CPU affinity, which Slurm and taskset narrow)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, ranks_on_node))


def _check_counts(beside: int, alone: int, name: str) -> None:
    if beside < 1 or alone < beside:
        raise ValueError(f"need 1 <= {name} <= alone threads; got {beside} and {alone}")


@dataclass(frozen=True)
class EngineThreads:
    """A CPU engine's intra-op threads: its own beside an update, `alone` while the trainer waits for it."""

    request: Callable[[int], None]  # takes effect at the engine's next forward pass
    beside_trainer: int
    alone: int

    def __post_init__(self) -> None:
        _check_counts(self.beside_trainer, self.alone, "beside_trainer")


class TrainerThreads:
    """torch's intra-op thread count for the two states of the engine, and, given this rank's CPU engine, that
    engine's count for the states of the trainer. Call from the training thread: under OpenMP the count
    belongs to the calling thread's parallel regions."""

    def __init__(self, *, beside_engine: int, alone: int, engine: EngineThreads | None = None) -> None:
        _check_counts(beside_engine, alone, "beside_engine")
        self.beside_engine, self.alone, self.engine = beside_engine, alone, engine
        self._batch: Future[Any] | None = None

    @classmethod
    def for_job(
        cls,
        backend: Backend,
        *,
        use_idle_cores: bool,
        ranks_on_node: int,
        engine: SGLangEngine | None = None,
        engine_idle_cores: bool = False,
    ) -> TrainerThreads:
        """`engine`: the CPU engine this rank launched, if any; with `engine_idle_cores` it computes on the
        rank's share of the cores while the trainer waits for it."""
        started_with = torch.get_num_threads()
        if not backend.engine_follows_thread_count:  # no cores shared with an engine
            return cls(beside_engine=started_with, alone=started_with)
        share = cores_per_rank(ranks_on_node)
        # Without OMP_NUM_THREADS torch starts on every core, the engine's too: leave the engine the one
        # thread it is started with (CPU_ENGINE_THREADS; a count the user set goes to both).
        beside = started_with if os.environ.get("OMP_NUM_THREADS") else max(1, share - CPU_ENGINE_THREADS)
        engine_side = None
        if engine is not None and engine_idle_cores and share > engine.start_threads:
            engine_side = EngineThreads(
                engine.set_cpu_threads, beside_trainer=engine.start_threads, alone=share
            )
        return cls(
            beside_engine=beside, alone=max(beside, share) if use_idle_cores else beside, engine=engine_side
        )

    def engine_generating(self, batch: Future[Any] | None) -> None:
        """The engine now generates `batch` beside the update (None on ranks that do not hold it: they keep to
        their own threads until `engine_idle`)."""
        self._batch = batch
        if self.engine is not None:  # before the update starts computing
            self.engine.request(self.engine.beside_trainer)
        torch.set_num_threads(self.beside_engine)

    def trainer_waiting(self) -> None:
        """The update is done and the trainer waits for the engine: the engine may take the trainer's
        cores."""
        if self.engine is not None:
            self.engine.request(self.engine.alone)

    def engine_idle(self) -> None:
        """Nothing generates beside the trainer now; whatever the engine generates next, the trainer waits
        for."""
        self._batch = None
        self.trainer_waiting()
        torch.set_num_threads(self.alone)

    def take_idle_cores(self) -> None:
        """Between optimizer steps: once the batch generated ahead is complete the engine is idle, and the
        rest of the update gets its cores."""
        if self._batch is not None and self._batch.done():
            self.engine_idle()
