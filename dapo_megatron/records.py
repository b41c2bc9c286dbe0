"""The records a prompt becomes on its way to the loss, in the order it meets them.

    PromptExample   a data-set row: text, chat turns, reference answer, token ids    data/loading.py reads it
       | trainer/prompts.py keeps what the rollouts need
    Prompt          uid, token ids, reference answer, data source                    the driving rank's stream
       | rollout/client.py: SGLang generates G samples per prompt
    Sample          one response: tokens, the engine's log-probs, finish reason, weight version
       | trainer/collect.py: the reward pool grades each response (its input, `rewards.pool.RewardItem`, is
       | the decoded text, the worker processes' own interface)
    ScoredSample    a sample with its score and accuracy; a prompt's G of them are a
    ScoredGroup     (GRPO normalises within a group, dynamic sampling judges it)
    Drawn           a prompt drawn by dynamic sampling and, once generated, its group: the carry-over backlog
       | trainer/batch.py: shaped rewards, GRPO advantages, right-padded tensors (driving rank, then
       | broadcast)
    PolicyRows      token rows, response mask, advantages, log-probs, policy lag
       | trainer/batch.split_rows: this data-parallel rank's share, cut per optimizer step and micro-batch
    RankShare       those rows in training order and how they are cut
       | PolicyRows.micro_batches
    PolicyMicroBatch  one forward/backward pass: tokens, labels, mask, advantages, log-probs
       | trainer/forward.run_schedule -> trainer/actor.dapo_loss_fn -> algo/loss.compute_policy_loss

`MicroBatch` is the part of a micro-batch that `run_schedule` itself needs (tokens, labels, mask); the
warm-up and greedy generation use it bare. Checkpoints store `Prompt`, `Drawn` and `ScoredGroup` (the
backlog and the batch generated ahead) by pickling, so their fields are part of the checkpoint format.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class PromptExample:
    """One prompt with its reference answer."""

    uid: str
    """Stable id: a hash of the normalised prompt (see `data/loading.py`)."""
    prompt: str
    """Text of the last user message: for DAPO data the full instruction + problem + reminder."""
    ground_truth: str
    data_source: str
    """Names the task; the reward registry picks the scorer from it."""
    messages: tuple[Mapping[str, str], ...]
    """The chat turns fed to the chat template (``role`` and ``content`` only)."""
    origin: str
    """Where the row came from (``file, line N`` / ``file, row N``), for messages and debugging."""
    prompt_ids: tuple[int, ...] | None = None
    """Prompt token ids after the chat template and the length limit; None until tokenized."""


@dataclass(frozen=True)
class Prompt:
    uid: str
    ids: list[int]
    ground_truth: str
    data_source: str


@dataclass(slots=True)
class Sample:
    """One generated response. SGLang's full `meta_info` is not kept: it holds text and timing for every
    token, far more memory than training needs."""

    key: Hashable
    """The group key the prompt came with."""
    index: int
    """0..n-1 within the group."""
    prompt_ids: list[int]
    """Shared by all samples of a group; do not mutate."""
    output_ids: list[int]
    """Generated tokens, including the stop or EOS token that ended the response."""
    logprobs: list[float]
    """Per output token: log_softmax(logits / temperature) of the engine before top-p/top-k."""
    finish_reason: FinishReason
    """stop (EOS or a stop token), length (max_new_tokens) or abort (partial output)."""
    weight_version: str
    engine: str
    """URL of the engine that generated it."""


@dataclass
class ScoredSample:
    prompt_ids: list[int]
    output_ids: list[int]
    rollout_log_probs: list[float]
    """The engine's log-prob of each output token (same length as output_ids)."""
    finish_reason: str
    """stop | length | abort"""
    score: float
    """The reward function's score (DAPO: +1 / -1)."""
    acc: bool
    weight_version: str = ""
    """The engine's weights when it sampled this: `step-N` after the push that followed rollout step N."""


@dataclass
class ScoredGroup:
    key: str
    """Identifies the prompt (its dataset uid); GRPO normalises within a group."""
    samples: list[ScoredSample]

    @property
    def accuracies(self) -> list[bool]:
        return [s.acc for s in self.samples]


@dataclass(frozen=True)
class Drawn:
    """A prompt drawn from the source and, once generated and informative, its scored group."""

    prompt: Prompt
    group: ScoredGroup | None = None

    @property
    def accuracies(self) -> list[bool]:
        if self.group is None:
            raise ValueError(f"prompt {self.prompt.uid} has not been generated")
        return self.group.accuracies


