"""DAPO overlong reward shaping: soft punishment of long responses, optional overlong filtering."""

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

TRUNCATED_FINISH_REASON = "length"
"""Finish reason of a response cut at the length limit (SGLang/OpenAI ``finish_reason`` type)."""


def overlong_penalty(
    response_length: Tensor | int,
    *,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> Tensor | float:
    """Soft overlong punishment (paper Eq. 13), added to the outcome reward.

    With ``expected = max_response_length − buffer_length``::

        0                                               if length <= expected
        −penalty_factor · (length − expected) / buffer  if expected < length <= max_response_length
        −penalty_factor                                 if length > max_response_length

    ``response_length`` counts the response tokens including EOS (the reward sits on token L − 1).

    Args:
        response_length: ``int`` or integer/float tensor of any shape.

    Returns:
        A ``float`` for ``int`` input, else a float32 tensor of the same shape (float64 maths inside
        so that e.g. 1/4096 is not rounded before the final cast).
    """
    if not buffer_length > 0:
        raise ValueError(f"overlong buffer_length must be > 0; got {buffer_length}")
    if not max_response_length >= buffer_length:
        raise ValueError(
            f"max_response_length ({max_response_length}) must be >= overlong buffer_length ({buffer_length})"
        )
    if not penalty_factor >= 0.0:
        raise ValueError(f"overlong penalty_factor must be >= 0; got {penalty_factor}")
    expected_length = max_response_length - buffer_length
    if isinstance(response_length, Tensor):
        excess = (response_length.to(torch.float64) - expected_length) / buffer_length
        return (-penalty_factor * excess.clamp(0.0, 1.0)).to(torch.float32)
    excess = min(max((response_length - expected_length) / buffer_length, 0.0), 1.0)
    return -penalty_factor * excess


def overlong_filter_mask(
    truncated: Tensor | Sequence[str | Mapping[str, object]],
    response_mask: Tensor,
) -> Tensor:
    """``response_mask`` ``[batch, response_len]`` with every truncated response's row zeroed.

    Args:
        truncated: ``[batch]`` bool tensor (True = cut at the length limit), or one finish reason
            per response: a string, or a mapping with a ``"type"`` key as SGLang's
            ``meta_info["finish_reason"]``; ``"length"`` means truncated.
        response_mask: ``[batch, response_len]`` of any dtype.

    Returns:
        A new mask of ``response_mask``'s dtype and shape.
    """
    if not isinstance(truncated, Tensor):
        truncated = torch.tensor(
            [_finish_type(reason) == TRUNCATED_FINISH_REASON for reason in truncated],
            dtype=torch.bool,
            device=response_mask.device,
        )
    if truncated.shape != response_mask.shape[:1]:
        raise ValueError(
            f"need one truncation flag per response: got {tuple(truncated.shape)} for mask "
            f"{tuple(response_mask.shape)}"
        )
    keep = ~truncated.to(device=response_mask.device, dtype=torch.bool)
    return response_mask * keep.unsqueeze(-1).to(response_mask.dtype)


def _finish_type(reason: str | Mapping[str, object]) -> object:
    return reason.get("type") if isinstance(reason, Mapping) else reason
