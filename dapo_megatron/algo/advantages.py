"""GRPO outcome advantages: each response's score normalised within its prompt's group."""

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


def compute_grpo_advantages(
    scores: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> Tensor:
    """One advantage per sample: ``(score − group mean) / (group std + eps)``.

    The std is the UNBIASED one (divisor n − 1), as ``torch.std``; ``eps`` is added to the std, not
    to the variance. A singleton group uses mean 0 and std 1, so its advantage is the raw score
    (its std is undefined). A group whose scores are all equal gets exactly 0 (not a float-rounding
    residue divided by ``eps``). With ``norm_by_std=False`` only the mean is subtracted (Dr.GRPO).

    Args:
        scores: ``[n]`` sequence-level rewards (any real dtype).
        group_ids: ``[n]`` integer tensor (any values, e.g. prompt indices), or a length-n sequence
            of hashables (e.g. uuid strings, one per prompt). Samples with equal ids form a group;
            groups may be interleaved in any order. A sequence is encoded to integer codes first
            (one pass over the ids); the statistics are vectorised over samples and groups.
        eps: added to the std (>= 0).
        norm_by_std: divide by ``std + eps``.

    Returns:
        ``[n]`` advantages in ``scores``' dtype (float32 for integer scores), on ``scores``' device.
    """
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [n]; got shape {tuple(scores.shape)}")
    codes = _group_codes(group_ids, scores.device)
    if codes.shape != scores.shape:
        raise ValueError(
            f"group_ids must have one id per score; got {codes.shape[0]} ids for {scores.shape[0]} scores"
        )
    out_dtype = scores.dtype if scores.is_floating_point() else torch.float32
    if scores.numel() == 0:
        return torch.empty(0, dtype=out_dtype, device=scores.device)

    # float64 statistics: group sums of many float32 rewards should not pick up rounding error.
    values = scores.to(torch.float64)
    _, inverse, counts = torch.unique(codes, return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    counts_f = counts.to(torch.float64)
    group_sum = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(
        0, inverse, values
    )
    group_mean = group_sum / counts_f
    group_max = torch.full_like(group_mean, -torch.inf).scatter_reduce_(0, inverse, values, reduce="amax")
    group_min = torch.full_like(group_mean, torch.inf).scatter_reduce_(0, inverse, values, reduce="amin")

    singleton = counts == 1
    constant = (group_max == group_min) & ~singleton
    centered = values - torch.where(singleton, 0.0, group_mean)[inverse]
    centered = torch.where(constant[inverse], 0.0, centered)
    if norm_by_std:
        squared_dev = torch.zeros_like(group_sum).index_add_(
            0, inverse, (values - group_mean[inverse]).square()
        )
        group_std = (squared_dev / (counts_f - 1.0).clamp_min(1.0)).sqrt()
        # Singletons have no std; constant groups are already exactly 0 (and eps may be 0).
        group_std = torch.where(singleton | constant, 1.0, group_std)
        centered = centered / (group_std[inverse] + eps)
    return centered.to(out_dtype)


def _group_codes(group_ids: Tensor | Sequence[Hashable], device: torch.device) -> Tensor:
    """Integer code per sample; equal ids get equal codes."""
    if isinstance(group_ids, Tensor):
        if group_ids.is_floating_point() or group_ids.dim() != 1:
            raise ValueError("group_ids tensor must be a 1-D integer tensor")
        return group_ids.to(device)
    code_of: dict[Hashable, int] = {}
    codes = [code_of.setdefault(gid, len(code_of)) for gid in group_ids]
    return torch.tensor(codes, dtype=torch.long, device=device)
