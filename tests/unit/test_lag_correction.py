"""Rows sampled by older weights through the real `trainer.actor.update_policy` on a tiny megatron-core
policy (one gloo rank): decoupled PPO's weights reported over the optimizer steps, and, with π_old from the
engine, the ratio taken against the weights that sampled them even when one optimizer step would not need
π_old."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from dapo_megatron.algo.config import AlgoConfig
from tests.unit.test_old_log_prob_source import batch, build_actor, update

__all__ = ["build_actor"]  # the fixture, shared with the module it comes from

LAG = torch.tensor([0, 0, 1, 1, 0, 0, 2, 0])
"""Rows 2, 3 (first optimizer step) and 6 (second) lag."""
BEHIND = torch.tensor([0.0, 0.0, 0.4, 0.4, 0.0, 0.0, 1.0, 0.0])
"""Nats by which the engine's log-probs of each row lie below π_prox: weights e^0.4 ~ 1.49, and e^1 cut
to 2."""


def test_lag_weights_are_reported_over_the_lagged_tokens_of_all_steps(build_actor: Any) -> None:
    """10 response tokens a row. Over the 30 lagged tokens: 20 weigh e^0.4 and 10 are truncated to 2 (a mean
    of the two steps' means would give (e^0.4 + 2) / 2 instead)."""
    actor = build_actor(AlgoConfig(lag_is_cap=2.0))
    share = batch()
    proximal = actor.compute_log_probs(share.rows, share.all_micro_batch_sizes)
    share.rows.rollout_log_prob = (proximal - BEHIND[:, None]) * share.rows.response_mask
    share.rows.lag = LAG.clone()
    metrics = update(actor, share)
    assert metrics["actor/lagged_tokens"] == 30
    assert metrics["actor/lag_is_weight_mean"] == pytest.approx(
        (20 * math.exp(0.4) + 10 * 2.0) / 30, rel=1e-5
    )
    assert metrics["actor/lag_is_weight_max"] == pytest.approx(2.0)
    assert metrics["actor/lag_is_truncated_frac"] == pytest.approx(1 / 3)


def test_engine_pi_old_covers_lagged_rows_in_a_single_optimizer_step(build_actor: Any) -> None:
    """With algo.old_log_prob_source=rollout and one optimizer step, on-policy rows need no π_old (the ratio
    is 1), but rows that lag are trained against the engine's log-probs of the weights that sampled them."""
    share = batch()
    share.micro_batch_sizes = [[4, 4]]
    engine = torch.randn(share.rows.response_mask.shape, generator=torch.Generator().manual_seed(1)) * 0.1
    share.rows.rollout_log_prob = engine.clone()
    share.rows.lag = LAG.clone()
    update(build_actor(AlgoConfig(old_log_prob_source="rollout")), share, forbid_forward=True)
    assert share.rows.old_log_prob is not None and torch.equal(share.rows.old_log_prob, engine)
