"""The file through which the trainer changes a CPU engine's intra-op threads: what one side writes, the
other takes at its next forward pass (the engine side runs here in-process; tests/integration runs it in a
real SGLang engine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dapo_megatron.backends import engine_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_request_is_taken_at_the_next_forward_pass(tmp_path: Path, restore_threads: None) -> None:
    path = tmp_path / "engine.threads"
    engine_threads.request_threads(path, 1)
    follow = engine_threads._Follower(str(path))
    follow()
    assert torch.get_num_threads() == 1
    engine_threads.request_threads(path, 2)  # in place: the follower's open file sees it
    assert torch.get_num_threads() == 1  # nothing changes until the engine's next forward pass
    follow()
    assert torch.get_num_threads() == 2
    engine_threads.request_threads(path, 1)
    follow()
    assert torch.get_num_threads() == 1


def test_a_file_without_a_count_changes_nothing(tmp_path: Path, restore_threads: None) -> None:
    path = tmp_path / "engine.threads"
    path.touch()
    torch.set_num_threads(1)
    engine_threads._Follower(str(path))()
    assert torch.get_num_threads() == 1


def test_a_narrower_count_overwrites_a_wider_one_whole(tmp_path: Path, restore_threads: None) -> None:
    path = tmp_path / "engine.threads"
    engine_threads.request_threads(path, 16)
    engine_threads.request_threads(path, 2)
    assert path.read_bytes().strip() == b"2"
    torch.set_num_threads(1)
    engine_threads._Follower(str(path))()
    assert torch.get_num_threads() == 2


def test_zero_threads_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        engine_threads.request_threads(tmp_path / "engine.threads", 0)


def test_follow_does_nothing_outside_an_engine(
    monkeypatch: pytest.MonkeyPatch, restore_threads: None
) -> None:
    monkeypatch.delenv(engine_threads.THREADS_FILE_ENV, raising=False)
    engine_threads._follower.cache_clear()
    before = torch.get_num_threads()
    engine_threads.follow()
    assert torch.get_num_threads() == before
    engine_threads._follower.cache_clear()


class _RecordingModel(torch.nn.Module):
    """Stands for SGLang's model: records the threads its `load_weights` copies on."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4))
        self.threads: list[int] = []

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.threads.append(torch.get_num_threads())
        for _, tensor in named_tensors:
            self.weight.data.copy_(tensor)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: every thread count is the same")
def test_a_weight_update_copies_on_every_core_then_generation_gets_its_threads_back(
    restore_threads: None,
) -> None:
    from dapo_megatron.backends import cpu_weight_loader

    torch.set_num_threads(1)  # the engine's generation threads beside a training trainer
    model = _RecordingModel()
    cpu_weight_loader.load_keeping_mappings(model, [("weight", torch.ones(4))])
    assert model.threads == [len(os.sched_getaffinity(0))]
    assert torch.get_num_threads() == 1
    assert torch.equal(model.weight.data, torch.ones(4))
    cpu_weight_loader._held.clear()
