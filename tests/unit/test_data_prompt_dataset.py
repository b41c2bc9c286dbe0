"""The prompt stream: the seeded per-epoch order, exact resume from a state dict (and refusing another
data set's), file-order access and the empty data set."""

from __future__ import annotations

import json

import pytest

from dapo_megatron.data.errors import DatasetError
from dapo_megatron.data.prompt_dataset import PromptDataset
from dapo_megatron.records import PromptExample


def examples(n: int) -> list[PromptExample]:
    return [
        PromptExample(
            uid=f"u{i}",
            prompt=f"p{i}",
            ground_truth=str(i),
            data_source="math_dapo",
            messages=({"role": "user", "content": f"p{i}"},),
            origin=f"test, line {i + 1}",
        )
        for i in range(n)
    ]


def test_seeded_order_is_reproducible_and_epochs_reshuffle() -> None:
    first, again, other = (PromptDataset(examples(10), seed=s) for s in (3, 3, 4))
    epoch0 = [e.uid for _ in range(2) for e in first.next_batch(4)]
    assert epoch0 == [e.uid for _ in range(2) for e in again.next_batch(4)]
    assert epoch0 != [e.uid for _ in range(2) for e in other.next_batch(4)]
    assert (first.epoch, first.index, first.remaining_in_epoch) == (0, 8, 2)
    epoch1 = [e.uid for _ in range(2) for e in first.next_batch(4)]  # the 2 left over are dropped
    assert first.epoch == 1 and epoch1 != epoch0
    assert sorted(first.epoch_order(1)) == list(range(10)) and first.batches_per_epoch(4) == 2


def test_state_dict_resumes_exactly_mid_epoch() -> None:
    original = PromptDataset(examples(7), seed=11)
    for _ in range(5):  # 2 full epochs of 3 batches of 2 would be 6; stop mid-epoch 1
        original.next_batch(2)
    state = json.loads(json.dumps(original.state_dict()))
    assert (state["epoch"], state["index"]) == (1, 4)
    resumed = PromptDataset(examples(7), seed=11)
    resumed.load_state_dict(state)
    assert [[e.uid for e in original.next_batch(2)] for _ in range(6)] == [
        [e.uid for e in resumed.next_batch(2)] for _ in range(6)
    ]


def test_state_dict_refuses_other_data_or_seed() -> None:
    state = PromptDataset(examples(7), seed=11).state_dict()
    with pytest.raises(DatasetError, match="checkpoint has seed=11"):
        PromptDataset(examples(7), seed=12).load_state_dict(state)
    with pytest.raises(DatasetError, match="checkpoint has size=7"):
        PromptDataset(examples(8), seed=11).load_state_dict(state)
    with pytest.raises(DatasetError, match="invalid data set position"):
        PromptDataset(examples(7), seed=11).load_state_dict({**state, "index": 8})


def test_unshuffled_order_take_and_empty() -> None:
    dataset = PromptDataset(examples(5), shuffle=False)
    assert [e.uid for e in dataset.next_batch(3)] == ["u0", "u1", "u2"]
    assert [e.uid for e in dataset.take(2)] == ["u0", "u1"] and len(dataset.take(9)) == 5
    assert dataset[4].uid == "u4" and [e.uid for e in dataset[1:3]] == ["u1", "u2"]
    with pytest.raises(ValueError, match="batch_size must be in"):
        dataset.next_batch(6)
    with pytest.raises(DatasetError, match="empty"):
        PromptDataset([])
