"""Soft overlong punishment and overlong filtering."""

import pytest
import torch

from dapo_megatron.algo.reward_shaping import overlong_filter_mask, overlong_penalty

# DAPO: max 20480, buffer 4096 -> penalty starts after 16384 tokens, reaches -1 at 20480.
LENGTH_TO_PENALTY = [
    (100, 0.0),
    (16384, 0.0),
    (16385, -0.000244),  # -1/4096
    (18432, -0.5),
    (20479, -0.999756),  # -4095/4096
    (20480, -1.0),
    (25000, -1.0),  # beyond the maximum: capped at -penalty_factor
]


@pytest.mark.parametrize(("length", "penalty"), LENGTH_TO_PENALTY)
def test_int_lengths(length: int, penalty: float) -> None:
    got = overlong_penalty(length, max_response_length=20480, buffer_length=4096)
    assert isinstance(got, float)
    assert got == pytest.approx(penalty, abs=1e-6)


def test_tensor_lengths() -> None:
    lengths = torch.tensor([length for length, _ in LENGTH_TO_PENALTY])
    got = overlong_penalty(lengths, max_response_length=20480, buffer_length=4096)
    assert got.dtype == torch.float32 and got.shape == lengths.shape
    torch.testing.assert_close(got, torch.tensor([p for _, p in LENGTH_TO_PENALTY]), atol=1e-6, rtol=0)
    assert got[2].item() == pytest.approx(-1 / 4096, rel=1e-6)


def test_penalty_factor_scales() -> None:
    assert overlong_penalty(
        18432, max_response_length=20480, buffer_length=4096, penalty_factor=0.5
    ) == pytest.approx(-0.25)
    assert overlong_penalty(
        30000, max_response_length=20480, buffer_length=4096, penalty_factor=2.0
    ) == pytest.approx(-2.0)


def test_buffer_equal_to_max_starts_at_zero_length() -> None:
    assert overlong_penalty(5, max_response_length=10, buffer_length=10) == pytest.approx(-0.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_response_length": 20480, "buffer_length": 0}, "buffer_length must be > 0"),
        ({"max_response_length": 100, "buffer_length": 4096}, "must be >= overlong buffer_length"),
        ({"max_response_length": 20480, "buffer_length": 4096, "penalty_factor": -1.0}, "penalty_factor"),
    ],
)
def test_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        overlong_penalty(100, **kwargs)


def test_filter_mask_from_bools() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    got = overlong_filter_mask(torch.tensor([False, True, False]), mask)
    assert torch.equal(got, torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]]))
    assert got.dtype == mask.dtype


def test_filter_mask_from_finish_reasons() -> None:
    mask = torch.ones(3, 2, dtype=torch.float32)
    reasons = ["stop", {"type": "length", "length": 2}, {"type": "stop", "matched": 151645}]
    got = overlong_filter_mask(reasons, mask)
    assert torch.equal(got, torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(
        overlong_filter_mask(["length", "stop", "abort"], mask.bool())[:, 0],
        torch.tensor([False, True, True]),
    )


def test_filter_mask_shape_check() -> None:
    with pytest.raises(ValueError, match="one truncation flag per response"):
        overlong_filter_mask(torch.tensor([True]), torch.ones(2, 3))
