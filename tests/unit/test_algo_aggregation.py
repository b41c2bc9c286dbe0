"""Loss aggregation modes and their global (cross-micro-batch) normalisers."""

import math

import pytest
import torch

from dapo_megatron.algo.aggregation import (
    LOSS_AGG_MODES,
    aggregate,
    count_sequences,
    count_tokens,
    masked_mean,
)

# Row 0: 3 valid tokens (1, 2, 3), row 1: 1 valid token (10), row 2: empty.
LOSS = torch.tensor([[1.0, 2.0, 3.0, 99.0], [10.0, 99.0, 99.0, 99.0], [99.0, 99.0, 99.0, 99.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 10) / 4),  # 4.0
        ("seq-mean-token-mean", (2.0 + 10.0) / 2),  # row means 2 and 10; the empty row is not counted
        ("seq-mean-token-sum", (6.0 + 10.0) / 2),
    ],
)
def test_modes_by_hand(mode: str, expected: float) -> None:
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_explicit_normalisers() -> None:
    assert aggregate(LOSS, MASK, "token-mean", num_tokens=8).item() == pytest.approx(16 / 8)
    assert aggregate(
        LOSS, MASK, "seq-mean-token-sum", num_sequences=torch.tensor(4.0)
    ).item() == pytest.approx(4.0)
    # num_tokens does not affect the seq modes and num_sequences not the token mode
    assert aggregate(LOSS, MASK, "seq-mean-token-mean", num_tokens=100).item() == pytest.approx(6.0)
    with pytest.raises(ValueError, match="non-negative"):
        aggregate(LOSS, MASK, "token-mean", num_tokens=-1)


def test_empty_mask_gives_zero_not_nan() -> None:
    empty = torch.zeros_like(MASK)
    for mode in LOSS_AGG_MODES:
        assert aggregate(LOSS, empty, mode).item() == 0.0
    assert masked_mean(LOSS, empty).item() == 0.0


def test_non_finite_values_under_the_mask_do_not_leak() -> None:
    loss = LOSS.clone().requires_grad_()
    poisoned = torch.where(MASK.bool(), loss, torch.full_like(loss, math.nan))
    value = aggregate(poisoned, MASK, "token-mean")
    value.backward()
    assert value.item() == pytest.approx(4.0)
    assert torch.isfinite(loss.grad).all()


def test_unknown_mode() -> None:
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        aggregate(LOSS, MASK, "token-sum")


def test_counts() -> None:
    assert count_tokens(MASK).item() == 4
    assert count_sequences(MASK).item() == 2


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_sum_with_global_normalisers_equals_whole_batch(mode: str) -> None:
    """Two 'DP ranks' x uneven micro-batches: Σ contributions == whole-batch value, grads too."""
    torch.manual_seed(0)
    lengths = torch.tensor([7, 1, 3, 0, 5, 2, 8])
    mask = (torch.arange(8)[None, :] < lengths[:, None]).float()
    values = torch.randn(7, 8, dtype=torch.float64)

    whole_input = values.clone().requires_grad_()
    whole = aggregate(whole_input, mask, mode)
    whole.backward()

    micro_input = values.clone().requires_grad_()
    micro_batches = [slice(0, 1), slice(1, 4), slice(4, 5), slice(5, 7)]  # uneven rows and tokens
    total = sum(
        aggregate(
            micro_input[rows],
            mask[rows],
            mode,
            num_tokens=count_tokens(mask),
            num_sequences=count_sequences(mask),
        )
        for rows in micro_batches
    )
    total.backward()
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(micro_input.grad, whole_input.grad)
    if mode == "token-mean":
        # every valid token carries weight 1/N_global
        torch.testing.assert_close(whole_input.grad, mask.double() / mask.sum())


def test_naive_mean_of_micro_batch_means_differs_for_uneven_lengths() -> None:
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    whole = aggregate(values, mask, "token-mean")  # (4 + 5) / 5 = 1.8
    naive = (aggregate(values[:1], mask[:1]) + aggregate(values[1:], mask[1:])) / 2  # (1 + 5) / 2 = 3
    assert whole.item() == pytest.approx(1.8)
    assert naive.item() == pytest.approx(3.0)
