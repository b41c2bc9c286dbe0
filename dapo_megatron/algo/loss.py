"""DAPO policy loss (arXiv 2503.14476): decoupled clip, dual clip, optional TIS, decoupled PPO's behaviour
weight for samples of older weights, and an entropy term.

All per-token tensors are ``[batch, response_len]`` and aligned with ``response_mask`` (1 = token
produced by the policy and trained on, 0 = padding or masked out). Metrics are detached 0-dim tensors
(no host sync), averaged over the valid tokens of the tensors passed in (the local micro-batch).
"""

import math

import torch
from torch import Tensor

from dapo_megatron.algo.aggregation import Normaliser, aggregate, masked_mean
from dapo_megatron.algo.config import AlgoConfig

DEFAULT_LOG_RATIO_CLAMP = 20.0
"""Default bound on |log π_θ − log π_old| before ``exp``.

Why clamp: ``exp`` overflows float32 above ~88.7. An infinite ratio turns a zero-advantage token
into ``0·inf = NaN`` in the forward pass, and even where ``max``/``min`` pick the finite branch the
backward pass multiplies a zero upstream gradient by an infinite local one (NaN). With the clamp at
±20 every such token is already on a constant branch (upper clip for A > 0, dual clip for A < 0
once the ratio exceeds c; lower clip for A < 0 when it is tiny), so the loss and its gradient change
by at most |A|·e⁻²⁰ ≈ 2e-9·|A| per token (A > 0 with a vanishing ratio). verl ≥ 0.6 clamps at the
same bound; the DAPO reproduction run did not clamp.
"""


def check_finite(**tensors: Tensor | None) -> None:
    """Raise ``ValueError`` naming the first input tensor that holds NaN or ±inf.

    The per-tensor flags are stacked and read back once, so this costs ONE host-device sync
    whatever the number of tensors; the check is over all elements, padding included (pad with 0).
    """
    named = [(name, t) for name, t in tensors.items() if t is not None]
    if not named:
        return
    flags = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist()  # host sync
    for (name, tensor), ok in zip(named, flags, strict=True):
        if not ok:
            n_nan = int(torch.isnan(tensor).sum())
            n_inf = int(torch.isinf(tensor).sum())
            raise ValueError(
                f"{name} contains non-finite values ({n_nan} NaN, {n_inf} inf of {tensor.numel()}); "
                "refusing to compute a NaN loss. Check the model forward and the rollout log-probs."
            )


def _broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """``[batch]`` (one advantage per sequence) or ``[batch, response_len]`` -> ``like``'s shape."""
    if advantages.dim() == like.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    return advantages.expand_as(like)


