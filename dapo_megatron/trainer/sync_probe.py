"""A fixed probe batch scored by both the trainer and the engine, to check a weight sync.

Each probe row is a prompt followed by a continuation; only the continuation tokens are compared.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dapo_megatron.rollout.client import RolloutClient
from dapo_megatron.trainer.actor import PolicyRows


def probe_rows(prompts: Sequence[list[int]], continuations: Sequence[list[int]], *, pad_token_id: int) -> PolicyRows:
    """prompt + continuation per row, right-padded; the mask [n, L - 1] covers the continuation's labels."""
    width = max(len(p) + len(c) for p, c in zip(prompts, continuations, strict=True))
    tokens = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width - 1)
    for row, (prompt, continuation) in enumerate(zip(prompts, continuations, strict=True)):
        tokens[row, :len(prompt) + len(continuation)] = torch.tensor(prompt + continuation)
        mask[row, len(prompt) - 1:len(prompt) - 1 + len(continuation)] = 1.0
    return PolicyRows(tokens=tokens, response_mask=mask, advantages=torch.zeros(len(prompts)))


def engine_log_probs(client: RolloutClient, prompts: Sequence[list[int]], continuations: Sequence[list[int]], *,
                     engine: int = 0) -> torch.Tensor:
    """The (untempered) log-probs of the continuations by the client's engine number `engine`, laid out like
    `probe_rows`' mask."""
    rows = probe_rows(prompts, continuations, pad_token_id=0)
    out = torch.zeros_like(rows.response_mask)
    values = client.teacher_forced_log_probs([p + c for p, c in zip(prompts, continuations, strict=True)],
                                             [len(p) for p in prompts], engine=engine)
    for row, (prompt, row_values) in enumerate(zip(prompts, values, strict=True)):
        out[row, len(prompt) - 1:len(prompt) - 1 + len(row_values)] = torch.tensor(row_values)
    return out
