"""A fixed probe batch scored by both the trainer and the engine, to check a weight sync.

Each probe row is a prompt followed by a continuation; only the continuation tokens are compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dapo_megatron.models import fp8
from dapo_megatron.models.weights import unwrap_model
from dapo_megatron.records import PolicyRows, Prompt
from dapo_megatron.rollout.client import RolloutClient
from dapo_megatron.rollout.weight_sync import check_sync

if TYPE_CHECKING:
    from dapo_megatron.trainer.actor import Actor


def probe_rows(
    prompts: Sequence[list[int]], continuations: Sequence[list[int]], *, pad_token_id: int
) -> PolicyRows:
    """prompt + continuation per row, right-padded; the mask [n, L - 1] covers the continuation's labels."""
    width = max(len(p) + len(c) for p, c in zip(prompts, continuations, strict=True))
    tokens = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width - 1)
    for row, (prompt, continuation) in enumerate(zip(prompts, continuations, strict=True)):
        tokens[row, : len(prompt) + len(continuation)] = torch.tensor(prompt + continuation)
        mask[row, len(prompt) - 1 : len(prompt) - 1 + len(continuation)] = 1.0
    return PolicyRows(tokens=tokens, response_mask=mask, advantages=torch.zeros(len(prompts)))


def engine_log_probs(
    client: RolloutClient,
    prompts: Sequence[list[int]],
    continuations: Sequence[list[int]],
    *,
    engine: int = 0,
) -> torch.Tensor:
    """The (untempered) log-probs of the continuations by the client's engine number `engine`, laid out like
    `probe_rows`' mask."""
    rows = probe_rows(prompts, continuations, pad_token_id=0)
    out = torch.zeros_like(rows.response_mask)
    values = client.teacher_forced_log_probs(
        [p + c for p, c in zip(prompts, continuations, strict=True)], [len(p) for p in prompts], engine=engine
    )
    for row, (prompt, row_values) in enumerate(zip(prompts, values, strict=True)):
        out[row, len(prompt) - 1 : len(prompt) - 1 + len(row_values)] = torch.tensor(row_values)
    return out


PROBE_PROMPTS = 4
PROBE_CONTINUATION = "Answer: 12"
"""Teacher-forced after a few eval prompts to compare engine and trainer log-probs after a sync."""


class SyncProbe:
    """The probe batch of a job: the first `PROBE_PROMPTS` evaluation prompts, each followed by
    `PROBE_CONTINUATION`, on every rank."""

    def __init__(self, prompts: Sequence[list[int]], continuation: list[int], *, pad_token_id: int) -> None:
        self.prompts = list(prompts)
        self.continuations = [continuation] * len(self.prompts)
        self.rows = probe_rows(self.prompts, self.continuations, pad_token_id=pad_token_id)

    @classmethod
    def from_driving_rank(
        cls, eval_prompts: Sequence[Prompt] | None, continuation: list[int], *, pad_token_id: int
    ) -> SyncProbe:
        """Built from the driving rank's evaluation prompts (`eval_prompts`; None elsewhere). Collective."""
        objects = [[p.ids for p in eval_prompts[:PROBE_PROMPTS]] if eval_prompts is not None else None]
        torch.distributed.broadcast_object_list(objects, src=0)
        return cls(objects[0], continuation, pad_token_id=pad_token_id)

    def trainer_log_probs(self, actor: Actor, *, micro_batch_size: int) -> torch.Tensor:
        """The trainer's log-probs [n, L - 1] of the probe rows (at temperature 1: SGLang scores given
        tokens untempered), computed in the weights' dtype as the engine computes, FP8 training or not
        (`fp8.compute_off`). Collective: every rank takes part in the forward pass."""
        with fp8.compute_off(unwrap_model(actor.model).config):
            return actor.compute_log_probs(self.rows, micro_batch_size, temperature=1.0)

    def compare(
        self, trainer: torch.Tensor, client: RolloutClient | None, *, version: str, tolerance: float
    ) -> float:
        """Every engine's log-probs against the trainer's (`trainer_log_probs`; `weight_sync.check_sync`),
        asked by the driving rank (`client` not None). Returns the largest difference (0.0 without a
        client). Apart from `trainer_log_probs` so that the trainer's state may leave the device between
        the two (`EngineFleet.sync_weights`)."""
        if client is None:
            return 0.0
        gaps = [0.0]
        for index, url in enumerate(client.urls):  # each engine got its weights its own way
            engine = engine_log_probs(client, self.prompts, self.continuations, engine=index)
            gaps.append(
                check_sync(
                    trainer, engine, self.rows.response_mask, tolerance=tolerance, version=version, engine=url
                )
            )
        return max(gaps)
