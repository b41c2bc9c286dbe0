"""DAPO algorithm maths: policy loss, aggregation, GRPO advantages, reward shaping, log-probs.

Pure torch/numpy/stdlib: importing this package never loads megatron, transformers, SGLang,
OmegaConf or Hydra, so it can be unit-tested on CPU and reused by any trainer. Nor torch, until one of
the maths is used: the job's config holds `AlgoConfig`, and a CPU trainer reads its config and launches its
engine before it imports torch (`train.py`).
"""

from __future__ import annotations

import importlib
from typing import Any

from dapo_megatron.algo.config import AlgoConfig

_MODULE_OF = {
    "compute_grpo_advantages": "advantages",
    "LOSS_AGG_MODES": "aggregation",
    "aggregate": "aggregation",
    "masked_mean": "aggregation",
    "vocab_parallel_logprobs": "logprobs",
    "compute_actor_loss": "loss",
    "compute_policy_loss": "loss",
    "rollout_mismatch_metrics": "loss",
    "truncated_is_weights": "loss",
    "overlong_filter_mask": "reward_shaping",
    "overlong_penalty": "reward_shaping",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


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
