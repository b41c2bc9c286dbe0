"""DAPO's group filter and the batch collector that admits groups in draw order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dapo_megatron.algo.dynamic_sampling import BatchCollector, judge_group


@pytest.mark.parametrize(
    ("accuracies", "reason"),
    [
        ([True, True, True], "all_correct"),
        ([False, False], "all_wrong"),
        ([True, False, False], "mixed"),
        ([False, True], "mixed"),
        ([True], "singleton"),
        ([False], "singleton"),
    ],
)
def test_judge_group(accuracies: list[bool], reason: str) -> None:
    assert judge_group(accuracies) == reason


def test_empty_group_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        judge_group([])


def test_collector_admits_in_draw_order_and_counts_reasons() -> None:
    collector: BatchCollector[str] = BatchCollector(target_groups=2)
    assert collector.offer(1, "b", [True, False]) == "mixed"
    assert collector.kept == []  # group 0 is still generating: b waits for its turn
    assert collector.offer(0, "a", [True, True]) == "all_correct"
    assert collector.kept == ["b"] and not collector.full
    assert collector.offer(3, "d", [False, True]) == "mixed"
    assert collector.offer(4, "e", [True, False]) == "mixed"
    assert collector.kept == ["b"]
    assert collector.offer(2, "c", [False, False]) == "all_wrong"
    assert collector.full and collector.kept == ["b", "d"]
    assert collector.offer(6, "g", [True, True]) == "all_correct"
    assert collector.leftover() == {4: "e", 6: None}
    metrics = collector.metrics()
    assert metrics["kept_groups"] == 2 and metrics["judged_groups"] == 6
    assert metrics["drop_all_correct"] == 2 and metrics["drop_all_wrong"] == 1
    assert metrics["keep_ratio"] == pytest.approx(3 / 6)


def test_without_the_filter_every_group_is_kept_and_judged_for_the_metrics() -> None:
    collector: BatchCollector[str] = BatchCollector(target_groups=3)
    assert [
        collector.take(g, a) for g, a in (("a", [True, True]), ("b", [False, True]), ("c", [False, False]))
    ] == ["all_correct", "mixed", "all_wrong"]
    assert collector.full and collector.kept == ["a", "b", "c"]
    metrics = collector.metrics()
    assert (
        metrics["keep_ratio"] == pytest.approx(1 / 3) and metrics["judged_groups"] == 3
    )  # the informative share


def test_carried_groups_take_their_place_in_the_order() -> None:
    collector: BatchCollector[str] = BatchCollector(target_groups=2)
    collector.carry_in(1, "y")
    assert collector.kept == []  # prompt 0 (aborted last step) is generated again first
    collector.offer(0, "x", [True, False])
    assert collector.full and collector.kept == ["x", "y"]
    assert collector.metrics()["carried_over"] == 1


def test_a_group_resolved_twice_is_an_error() -> None:
    collector: BatchCollector[str] = BatchCollector(target_groups=3)
    collector.offer(0, "a", [True, False])
    with pytest.raises(ValueError, match="group 0 was already resolved"):
        collector.offer(0, "a", [True, False])


@given(
    st.permutations(range(30)),
    st.lists(st.lists(st.booleans(), min_size=1, max_size=6), min_size=30, max_size=30),
    st.integers(1, 10),
)
def test_the_batch_does_not_depend_on_completion_order(
    order: list[int], groups: list[list[bool]], target: int
) -> None:
    """Whatever order the groups complete in, the batch is the first `target` informative ones by draw."""
    collector: BatchCollector[int] = BatchCollector(target_groups=target)
    for index in order:
        collector.offer(index, index, groups[index])
    informative = [i for i, acc in enumerate(groups) if len(acc) == 1 or 0 < sum(acc) < len(acc)]
    assert collector.kept == informative[:target]
    assert sorted(g for g in collector.leftover().values() if g is not None) == informative[target:]
