"""DAPO algorithm maths: policy loss, aggregation, GRPO advantages, reward shaping, log-probs.

Pure torch/numpy/stdlib: importing this package never loads megatron, transformers, SGLang,
OmegaConf or Hydra, so it can be unit-tested on CPU and reused by any trainer.
"""

from dapo_megatron.algo.advantages import compute_grpo_advantages
from dapo_megatron.algo.aggregation import LOSS_AGG_MODES, aggregate, masked_mean
from dapo_megatron.algo.config import AlgoConfig
from dapo_megatron.algo.logprobs import vocab_parallel_logprobs
from dapo_megatron.algo.loss import (
    compute_actor_loss,
    compute_policy_loss,
    rollout_mismatch_metrics,
    truncated_is_weights,
)
from dapo_megatron.algo.reward_shaping import overlong_filter_mask, overlong_penalty

__all__ = [
    "LOSS_AGG_MODES",
    "AlgoConfig",
    "aggregate",
    "compute_actor_loss",
    "compute_grpo_advantages",
    "compute_policy_loss",
    "masked_mean",
    "overlong_filter_mask",
    "overlong_penalty",
    "rollout_mismatch_metrics",
    "truncated_is_weights",
    "vocab_parallel_logprobs",
]
