"""DAPO's group filter and the streaming batch collector with carry-over."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dapo_megatron.algo.dynamic_sampling import BatchCollector, judge_group


@pytest.mark.parametrize(("accuracies", "reason"), [
    ([True, True, True], "all_correct"), ([False, False], "all_wrong"), ([True, False, False], "mixed"),
    ([False, True], "mixed"), ([True], "singleton"), ([False], "singleton")])
def test_judge_group(accuracies: list[bool], reason: str) -> None:
    assert judge_group(accuracies) == reason


def test_empty_group_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        judge_group([])


def test_collector_fills_then_keeps_surplus_and_counts_reasons() -> None:
    collector: BatchCollector[str] = BatchCollector(target_groups=2)
    assert collector.offer("a", [True, True]) == "all_correct"
    assert collector.offer("b", [True, False]) == "mixed"
    assert not collector.full and collector.missing == 1
    assert collector.offer("c", [False, False]) == "all_wrong"
    assert collector.offer("d", [False, True]) == "mixed"
    assert collector.full and collector.kept == ["b", "d"]
    assert collector.offer("e", [True, False]) == "mixed"  # arrived after the batch filled (in flight)
    assert collector.surplus == ["e"] and collector.next_carry() == ["e"]
    metrics = collector.metrics()
    assert metrics["kept_groups"] == 2 and metrics["judged_groups"] == 5
    assert metrics["drop_all_correct"] == 1 and metrics["drop_all_wrong"] == 1
    assert metrics["keep_ratio"] == pytest.approx(3 / 5)


def test_carry_over_fills_the_next_batch_first() -> None:
    collector: BatchCollector[str] = BatchCollector(target_groups=2, carry=["x", "y", "z"])
    assert collector.full and collector.kept == ["x", "y"] and collector.surplus == ["z"]
    assert collector.metrics()["carried_over"] == 2
    assert collector.next_carry() == ["z"]


def test_carry_over_is_bounded() -> None:
    collector: BatchCollector[int] = BatchCollector(target_groups=1, max_carry=2)
    for group in range(5):
        collector.offer(group, [True, False])
    assert collector.next_carry() == [1, 2]
    assert collector.reasons["surplus_discarded"] == 2


@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=6), max_size=40), st.integers(1, 10))
def test_only_informative_groups_are_ever_kept(groups: list[list[bool]], target: int) -> None:
    collector: BatchCollector[int] = BatchCollector(target_groups=target)
    for index, accuracies in enumerate(groups):
        collector.offer(index, accuracies)
    kept = collector.kept + collector.surplus
    assert all(len(groups[i]) == 1 or 0 < sum(groups[i]) < len(groups[i]) for i in kept)
    assert len(collector.kept) == min(target, len(kept))
    assert kept == sorted(kept)  # arrival order is preserved
