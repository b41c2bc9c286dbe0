"""The CPU trainer's intra-op threads follow the engine: its own threads while the engine generates beside the
update, the rank's share of the cores once the engine is idle."""

from __future__ import annotations

import os
from concurrent.futures import Future

import pytest
import torch

from dapo_megatron import backends
from dapo_megatron.trainer.cpu_threads import TrainerThreads, cores_per_rank


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch):
    """A process started with one intra-op thread on four cores; torch's count restored afterwards."""
    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_cores_are_shared_among_the_ranks_of_the_node(one_thread: None) -> None:
    assert cores_per_rank(1) == 4
    assert cores_per_rank(2) == 2
    assert cores_per_rank(8) == 1  # never zero


@pytest.mark.parametrize(
    ("device", "enabled", "ranks", "alone"),
    [("cpu", True, 1, 4), ("cpu", True, 2, 2), ("cpu", False, 1, 1), ("cuda", True, 1, 1)],
)
def test_threads_alone_are_the_rank_share_only_on_cpu_when_enabled(
    one_thread: None, device: str, enabled: bool, ranks: int, alone: int
) -> None:
    threads = TrainerThreads.for_job(backends.named(device), use_idle_cores=enabled, ranks_on_node=ranks)
    assert (threads.beside_engine, threads.alone) == (1, alone)


@pytest.mark.parametrize(
    ("enabled", "ranks", "beside", "alone"),
    [(True, 1, 3, 4), (True, 2, 1, 2), (False, 1, 3, 3), (True, 4, 1, 1)],
)
def test_without_omp_num_threads_the_engine_keeps_its_core(
    one_thread: None, monkeypatch: pytest.MonkeyPatch, enabled: bool, ranks: int, beside: int, alone: int
) -> None:
    """torch's default would be every core, the engine's too."""
    monkeypatch.delenv("OMP_NUM_THREADS")
    threads = TrainerThreads.for_job(backends.CPU, use_idle_cores=enabled, ranks_on_node=ranks)
    assert (threads.beside_engine, threads.alone) == (beside, alone)
    assert (
        TrainerThreads.for_job(backends.CUDA, use_idle_cores=enabled, ranks_on_node=ranks).beside_engine
    ) == 1


def test_the_update_takes_the_engine_cores_once_the_batch_ahead_is_complete(one_thread: None) -> None:
    threads = TrainerThreads.for_job(backends.CPU, use_idle_cores=True, ranks_on_node=1)
    threads.engine_idle()
    assert torch.get_num_threads() == 4

    batch: Future[str] = Future()
    threads.engine_generating(batch)
    assert torch.get_num_threads() == 1
    threads.take_idle_cores()  # still generating: the engine keeps its core
    assert torch.get_num_threads() == 1
    batch.set_result("groups")
    threads.take_idle_cores()
    assert torch.get_num_threads() == 4


def test_ranks_that_cannot_see_the_batch_wait_for_the_engine_to_be_idle(one_thread: None) -> None:
    threads = TrainerThreads.for_job(backends.CPU, use_idle_cores=True, ranks_on_node=1)
    threads.engine_generating(None)
    threads.take_idle_cores()
    assert torch.get_num_threads() == 1
    threads.engine_idle()
    assert torch.get_num_threads() == 4


def test_impossible_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="beside_engine <= alone"):
        TrainerThreads(beside_engine=2, alone=1)


class RecordingEngine:
    """Stands for a CPU SGLangEngine's thread control: records the counts the trainer asks for."""

    def __init__(self, start_threads: int = 1) -> None:
        self.start_threads = start_threads
        self.requests: list[int] = []

    def set_cpu_threads(self, threads: int) -> None:
        self.requests.append(threads)


def test_the_engine_takes_the_rank_share_while_the_trainer_waits(one_thread: None) -> None:
    engine = RecordingEngine()
    threads = TrainerThreads.for_job(
        backends.CPU,
        use_idle_cores=True,
        ranks_on_node=1,
        engine=engine,  # type: ignore[arg-type]
        engine_idle_cores=True,
    )
    threads.engine_idle()
    assert engine.requests == [4]  # a synchronous rollout or an evaluation: the trainer waits
    batch: Future[str] = Future()
    threads.engine_generating(batch)
    assert engine.requests[-1] == 1  # beside the update: its own thread
    threads.take_idle_cores()
    assert engine.requests[-1] == 1
    threads.trainer_waiting()  # the update is done before the batch: the engine gets the cores
    assert engine.requests[-1] == 4
    assert torch.get_num_threads() == 1  # the trainer's own count does not change while it waits


@pytest.mark.parametrize(("enabled", "ranks", "start"), [(False, 1, 1), (True, 4, 1), (True, 1, 4)])
def test_the_engine_keeps_its_threads_when_off_or_when_there_is_nothing_to_take(
    one_thread: None, enabled: bool, ranks: int, start: int
) -> None:
    engine = RecordingEngine(start)
    threads = TrainerThreads.for_job(
        backends.CPU,
        use_idle_cores=True,
        ranks_on_node=ranks,
        engine=engine,  # type: ignore[arg-type]
        engine_idle_cores=enabled,
    )
    threads.engine_idle()
    threads.engine_generating(Future())
    threads.trainer_waiting()
    assert threads.engine is None and engine.requests == []


def test_gpu_engines_are_never_asked(one_thread: None) -> None:
    engine = RecordingEngine()
    threads = TrainerThreads.for_job(
        backends.CUDA,
        use_idle_cores=True,
        ranks_on_node=1,
        engine=engine,  # type: ignore[arg-type]
        engine_idle_cores=True,
    )
    threads.engine_idle()
    threads.trainer_waiting()
    assert engine.requests == []
