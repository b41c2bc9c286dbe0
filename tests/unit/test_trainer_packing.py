"""Token-budget micro-batch planning (trainer/packing.py): hand-computed plans and invariants."""

from __future__ import annotations

import random

import pytest

from dapo_megatron.trainer.packing import fixed_size_plan, padded_tokens, token_budget_plan


def dapo_like_widths(rows: int, seed: int) -> list[int]:
    """Prompts of 50-400 tokens, log-normal responses (median 3000) clipped at 20480: a long tail."""
    rng = random.Random(seed)
    return [rng.randint(50, 400) + min(20480, int(rng.lognormvariate(8.0, 0.9))) for _ in range(rows)]


def test_longest_rows_first_then_greedy_fill() -> None:
    # Sorted: rows 1, 2, 4 (5 tokens), then 0, 3, 5 (4): three rows fill 15 tokens. Halving [1, 2, 4]
    # would not take 1% off the 27 tokens computed, so two micro-batches stay.
    assert token_budget_plan([4, 5, 5, 4, 5, 4], ranks=1, max_tokens=15) == [[[1, 2, 4], [0, 3, 5]]]


def test_micro_batches_split_until_every_rank_has_as_many() -> None:
    # Packed: [0] and [1, 2, 3] (3 x 2 = 6 tokens): two micro-batches for three ranks, so the costliest
    # with two rows or more is halved. Costliest first to the least loaded rank: [0]=10, [2, 3]=4, [1]=2.
    assert token_budget_plan([10, 2, 2, 2], ranks=3, max_tokens=10) == [[[0]], [[2, 3]], [[1]]]


def test_one_more_micro_batch_per_rank_when_it_balances_better() -> None:
    # Packed: [0, 1] (20 tokens) and [2..9] (16): one each, ranks at 20 and 16. Halving both gives
    # 10 + 8 per rank; halving again would not lower the busiest rank's 18.
    widths = [10, 10, 2, 2, 2, 2, 2, 2, 2, 2]
    assert token_budget_plan(widths, ranks=2, max_tokens=20) == [[[0], [2, 3, 4, 5]], [[1], [6, 7, 8, 9]]]


def test_empty_micro_batches_only_when_rows_run_out() -> None:
    # Three full-budget rows, two ranks: four forward passes are needed, one of them has no row.
    plan = token_budget_plan([10, 10, 10], ranks=2, max_tokens=10)
    assert [len(rank) for rank in plan] == [2, 2]
    assert sorted(len(mb) for rank in plan for mb in rank) == [0, 1, 1, 1]
    assert all(any(rank) for rank in plan), "every rank keeps a real row"


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_every_row_once_within_budget_and_equal_counts(ranks: int) -> None:
    widths = dapo_like_widths(203, seed=ranks)
    budget = 2 * 22528
    plan = token_budget_plan(widths, ranks=ranks, max_tokens=budget)
    assert sorted(row for rank in plan for mb in rank for row in mb) == list(range(len(widths)))
    assert all(padded_tokens(mb, widths) <= budget for rank in plan for mb in rank)
    assert len({len(rank) for rank in plan}) == 1, "ranks run different numbers of micro-batches"


def test_little_padding_and_balanced_ranks() -> None:
    # A mini-batch of 512 DAPO-like rows over 8 ranks; arbitrary grouping pads to ~0.6 real tokens and
    # round-robin dealing leaves ranks uneven, so these bounds tell the planner apart from both.
    widths = dapo_like_widths(512, seed=0)
    plan = token_budget_plan(widths, ranks=8, max_tokens=2 * 22528)
    loads = [sum(padded_tokens(mb, widths) for mb in rank) for rank in plan]
    assert sum(widths) / sum(loads) >= 0.97
    assert max(loads) / (sum(loads) / len(loads)) <= 1.05


def test_the_budget_counts_the_padding_the_model_computes() -> None:
    # FP8 at TP 8 with sequence parallelism pads micro-batches to a multiple of 128, so 300-token rows cost
    # 384 tokens each: three fit a 1000-token budget as 900 real tokens, but would compute 1152.
    widths = [300, 300, 300, 300]
    assert token_budget_plan(widths, ranks=1, max_tokens=1000) == [[[0, 1, 2], [3]]]
    plan = token_budget_plan(widths, ranks=1, max_tokens=1000, multiple=128)
    assert plan == [[[0, 1], [2, 3]]]
    assert [padded_tokens(mb, widths, 128) for mb in plan[0]] == [768, 768]


def test_a_row_too_wide_once_padded_names_both_lengths() -> None:
    with pytest.raises(
        ValueError,
        match=r"a row of 300 tokens \(384 as computed: .* multiple of 128\) does not "
        r"fit the micro-batch budget of 320 tokens",
    ):
        token_budget_plan([300, 10], ranks=1, max_tokens=320, multiple=128)


def test_too_wide_row_and_too_few_rows_are_errors() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        token_budget_plan([5, 11], ranks=1, max_tokens=10)
    with pytest.raises(ValueError, match="3 data-parallel ranks"):
        token_budget_plan([5, 5], ranks=3, max_tokens=10)


def test_fixed_size_plan_is_consecutive_rows() -> None:
    assert fixed_size_plan([[0, 1, 2, 3, 4], [5, 6]], 2) == [[[0, 1], [2, 3], [4]], [[5, 6]]]
