"""From scored rollout groups to the tensors the actor trains on.

Rewards: the scorer's +1 / -1, plus DAPO's soft overlong penalty on the response length (tokens,
EOS included). Advantages: GRPO, normalised within each prompt group on the shaped rewards.
Optionally overlong filtering masks truncated samples out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dapo_megatron.algo.advantages import compute_grpo_advantages
from dapo_megatron.algo.config import AlgoConfig
from dapo_megatron.algo.reward_shaping import overlong_filter_mask, overlong_penalty
from dapo_megatron.metrics import spread
from dapo_megatron.records import PolicyRows, RankShare, ScoredGroup
from dapo_megatron.trainer.config import TrainerConfig
from dapo_megatron.trainer.packing import fixed_size_plan, token_budget_plan


def sample_lags(groups: Sequence[ScoredGroup], trained_step: int) -> list[int]:
    """Per sample, in the groups' order: how many updates older than the weights about to train (those pushed
    after rollout step `trained_step`) the weights that sampled it were: 0 on policy; 1 for a batch generated
    ahead (trainer.overlap_rollout); more for groups carried over. Read from the version the engine labelled
    each sample with, the one the trainer pushed last (`step-N`, trainer/fleet.py)."""
    lags = []
    for group in groups:
        for sample in group.samples:
            version = sample.weight_version.removeprefix("step-")
            if not version.isdigit() or int(version) > trained_step:
                raise ValueError(
                    f"a sample of prompt {group.key} carries weight version {sample.weight_version!r}, not "
                    f"step-N with N <= {trained_step}: the policy lag that decides its off-policy correction "
                    "is unknown. The engine labels samples with the version each weight sync sets; an "
                    "engine that reports none is too old (use the SGLang of requirements-sglang.txt)"
                )
            lags.append(trained_step - int(version))
    return lags


def policy_lag(groups: Sequence[ScoredGroup], trained_step: int) -> dict[str, float]:
    """The spread of `sample_lags`, and `policy_lag/lagged_fraction`: the fraction of samples (not tokens)
    that lag."""
    lags = sample_lags(groups, trained_step)
    if not lags:
        return {}
    return {
        "policy_lag/lagged_fraction": sum(lag > 0 for lag in lags) / len(lags),
        "policy_lag/mean": sum(lags) / len(lags),
        "policy_lag/min": float(min(lags)),
        "policy_lag/max": float(max(lags)),
    }


def shaped_rewards(
    groups: Sequence[ScoredGroup], algo: AlgoConfig, *, max_response_length: int
) -> torch.Tensor:
    """[n] score + overlong penalty (when enabled), in the order of the groups' samples."""
    rewards = []
    for group in groups:
        for sample in group.samples:
            reward = sample.score
            if algo.overlong_buffer_enable:
                reward += overlong_penalty(
                    len(sample.output_ids),
                    max_response_length=max_response_length,
                    buffer_length=algo.overlong_buffer_length,
                    penalty_factor=algo.overlong_penalty_factor,
                )
            rewards.append(reward)
    return torch.tensor(rewards, dtype=torch.float32)


