"""Algorithm hyperparameters of DAPO (arXiv 2503.14476), defaults = the paper's full Qwen2.5-32B run.

``AlgoConfig`` is a plain dataclass with scalar fields only (str/int/float/bool and ``| None`` of
those), so it can be used as an OmegaConf/Hydra structured config without this package importing
either. The allowed values of enum-like fields live here so every module validates against one list.
"""

import math
from dataclasses import dataclass

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
"""Values of ``loss_agg_mode`` (see ``dapo_megatron.algo.aggregation.aggregate``)."""

OLD_LOG_PROB_SOURCES = ("trainer", "rollout")
"""Values of ``old_log_prob_source``."""


@dataclass
class AlgoConfig:
    """DAPO loss, advantage and reward-shaping settings (the ``algo`` config group)."""

    clip_ratio_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 − ε_low (for A < 0). In [0, 1)."""

    clip_ratio_high: float = 0.28
    """ε_high: the ratio is clipped above at 1 + ε_high (for A > 0). DAPO's "clip-higher"."""

    clip_ratio_c: float | None = 10.0
    """Dual-clip bound c > 1: a negative-advantage token's loss is capped at −A·c. None disables it."""

    loss_agg_mode: str = "token-mean"
    """How per-token losses are reduced; one of LOSS_AGG_MODES. DAPO's token-level loss is token-mean."""

    norm_adv_by_std: bool = True
    """GRPO advantage divides by the group's unbiased std (False: only subtract the mean, Dr.GRPO)."""

    adv_eps: float = 1e-6
    """Added to the group std before dividing. >= 0."""

    overlong_buffer_enable: bool = True
    """Soft overlong punishment: linear penalty over the last overlong_buffer_length tokens."""

    overlong_buffer_length: int = 4096
    """Length of the soft-punishment buffer in tokens (L_cache). > 0 and <= max response length."""

    overlong_penalty_factor: float = 1.0
    """Penalty at (and beyond) the maximum response length. >= 0."""

    overlong_filter: bool = False
    """Mask truncated responses out of the loss (paper ablation; off in the full DAPO run)."""

    entropy_coeff: float = 0.0
    """Weight of the entropy bonus subtracted from the loss. DAPO: 0 (entropy is only logged)."""

    tis_cap: float | None = None
    """Truncated importance sampling cap on exp(old_log_prob − rollout_log_prob). None = TIS off."""

    old_log_prob_source: str = "trainer"
    """Where π_old of the clipped ratio comes from when a rollout batch feeds several optimizer steps; one of
    OLD_LOG_PROB_SOURCES. ``trainer``: a forward pass of the policy over the batch before the first update
    (the usual recipe: it absorbs any gap between engine and trainer numerics). ``rollout``: the log-probs
    the engine returned with each sampled token, log_softmax(logits / temperature) of the policy that
    sampled it, which saves that forward pass (a quarter of the training compute with 4 optimizer steps per
    batch). Use it only where the engine computes the same function as the trainer (the start-up and
    periodic sync checks measure the gap: same dtype, no quantized rollout), e.g. fp32 on CPU."""

    log_ratio_clamp: float | None = 20.0
    """|log π_θ − log π_old| is clamped to this before exp (avoids inf/NaN). None = no clamp."""

    logprob_chunk_size: int = 1024
    """Tokens per chunk in the vocab-parallel log-prob/entropy kernel (memory vs. speed). > 0."""

    def __post_init__(self) -> None:
        _require(0.0 <= self.clip_ratio_low < 1.0, "clip_ratio_low", self.clip_ratio_low, "must be in [0, 1)")
        _require(self.clip_ratio_high >= 0.0, "clip_ratio_high", self.clip_ratio_high, "must be >= 0")
        _require(
            self.clip_ratio_c is None or self.clip_ratio_c > 1.0,
            "clip_ratio_c",
            self.clip_ratio_c,
            "must be > 1 (dual-clip bound)",
            hint="Set algo.clip_ratio_c=null to disable dual clip.",
        )
        _require_choice(self.loss_agg_mode, "loss_agg_mode", LOSS_AGG_MODES)
        _require(self.adv_eps >= 0.0, "adv_eps", self.adv_eps, "must be >= 0")
        _require(
            self.overlong_buffer_length > 0,
            "overlong_buffer_length",
            self.overlong_buffer_length,
            "must be > 0",
        )
        _require(
            self.overlong_penalty_factor >= 0.0,
            "overlong_penalty_factor",
            self.overlong_penalty_factor,
            "must be >= 0",
        )
        _require(math.isfinite(self.entropy_coeff), "entropy_coeff", self.entropy_coeff, "must be finite")
        _require(
            self.tis_cap is None or self.tis_cap > 0.0,
            "tis_cap",
            self.tis_cap,
            "must be > 0",
            hint="Set algo.tis_cap=null to disable truncated importance sampling.",
        )
        _require_choice(self.old_log_prob_source, "old_log_prob_source", OLD_LOG_PROB_SOURCES)
        _require(
            self.tis_cap is None or self.old_log_prob_source == "trainer",
            "old_log_prob_source",
            self.old_log_prob_source,
            "must be trainer with truncated importance sampling (it corrects the engine's log-probs towards "
            "the trainer's; with π_old taken from the engine there is nothing to correct)",
            hint="Set algo.tis_cap=null or algo.old_log_prob_source=trainer.",
        )
        _require(
            self.log_ratio_clamp is None or self.log_ratio_clamp > 0.0,
            "log_ratio_clamp",
            self.log_ratio_clamp,
            "must be > 0",
            hint="Set algo.log_ratio_clamp=null to disable the clamp.",
        )
        _require(self.logprob_chunk_size > 0, "logprob_chunk_size", self.logprob_chunk_size, "must be > 0")


def _require(ok: bool, field: str, value: object, rule: str, *, hint: str = "") -> None:
    # `ok` is computed with comparisons that are False for NaN, so NaN values are rejected too.
    if not ok:
        raise ValueError(f"algo.{field} {rule}; got {value!r}." + (f" {hint}" if hint else ""))


def _require_choice(value: str, field: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, field, value, f"must be one of {', '.join(allowed)}")
