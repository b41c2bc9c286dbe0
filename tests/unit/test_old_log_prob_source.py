"""`algo.old_log_prob_source=rollout`: the engine's log-probs stand in for π_old, the trainer's forward pass
over the batch is skipped, and the update is the one the trainer's own log-probs would give when the two
agree. Runs the real `trainer.actor.update_policy` on a tiny megatron-core policy (one gloo rank)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dapo_megatron.algo.config import AlgoConfig
from tests.conftest import one_gloo_rank, tiny_policy

VOCAB = 128


@pytest.fixture(scope="module")
def build_actor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A factory of Actors on one gloo rank, every one starting from the same weights and a fresh AdamW."""
    pytest.importorskip("megatron.core")
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.trainer.actor import Actor
    from dapo_megatron.trainer.config import OptimConfig
    from dapo_megatron.trainer.optimizer import build_optimizer

    with one_gloo_rank(tmp_path_factory.mktemp("gloo") / "store") as layout:
        initial: dict[str, torch.Tensor] = {}

        def build(algo: AlgoConfig) -> Actor:
            model, cfg = tiny_policy(layout, vocab_size=VOCAB)
            if initial:
                model.load_state_dict(initial)
            else:
                initial.update({k: v.clone() for k, v in model.state_dict().items() if v is not None})
            optimizer, scheduler = build_optimizer(
                model, OptimConfig(lr=1e-2, weight_decay=0.0), ParallelConfig(), cfg
            )
            return Actor(model, optimizer, scheduler, algo, layout, vocab_size=VOCAB)

        yield build


def batch() -> Any:
    """8 rows of 6 prompt + 10 response tokens, advantages of both signs, cut into 2 optimizer steps; the same
    rows at every call."""
    from dapo_megatron.records import PolicyRows, RankShare

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (8, 16), generator=generator)
    mask = torch.zeros(8, 15)
    mask[:, 5:] = 1.0
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.8, -0.8])
    return RankShare(PolicyRows(tokens=tokens, response_mask=mask, advantages=advantages), [[2, 2], [4]])


def update(actor: Any, share: Any, *, forbid_forward: bool = False) -> dict[str, float]:
    from dapo_megatron.trainer.actor import update_policy

    if forbid_forward:

        def no_forward(*_: Any, **__: Any) -> torch.Tensor:
            raise AssertionError("the old log-probs were recomputed by the trainer")

        actor.compute_log_probs = no_forward
    return update_policy(actor, share)


def weights(actor: Any) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in actor.model.parameters()])


def test_engine_log_probs_that_match_the_trainer_give_the_same_update(build_actor: Any) -> None:
    trainer_side = build_actor(AlgoConfig())
    share = batch()
    # An engine that computes exactly what the trainer computes: its log-probs are the trainer's.
    engine_log_prob = trainer_side.compute_log_probs(share.rows, share.all_micro_batch_sizes).clone()
    share.rows.rollout_log_prob = engine_log_prob.clone()
    expected = update(trainer_side, share)

    rollout_side = build_actor(AlgoConfig(old_log_prob_source="rollout"))
    share = batch()
    share.rows.rollout_log_prob = engine_log_prob.clone()
    got = update(rollout_side, share, forbid_forward=True)

    assert torch.equal(share.rows.old_log_prob, engine_log_prob)
    torch.testing.assert_close(weights(rollout_side), weights(trainer_side), rtol=0, atol=1e-6)
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm"):
        assert got[name] == pytest.approx(expected[name], abs=1e-6), name
    # The trainer-engine mismatch is reported only when the two are separate measurements.
    assert "actor/rollout_logprob_abs_diff" in expected and "actor/rollout_logprob_abs_diff" not in got


def test_engine_log_probs_set_the_clipping(build_actor: Any) -> None:
    """π_old from the engine is what the ratio is taken against: log-probs 0.5 nats above the trainer's make
    the first step's ratio exp(-0.5) ~ 0.61, below 1 - 0.2, so every negative-advantage token is clipped."""
    reference = build_actor(AlgoConfig())
    share = batch()
    shifted = (
        reference.compute_log_probs(share.rows, share.all_micro_batch_sizes) + 0.5
    ) * share.rows.response_mask
    share.rows.rollout_log_prob = shifted

    got = update(build_actor(AlgoConfig(old_log_prob_source="rollout")), share, forbid_forward=True)
    on_policy = update(build_actor(AlgoConfig()), batch())
    assert got["actor/pg_clipfrac"] > 0.3  # ~half the tokens have negative advantages
    assert on_policy["actor/pg_clipfrac"] < 0.1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"old_log_prob_source": "engine"}, r"algo\.old_log_prob_source must be one of trainer, rollout"),
        (
            {"old_log_prob_source": "rollout", "tis_cap": 2.0},
            r"algo\.old_log_prob_source must be trainer with truncated",
        ),
    ],
)
def test_bad_source_is_rejected_with_the_fix(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AlgoConfig(**overrides)