def build_rows(
    groups: Sequence[ScoredGroup],
    algo: AlgoConfig,
    *,
    max_response_length: int,
    pad_token_id: int,
    trained_step: int | None = None,
) -> tuple[PolicyRows, dict[str, float]]:
    """PolicyRows for every sample of `groups` (group-major order) and reward metrics. With `trained_step`
    (see `sample_lags`) the rows carry their policy lag; without, none (treated as on policy)."""
    samples = [s for g in groups for s in g.samples]
    rewards = shaped_rewards(groups, algo, max_response_length=max_response_length)
    group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    advantages = compute_grpo_advantages(
        rewards, group_ids, eps=algo.adv_eps, norm_by_std=algo.norm_adv_by_std
    )

    width = max(len(s.prompt_ids) + len(s.output_ids) for s in samples)
    tokens = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(samples), width - 1)
    rollout_log_prob = torch.zeros(len(samples), width - 1)
    for row, sample in enumerate(samples):
        prompt, output = len(sample.prompt_ids), len(sample.output_ids)
        tokens[row, : prompt + output] = torch.tensor(sample.prompt_ids + sample.output_ids)
        # Label position t scores token t + 1: the response occupies label positions prompt-1 ..
        # prompt+output-2.
        mask[row, prompt - 1 : prompt - 1 + output] = 1.0
        rollout_log_prob[row, prompt - 1 : prompt - 1 + output] = torch.tensor(sample.rollout_log_probs)
    if algo.overlong_filter:
        mask = overlong_filter_mask([s.finish_reason for s in samples], mask)
    lengths = torch.tensor([len(s.output_ids) for s in samples], dtype=torch.float32)
    prompt_lengths = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.float32)
    metrics = {
        **spread("critic/score", torch.tensor([s.score for s in samples], dtype=torch.float32)),
        **spread("critic/rewards", rewards),
        # verl averages advantages over response tokens: a sample weighs its length.
        "critic/advantages/mean": float((advantages * lengths).sum() / lengths.sum().clamp(min=1)),
        "critic/advantages/max": float(advantages.max()),
        "critic/advantages/min": float(advantages.min()),
        **spread("response_length", lengths),
        "response_length/clip_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
        **spread("prompt_length", prompt_lengths),
        "rollout/accuracy": sum(s.acc for s in samples) / len(samples),
        "perf/total_num_tokens": float(lengths.sum() + prompt_lengths.sum()),
    }
    rows = PolicyRows(
        tokens=tokens, response_mask=mask, advantages=advantages, rollout_log_prob=rollout_log_prob
    )
    if trained_step is not None:
        rows.lag = torch.tensor(sample_lags(groups, trained_step), dtype=torch.long)
    return rows, metrics


def near_equal_slice(n: int, parts: int, index: int) -> slice:
    """The `index`-th of `parts` contiguous slices of `n` items whose lengths differ by at most one."""
    return slice(n * index // parts, n * (index + 1) // parts)


def split_rows(
    rows: PolicyRows, parts: int, index: int, trainer: TrainerConfig, *, multiple: int = 1
) -> RankShare:
    """Data-parallel rank `index` of `parts`: its share of `rows` in training order and its micro-batches
    (`plan_rank`; `multiple`: the model's sequence padding multiple, `models/sequence_padding.py`)."""
    plan = plan_rank(rows.widths().tolist(), parts, index, trainer, multiple=multiple)
    order = [row for step in plan for mb in step for row in mb]
    return RankShare(
        rows.subset(torch.tensor(order, dtype=torch.long)), [[len(mb) for mb in step] for step in plan]
    )


def plan_rank(
    widths: Sequence[int], parts: int, index: int, trainer: TrainerConfig, *, multiple: int = 1
) -> list[list[list[int]]]:
    """[optimizer step][micro-batch] -> row indices of data-parallel rank `index` of `parts`, for rows of
    `widths` (label positions each row needs).

    Which rows an optimizer step trains on does not depend on the micro-batching: step k takes the k-th
    of trainer.optimizer_steps slices of each rank's contiguous slice of the batch. With a fixed
    trainer.micro_batch_size a rank keeps exactly those rows, in batch order. With
    trainer.max_tokens_per_micro_batch each step's rows are planned together (`packing.token_budget_plan`):
    micro-batches within the budget, the same number on every rank, tokens balanced across ranks. The
    budget counts the tokens the model computes: each micro-batch's length padded to `multiple`
    (`models/sequence_padding.job_sequence_multiple` of the job; 1: no padding).

    A batch that dynamic sampling could not fill (trainer.on_unfilled_batch=train) may hold too few rows for
    trainer.optimizer_steps steps on every rank: it takes as many steps as give every rank a row in each.
    """
    if len(widths) < parts:
        raise ValueError(
            f"{len(widths)} sequences cannot give each of {parts} data-parallel ranks one: the batch is too "
            "small to train (an unfilled batch under trainer.on_unfilled_batch=train?)"
        )
    steps = min(trainer.optimizer_steps, len(widths) // parts)
    ranks = [range(len(widths))[near_equal_slice(len(widths), parts, rank)] for rank in range(parts)]
    plan = []
    for step in range(steps):
        members = [list(mine[near_equal_slice(len(mine), steps, step)]) for mine in ranks]
        if trainer.max_tokens_per_micro_batch:
            pool = [row for mine in members for row in mine]
            micro = token_budget_plan(
                [widths[row] for row in pool],
                ranks=parts,
                max_tokens=trainer.max_tokens_per_micro_batch,
                multiple=multiple,
            )[index]
            plan.append([[pool[i] for i in mb] for mb in micro])
        else:
            plan.append(fixed_size_plan(members, trainer.micro_batch_size)[index])
    return plan