def compute_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = 10.0,
    num_tokens: Normaliser | None = None,
    num_sequences: Normaliser | None = None,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: Tensor | None = None,
    log_ratio_clamp: float | None = DEFAULT_LOG_RATIO_CLAMP,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate policy-gradient loss of DAPO/PPO with dual clip.

    Per token, with ``ratio = exp(log_prob − old_log_prob)`` and advantage ``A``::

        L1 = −A·ratio;  L2 = −A·clamp(ratio, 1 − clip_ratio_low, 1 + clip_ratio_high)
        L  = max(L1, L2);  if A < 0 and clip_ratio_c is not None: L = min(L, −A·clip_ratio_c)
        L *= rollout_is_weights (if given; treated as constants)

    and the loss is ``aggregate(L, response_mask, loss_agg_mode, num_tokens=..., num_sequences=...)``,
    i.e. for ``token-mean`` ``Σ L·mask / num_tokens`` with ``num_tokens`` defaulting to
    ``response_mask.sum()``. Pass the GLOBAL token count of the optimizer mini-batch (summed over DP
    ranks and micro-batches) as ``num_tokens`` to make the sum of micro-batch losses equal the
    mini-batch token mean.

    Args:
        log_prob: ``[batch, response_len]`` log π_θ of the sampled tokens (carries the gradient).
        old_log_prob: ``[batch, response_len]`` log π_old (no gradient needed).
        advantages: ``[batch]`` or ``[batch, response_len]``.
        response_mask: ``[batch, response_len]`` bool/int/float, non-zero = valid.
        clip_ratio_c: dual-clip bound (> 1); ``None`` disables dual clip.
        rollout_is_weights: optional ``[batch, response_len]`` truncated-IS weights (detached here).
        log_ratio_clamp: bound on |log ratio| before ``exp`` (see ``DEFAULT_LOG_RATIO_CLAMP``);
            ``None`` reproduces the unclamped DAPO reproduction run.

    Returns:
        ``(loss, metrics)``: 0-dim loss; metrics ``pg_clipfrac`` (L2 > L1, either side),
        ``pg_clipfrac_upper_bound`` / ``pg_clipfrac_lower_bound`` (the 1+high / 1−low clip is the
        active term; they add up to ``pg_clipfrac``), ``pg_clipfrac_lower`` (dual clip fired) and
        ``ppo_kl`` (mean of old_log_prob − log_prob, after the ``log_ratio_clamp``, as verl reports it).

    Raises:
        ValueError: bad clip parameters, or NaN/inf in ``log_prob``, ``old_log_prob``, ``advantages``
            (one host sync, see :func:`check_finite`).
    """
    _check_clip_params(clip_ratio_low, clip_ratio_high, clip_ratio_c, log_ratio_clamp)
    check_finite(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    advantages = _broadcast_advantages(advantages, log_prob)

    log_ratio = log_prob - old_log_prob
    clamped_log_ratio = (
        log_ratio if log_ratio_clamp is None else log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    )
    ratio = torch.exp(clamped_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    negative_adv = advantages < 0
    if clip_ratio_c is None:
        dual_fired = torch.zeros_like(negative_adv)
    else:
        dual_bound = -advantages * clip_ratio_c
        dual_fired = negative_adv & (per_token > dual_bound)
        per_token = torch.where(negative_adv, torch.minimum(per_token, dual_bound), per_token)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights.detach()

    loss = aggregate(
        per_token, response_mask, loss_agg_mode, num_tokens=num_tokens, num_sequences=num_sequences
    )

    with torch.no_grad():
        clip_active = clipped > unclipped
        metrics = {
            "pg_clipfrac": masked_mean(clip_active.float(), response_mask),
            "pg_clipfrac_upper_bound": masked_mean(
                (clip_active & (ratio > 1.0 + clip_ratio_high)).float(), response_mask
            ),
            "pg_clipfrac_lower_bound": masked_mean(
                (clip_active & (ratio < 1.0 - clip_ratio_low)).float(), response_mask
            ),
            "pg_clipfrac_lower": masked_mean(dual_fired.float(), response_mask),
            "ppo_kl": masked_mean(-clamped_log_ratio, response_mask),
        }
    return loss, metrics


def _check_clip_params(
    clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None, log_ratio_clamp: float | None
) -> None:
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(
            f"clip_ratio_low must be in [0, 1) so that 1 - clip_ratio_low > 0; got {clip_ratio_low}"
        )
    if not clip_ratio_high >= 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0; got {clip_ratio_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1 (dual-clip bound) or None to disable it; got {clip_ratio_c}"
        )
    if log_ratio_clamp is not None and not log_ratio_clamp > 0.0:
        raise ValueError(f"log_ratio_clamp must be > 0 or None; got {log_ratio_clamp}")


def truncated_is_weights(old_log_prob: Tensor, rollout_log_prob: Tensor, *, cap: float) -> Tensor:
    """Truncated importance-sampling weights ``min(exp(old_log_prob − rollout_log_prob), cap)``.

    Corrects for the rollout engine (SGLang, bf16 kernels) sampling from a slightly different
    distribution than the trainer's π_old. Shapes ``[batch, response_len]``; the result is detached.
    The log-ratio is clamped at ``log(cap)`` before ``exp`` so the weight never overflows.
    """
    if not cap > 0.0:
        raise ValueError(f"TIS cap must be > 0; got {cap}")
    with torch.no_grad():
        return torch.exp((old_log_prob - rollout_log_prob).clamp(max=math.log(cap)))


def lag_is_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    lag: Tensor,
    response_mask: Tensor,
    *,
    cap: float,
    base: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO's behaviour weights: ``min(exp(old_log_prob − rollout_log_prob), cap)`` on the rows
    sampled by older weights (``lag > 0``), ``base`` (or exactly 1) on the others.

    ``old_log_prob`` is π_prox, the current policy before the update; ``rollout_log_prob`` is π_behav, the
    engine's log-probs of the weights that sampled the row; ``lag``: ``[batch]`` updates between the two.
    Returns the detached weights ``[batch, response_len]`` and metrics over the lagged valid tokens:
    ``lag_is_weight_mean``, ``lag_is_weight_max``, ``lag_is_truncated_frac`` (the cap fired) and
    ``lagged_tokens`` (their count; the means are 0 without any).
    """
    with torch.no_grad():
        lagged = (lag > 0).unsqueeze(-1).expand_as(old_log_prob)
        capped = truncated_is_weights(old_log_prob, rollout_log_prob, cap=cap)
        weights = torch.where(lagged, capped, 1.0 if base is None else base)
        counted = lagged & response_mask.bool()
        metrics = {
            "lag_is_weight_mean": masked_mean(capped, counted),
            "lag_is_weight_max": torch.where(counted, capped, 0.0).amax(),
            "lag_is_truncated_frac": masked_mean(
                (old_log_prob - rollout_log_prob > math.log(cap)).float(), counted
            ),
            "lagged_tokens": counted.sum().float(),
        }
    return weights, metrics