@dataclass
class MicroBatch:
    """Right-padded token rows. tokens, labels, loss_mask: [batch, seq]."""

    tokens: torch.Tensor
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None


@dataclass
class PolicyMicroBatch(MicroBatch):
    """A micro-batch of sampled sequences. Per-token tensors are [batch, seq] and aligned with `labels`
    (position t scores the token at t + 1); `loss_mask` marks response tokens."""

    advantages: torch.Tensor | None = None  # [batch]
    old_log_prob: torch.Tensor | None = None  # [batch, seq]; None = on-policy (ratio exactly 1)
    rollout_log_prob: torch.Tensor | None = None  # [batch, seq]; the engine's, for TIS and mismatch metrics
    lag: torch.Tensor | None = None  # [batch]; see PolicyRows.lag


@dataclass
class PolicyRows:
    """One optimizer batch of sequences on this data-parallel rank.

    tokens: [n, L] prompt + response, right-padded. response_mask, old_log_prob, rollout_log_prob:
    [n, L - 1], aligned with the labels tokens[:, 1:]. advantages: [n].
    """

    tokens: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    old_log_prob: torch.Tensor | None = None
    rollout_log_prob: torch.Tensor | None = None
    lag: torch.Tensor | None = None
    """[n] updates between the weights that sampled each row and the weights it trains (0: on policy); the
    loss corrects rows with lag > 0 (`algo.lag_is_cap`). None: not known (treated as on policy)."""

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def any_lagged(self) -> bool:
        """Whether some row was sampled by older weights than those it trains."""
        return self.lag is not None and bool((self.lag > 0).any())

    def subset(self, rows: slice | torch.Tensor, width: int | None = None) -> PolicyRows:
        """Rows `rows` (a slice or an index tensor), label positions cut to `width` (tokens to
        `width + 1`)."""

        def cut(t: torch.Tensor | None, extra: int = 0) -> torch.Tensor | None:
            return None if t is None else t[rows, : None if width is None else width + extra]

        return PolicyRows(
            tokens=cut(self.tokens, 1),
            response_mask=cut(self.response_mask),
            advantages=self.advantages[rows],
            old_log_prob=cut(self.old_log_prob),
            rollout_log_prob=cut(self.rollout_log_prob),
            lag=None if self.lag is None else self.lag[rows],
        )

    def widths(self) -> torch.Tensor:
        """[n] label positions each row needs: one past its last response token (1 without one)."""
        widths = self.response_mask.shape[1] - self.response_mask.flip(-1).float().argmax(-1)
        return torch.where(self.response_mask.any(-1), widths, 1)

    def micro_batches(self, sizes: Sequence[int]) -> list[PolicyMicroBatch]:
        """Consecutive micro-batches of `sizes[i]` rows, each cut to its own longest row (no compute on
        padding beyond it). A size of 0 stands for a micro-batch without rows (see `trainer/packing.py`:
        it keeps the number of forward passes equal across DP ranks); it runs this batch's first token
        with the loss mask off, so it adds nothing to the loss, its unit count or the gradient."""
        widths = self.widths()
        micro, start = [], 0
        for size in sizes:
            if size:
                part = self.subset(slice(start, start + size), int(widths[start : start + size].max()))
            else:
                part = self.subset(slice(0, 1), 1)
                part.response_mask = torch.zeros_like(part.response_mask)
            start += size
            micro.append(
                PolicyMicroBatch(
                    tokens=part.tokens[:, :-1],
                    labels=part.tokens[:, 1:],
                    loss_mask=part.response_mask,
                    advantages=part.advantages,
                    old_log_prob=part.old_log_prob,
                    rollout_log_prob=part.rollout_log_prob,
                    lag=part.lag,
                )
            )
        return micro


@dataclass
class RankShare:
    """A data-parallel rank's rows of a rollout batch in training order, and how they are cut."""

    rows: PolicyRows
    micro_batch_sizes: list[list[int]]
    """[optimizer step][micro-batch] -> rows; micro-batches are consecutive in `rows`, steps too."""

    @property
    def all_micro_batch_sizes(self) -> list[int]:
        """Every micro-batch's rows, all steps in order (one pass over the whole share)."""
        return [size for sizes in self.micro_batch_sizes for size in sizes]

    def mini_batches(self) -> list[tuple[PolicyRows, list[int]]]:
        """(rows, micro-batch sizes) of each optimizer step, in order."""
        out, start = [], 0
        for sizes in self.micro_batch_sizes:
            out.append((self.rows.subset(slice(start, start + sum(sizes))), sizes))
            start += sum(sizes)
        return out
