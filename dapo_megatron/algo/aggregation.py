"""Reduce a per-token loss matrix to a scalar (verl's ``agg_loss`` modes).

Every mode is written as ``sum of contributions / normaliser`` so that a trainer which splits an
optimizer mini-batch over data-parallel ranks and micro-batches can pass the GLOBAL normaliser
(valid tokens or non-empty sequences of the whole mini-batch). Summing the micro-batch results then
gives exactly the whole-mini-batch value, and so does summing their gradients. The trainer is
responsible for undoing any averaging the framework applies on top (e.g. DDP's mean over DP ranks or
the pipeline schedule's division by the number of micro-batches).
"""

import torch
from torch import Tensor

from dapo_megatron.algo.config import LOSS_AGG_MODES

Normaliser = Tensor | float | int


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is non-zero; 0 when the mask is empty.

    Used for metrics, which are local to one micro-batch. Shapes: ``values`` and ``mask`` broadcast
    to a common shape (typically ``[batch, response_len]``); returns a 0-dim tensor.
    """
    valid = mask.bool()
    total = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()
    return total / valid.sum().clamp_min(1).to(values.dtype)


def count_tokens(mask: Tensor) -> Tensor:
    """Number of valid tokens in ``mask`` ``[batch, response_len]`` as a 0-dim float tensor."""
    return mask.sum(dtype=torch.float32)


def count_sequences(mask: Tensor) -> Tensor:
    """Number of rows of ``mask`` ``[batch, response_len]`` with at least one valid token."""
    return (mask.sum(dim=-1) > 0).sum(dtype=torch.float32)


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: Normaliser | None = None,
    num_sequences: Normaliser | None = None,
) -> Tensor:
    """Aggregate ``per_token`` ``[batch, response_len]`` over valid positions of ``mask`` (same shape).

    Modes (``L`` = per-token values, ``m`` = mask, rows = sequences):

    * ``token-mean``: ``Σ L·m / num_tokens``; ``num_tokens`` defaults to ``Σ m`` (local).
    * ``seq-mean-token-mean``: ``Σ_rows (Σ_t L·m / Σ_t m) / num_sequences``.
    * ``seq-mean-token-sum``: ``Σ_rows Σ_t L·m / num_sequences``.

    ``num_sequences`` defaults to the number of non-empty rows (as verl 0.9: rows without a valid
    token are left out of the count instead of dragging the mean towards 0). Normalisers are counts
    (int, float or 0-dim tensor, possibly all-reduced across ranks); a zero count means there is
    nothing to average and gives 0 instead of NaN. Masked positions are selected out with
    ``torch.where``, so non-finite values there neither reach the result nor its gradient.

    Returns a 0-dim tensor in ``per_token``'s dtype.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")
    valid = mask.bool()
    masked = torch.where(valid, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if mode == "token-mean":
        total = masked.sum()
        normaliser = count_tokens(mask) if num_tokens is None else num_tokens
    else:
        row_sums = masked.sum(dim=-1)
        if mode == "seq-mean-token-mean":
            row_sums = row_sums / valid.sum(dim=-1).clamp_min(1).to(per_token.dtype)
        total = row_sums.sum()
        normaliser = count_sequences(mask) if num_sequences is None else num_sequences
    return total / _as_positive_tensor(normaliser, total)


def _as_positive_tensor(normaliser: Normaliser, like: Tensor) -> Tensor:
    """Normaliser as a tensor on ``like``'s device, clamped to >= 1 so an empty batch gives 0, not NaN."""
    if not isinstance(normaliser, Tensor) and normaliser < 0:
        raise ValueError(f"loss normaliser must be a non-negative count; got {normaliser}")
    return torch.as_tensor(normaliser, dtype=like.dtype, device=like.device).clamp_min(1.0)