def rollout_mismatch_metrics(
    old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor
) -> dict[str, Tensor]:
    """How far the rollout engine's log-probs are from the trainer's, over valid tokens.

    ``rollout_logprob_abs_diff`` = mean |rollout − train|; ``rollout_kl_k3`` = mean of
    ``exp(r) − r − 1`` with ``r = rollout − train`` (k3 estimate of KL(π_train ‖ π_rollout)).
    Returns detached 0-dim tensors.
    """
    with torch.no_grad():
        diff = (rollout_log_prob - old_log_prob).clamp(-DEFAULT_LOG_RATIO_CLAMP, DEFAULT_LOG_RATIO_CLAMP)
        return {
            "rollout_logprob_abs_diff": masked_mean(diff.abs(), response_mask),
            "rollout_kl_k3": masked_mean(torch.exp(diff) - diff - 1.0, response_mask),
        }


def compute_actor_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: AlgoConfig,
    *,
    entropy: Tensor | None = None,
    rollout_log_prob: Tensor | None = None,
    lag: Tensor | None = None,
    num_tokens: Normaliser | None = None,
    num_sequences: Normaliser | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Total actor loss ``pg_loss − entropy_coeff·agg(entropy)`` (same aggregation). There is no
    KL-to-reference term: DAPO drops it, and the trainer keeps no reference policy.

    DAPO uses ``entropy_coeff = 0``, so the total is the policy loss. Extra inputs, all
    ``[batch, response_len]``:

    * ``entropy``: per-token policy entropy (differentiable); required when ``entropy_coeff != 0``,
      otherwise only logged as ``entropy``.
    * ``rollout_log_prob``: the rollout engine's log-probs; when given, mismatch metrics are always
      logged and, if ``config.tis_cap`` is set, truncated IS weights multiply the policy loss.
    * ``lag`` (``[batch]``): updates between the weights that sampled each row and the current ones. With
      ``rollout_log_prob`` and ``config.lag_is_cap`` set, the rows with ``lag > 0`` get decoupled PPO's
      behaviour weights (:func:`lag_is_weights`, replacing TIS there): ``old_log_prob`` must then be the
      current policy's (π_prox). Rows with ``lag == 0`` keep exactly the loss and gradient they have
      without it.

    Returns ``(loss, metrics)`` with the :func:`compute_policy_loss` metrics plus ``pg_loss`` and,
    when their inputs are given, ``entropy``, ``tis_weight_mean``, the :func:`lag_is_weights` metrics
    and the rollout-mismatch metrics. ``pg_loss`` and ``entropy`` use the loss normalisers, so
    with global normalisers they add up over micro-batches and ranks like the loss itself; the other
    metrics are local means over this call's valid tokens.
    """
    if config.entropy_coeff != 0.0 and entropy is None:
        raise ValueError("algo.entropy_coeff != 0 needs the per-token entropy; pass entropy=...")
    # One host sync for the extra inputs; compute_policy_loss checks its own inputs.
    check_finite(rollout_log_prob=rollout_log_prob)

    metrics: dict[str, Tensor] = {}
    is_weights = None
    if rollout_log_prob is not None:
        metrics.update(rollout_mismatch_metrics(old_log_prob, rollout_log_prob, response_mask))
        if config.tis_cap is not None:
            is_weights = truncated_is_weights(old_log_prob, rollout_log_prob, cap=config.tis_cap)
            metrics["tis_weight_mean"] = masked_mean(is_weights, response_mask)
        if lag is not None and config.lag_is_cap is not None:
            is_weights, lag_metrics = lag_is_weights(
                old_log_prob, rollout_log_prob, lag, response_mask, cap=config.lag_is_cap, base=is_weights
            )
            metrics.update(lag_metrics)

    pg_loss, pg_metrics = compute_policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        loss_agg_mode=config.loss_agg_mode,
        rollout_is_weights=is_weights,
        log_ratio_clamp=config.log_ratio_clamp,
    )
    metrics.update(pg_metrics)
    metrics["pg_loss"] = pg_loss.detach()
    loss = pg_loss

    def agg(per_token: Tensor) -> Tensor:
        return aggregate(
            per_token,
            response_mask,
            config.loss_agg_mode,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
        )

    if entropy is not None:
        entropy_loss = agg(entropy)
        metrics["entropy"] = entropy_loss.detach()
        if config.entropy_coeff != 0.0:
            loss = loss - config.entropy_coeff * entropy_loss
    return loss, metrics
