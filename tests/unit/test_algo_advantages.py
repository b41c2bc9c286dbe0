"""GRPO advantages: unbiased group std, singleton and constant groups, interleaved groups."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.algo.advantages import compute_grpo_advantages

S3 = math.sqrt(3.0) / 2.0  # 1 / (2/sqrt(3)): {+1,-1,-1,+1} has mean 0, unbiased std 2/sqrt(3)


def _adv(scores: list[float], groups: list[int], **kwargs: object) -> list[float]:
    return compute_grpo_advantages(torch.tensor(scores), torch.tensor(groups), **kwargs).tolist()


def test_four_sample_group() -> None:
    assert _adv([1.0, -1.0, -1.0, 1.0], [0, 0, 0, 0]) == pytest.approx([S3, -S3, -S3, S3], abs=1e-6)
    assert math.isclose(S3, 0.866025, abs_tol=1e-6)


def test_two_sample_group() -> None:
    assert _adv([-1.0, 1.0], [7, 7]) == pytest.approx([-0.707107, 0.707107], abs=1e-6)


def test_constant_group_is_exactly_zero() -> None:
    assert _adv([1.0, 1.0, 1.0], [0, 0, 0]) == [0.0, 0.0, 0.0]
    # 0.1 has no exact binary form: mean(0.1, 0.1, 0.1) != 0.1 in float, yet the result is exactly 0
    assert _adv([0.1, 0.1, 0.1], [3, 3, 3]) == [0.0, 0.0, 0.0]
    assert _adv([0.1, 0.1], [3, 3], eps=0.0) == [0.0, 0.0]


def test_singleton_keeps_raw_score() -> None:
    # mean 0, std 1: the score divided by (1 + eps), as in verl
    assert _adv([0.7], [0]) == pytest.approx([0.7 / (1 + 1e-6)], rel=1e-7)
    assert _adv([-1.0], [0], norm_by_std=False) == pytest.approx([-1.0])


def test_interleaved_groups_in_one_call() -> None:
    scores = [1.0, -1.0, 5.0, -1.0, 2.0, 1.0, 2.0, -1.0, 3.0]
    groups = [10, 20, 30, 10, 40, 20, 40, 10, 20]
    # group 10: {1, -1, -1} mean -1/3, unbiased std sqrt((16/9 + 4/9 + 4/9)/2) = sqrt(4/3)
    # group 20: {-1, 1, 3} mean 1, std 2; group 30: singleton 5; group 40: constant {2, 2}
    std10 = math.sqrt(4.0 / 3.0)
    expected = [
        (1 + 1 / 3) / std10,
        -1.0,
        5.0,
        (-1 + 1 / 3) / std10,
        0.0,
        0.0,
        0.0,
        (-1 + 1 / 3) / std10,
        1.0,
    ]
    assert _adv(scores, groups) == pytest.approx(expected, abs=1e-5)
    centred = [1 + 1 / 3, -2.0, 5.0, -1 + 1 / 3, 0.0, 0.0, 0.0, -1 + 1 / 3, 2.0]
    assert _adv(scores, groups, norm_by_std=False) == pytest.approx(centred, abs=1e-6)


def test_hashable_group_ids_match_integer_ids() -> None:
    scores = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.5])
    by_str = compute_grpo_advantages(scores, ["a", "b", "a", "b", "c"])
    by_int = compute_grpo_advantages(scores, torch.tensor([0, 1, 0, 1, 2]))
    torch.testing.assert_close(by_str, by_int)


def test_eps_is_added_to_std_not_variance() -> None:
    # {0, 2}: unbiased std sqrt(2); with eps = 1 the advantage is 1 / (sqrt(2) + 1)
    assert _adv([0.0, 2.0], [0, 0], eps=1.0) == pytest.approx(
        [-1 / (math.sqrt(2) + 1), 1 / (math.sqrt(2) + 1)]
    )


def test_dtype_and_validation() -> None:
    assert compute_grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0])).dtype == torch.float32
    assert compute_grpo_advantages(torch.tensor([1.0], dtype=torch.float64), [0]).dtype == torch.float64
    assert compute_grpo_advantages(torch.empty(0), torch.empty(0, dtype=torch.long)).numel() == 0
    with pytest.raises(ValueError, match="one id per score"):
        compute_grpo_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="integer"):
        compute_grpo_advantages(torch.tensor([1.0]), torch.tensor([0.5]))


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(0, 5), st.floats(-3, 3, allow_nan=False).map(lambda x: round(x, 2))),
        min_size=1,
        max_size=40,
    )
)
def test_matches_per_group_loop_reference(data: list[tuple[int, float]]) -> None:
    groups = torch.tensor([g for g, _ in data])
    scores = torch.tensor([s for _, s in data], dtype=torch.float64)
    got = compute_grpo_advantages(scores, groups)
    expected = torch.empty_like(scores)
    for g in groups.unique():
        members = groups == g
        values = scores[members]
        if values.numel() == 1:
            expected[members] = values / (1.0 + 1e-6)
        else:
            expected[members] = (values - values.mean()) / (values.std() + 1e-6)
    # Constant groups: the reference gives rounding residue / eps, ours exactly 0.
    for g in groups.unique():
        values = scores[groups == g]
        if values.numel() > 1 and bool((values == values[0]).all()):
            expected[groups == g] = 0.0
    torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9)
