"""The policy update: DAPO's loss over micro-batches through megatron-core's schedule, then one
optimizer step.

The loss of an optimizer step is (1/N) x the sum of per-token losses over every valid response token of
the whole batch, N counted across all data-parallel ranks and micro-batches (token-mean; the
sequence-mean ablations count sequences instead). Each micro-batch returns its loss *sum* and its unit
count; megatron-core's `calculate_per_token_loss` machinery all-reduces the counts and divides the
gradients once (see `trainer/forward.py`). No micro-batch ever divides by its own count, which is what
makes the result independent of the DP size and the micro-batch split.

`update_policy` is a rollout step's update: the old log-probs where the steps need them, then one
`Actor.train_step` per mini-batch.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from dapo_megatron import backends
from dapo_megatron.algo.config import AlgoConfig
from dapo_megatron.algo.logprobs import vocab_parallel_logprobs
from dapo_megatron.algo.loss import compute_actor_loss
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.records import PolicyMicroBatch, PolicyRows, RankShare
from dapo_megatron.trainer.forward import LossFn, run_schedule
from dapo_megatron.trainer.optimizer import (
    check_optimizer_kind,
    load_optimizer_state,
    sharded_optimizer_state,
)


def micro_batch_sizes(rows: int, micro_batch_size: int | Sequence[int]) -> list[int]:
    """Row counts of consecutive micro-batches: `micro_batch_size` rows each (the last one shorter) for an
    int, or the given counts (a plan from `trainer/batch.split_rows`)."""
    if isinstance(micro_batch_size, int):
        return [min(micro_batch_size, rows - start) for start in range(0, rows, micro_batch_size)]
    if sum(micro_batch_size) != rows:
        raise ValueError(f"micro-batch sizes {list(micro_batch_size)} do not add up to the {rows} rows")
    return list(micro_batch_size)


def loss_units(mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """What the loss is a mean over: valid tokens (token-mean) or non-empty sequences. int 0-dim."""
    if loss_agg_mode == "token-mean":
        return mask.sum().to(torch.int)
    return (mask.sum(-1) > 0).sum().to(torch.int)


def dapo_loss_fn(algo: AlgoConfig, layout: ParallelLayout, *, vocab_size: int, temperature: float) -> LossFn:
    """The per-micro-batch DAPO loss over vocab-parallel logits [batch, seq, V/tp]."""
    group = layout.tp_group if layout.tp_size > 1 else None

    def loss_fn(
        mb: PolicyMicroBatch, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        log_prob, entropy = vocab_parallel_logprobs(
            logits,
            mb.labels,
            temperature=temperature,
            vocab_size=vocab_size,
            process_group=group,
            chunk_size=algo.logprob_chunk_size,
            compute_entropy=True,
        )
        old_log_prob = log_prob.detach() if mb.old_log_prob is None else mb.old_log_prob
        # Normalisers of 1 turn every aggregation into a sum; megatron-core divides by the global count.
        loss_sum, metrics = compute_actor_loss(
            log_prob,
            old_log_prob,
            mb.advantages,
            mb.loss_mask,
            algo,
            entropy=entropy,
            rollout_log_prob=mb.rollout_log_prob,
            lag=mb.lag,
            num_tokens=1,
            num_sequences=1,
        )
        units = loss_units(mb.loss_mask, algo.loss_agg_mode)
        report = {name: value.detach().float() for name, value in metrics.items()}
        report["loss_sum"] = loss_sum.detach().float()
        report["units"] = units.detach().clone()
        return loss_sum, units, report

    return loss_fn


LAGGED_COUNT = "lagged_tokens"
"""Lagged valid tokens (`algo/loss.lag_is_weights`): summed, and the weight of the means over them."""
LAGGED_MEANS = frozenset({"lag_is_weight_mean", "lag_is_truncated_frac"})
MAXIMA = frozenset({"lag_is_weight_max"})


def _weight(name: str, metrics: dict[str, Any], units: float) -> float:
    """What one part's (micro-batch's, optimizer step's) value of `name` counts for when parts combine: a mean
    over lagged tokens those tokens, their count once, any other mean the part's `units`."""
    if name in LAGGED_MEANS:
        return float(metrics.get(LAGGED_COUNT, 0.0))
    return 1.0 if name == LAGGED_COUNT else units


def _divisor(name: str, lagged: float, units: float) -> float:
    """What the weighted sum of `name` over all parts is divided by (`_weight`'s totals)."""
    if name in LAGGED_MEANS:
        return max(lagged, 1.0)
    return 1.0 if name == LAGGED_COUNT else max(units, 1.0)


def reduce_reports(reports: list[dict[str, Any]], layout: ParallelLayout) -> dict[str, float]:
    """Batch-level metrics on every rank. Collective over the world.

    Sums (`pg_loss`, `entropy`, `loss_sum`) become means over all units of the batch; local
    means (clip fractions, the PPO KL estimate) are weighted by their micro-batch's units, the means over
    lagged tokens by those tokens; maxima stay maxima. Only the loss rank of each replica (last stage, TP
    rank 0) contributes, so nothing is counted twice.
    """
    summed = {"pg_loss", "entropy", "loss_sum"}
    names = sorted({name for report in reports for name in report if name != "units"})
    names = _same_on_all_ranks(names)
    totals = torch.zeros(len(names) + 1, dtype=torch.float64)
    maxima = torch.zeros(len(names), dtype=torch.float64)
    if layout.is_loss_rank:
        for report in reports:
            units = float(report["units"])
            for i, name in enumerate(names):
                if name in MAXIMA and name in report:
                    maxima[i] = max(float(maxima[i]), float(report[name]))
                elif name in report:
                    weight = 1.0 if name in summed else _weight(name, report, units)
                    totals[i] += float(report[name]) * weight
            totals[-1] += units
    torch.distributed.all_reduce(totals)
    torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX)
    lagged = float(totals[names.index(LAGGED_COUNT)]) if LAGGED_COUNT in names else 0.0
    result = {
        name: float(maxima[i])
        if name in MAXIMA
        else float(totals[i]) / _divisor(name, lagged, float(totals[-1]))
        for i, name in enumerate(names)
    }
    result["loss"] = result.pop("loss_sum", 0.0)
    result["units"] = float(totals[-1])
    return result


def combine_steps(per_step: Sequence[dict[str, float]]) -> dict[str, float]:
    """One rollout step's metrics from its optimizer steps': the mean over steps, except the lagged-token
    count (summed), the means over lagged tokens (weighted by them) and maxima (the largest)."""
    names = sorted({name for metrics in per_step for name in metrics})
    lagged = sum(metrics.get(LAGGED_COUNT, 0.0) for metrics in per_step)
    result = {}
    for name in names:
        if name in MAXIMA:
            result[name] = max(metrics.get(name, 0.0) for metrics in per_step)
        else:
            total = sum(metrics.get(name, 0.0) * _weight(name, metrics, 1.0) for metrics in per_step)
            result[name] = total / _divisor(name, lagged, len(per_step))
    return result


def _same_on_all_ranks(names: list[str]) -> list[str]:
    """Metric names exist on last stages only; agree on one list so the all-reduce lines up."""
    gathered: list[list[str] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, names)
    return sorted({name for part in gathered if part for name in part})


class Actor:
    """Owns the trainable policy chunk, its optimizer and LR schedule."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        algo: AlgoConfig,
        layout: ParallelLayout,
        *,
        vocab_size: int,
        temperature: float = 1.0,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.algo, self.layout = algo, layout
        self.vocab_size, self.temperature = vocab_size, temperature
        self.loss_fn = dapo_loss_fn(algo, layout, vocab_size=vocab_size, temperature=temperature)
        self.rng_restored = False
        """Whether a checkpoint gave back this rank's RNG states (one saved under this layout does)."""

    def backward(self, rows: PolicyRows, micro_batch_size: int | Sequence[int]) -> list[dict[str, Any]]:
        """Zero the gradient buffers, then accumulate the gradient of the batch loss (finalized: reduced
        over data parallel and divided by the global unit count). Returns the raw micro-batch reports.
        `micro_batch_size`: rows per micro-batch, or each consecutive micro-batch's rows
        (`micro_batch_sizes`)."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        micro = rows.micro_batches(micro_batch_sizes(len(rows), micro_batch_size))
        return run_schedule(self.model, micro, self.loss_fn, forward_only=False, with_labels=False)

    @torch.no_grad()
    def compute_log_probs(
        self, rows: PolicyRows, micro_batch_size: int | Sequence[int], *, temperature: float | None = None
    ) -> torch.Tensor:
        """log pi(label) under the current weights for every label position: [n, L - 1], zero outside
        `response_mask`, identical on every rank of this replica (the last stage computes it and
        broadcasts it along the pipeline). Used for the old-policy log-probs (at the sampling
        temperature, the default) and for sync checks (temperature 1: SGLang scores given tokens
        untempered)."""
        group = self.layout.tp_group if self.layout.tp_size > 1 else None
        temperature = self.temperature if temperature is None else temperature

        def keep(
            mb: PolicyMicroBatch, logits: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            log_prob, _ = vocab_parallel_logprobs(
                logits,
                mb.labels,
                temperature=temperature,
                vocab_size=self.vocab_size,
                process_group=group,
                chunk_size=self.algo.logprob_chunk_size,
                compute_entropy=False,
            )
            return log_prob.sum(), torch.ones((), dtype=torch.int), {"log_prob": log_prob * mb.loss_mask}

        sizes = micro_batch_sizes(len(rows), micro_batch_size)
        reports = run_schedule(
            self.model, rows.micro_batches(sizes), keep, forward_only=True, with_labels=False
        )
        out = torch.zeros(rows.response_mask.shape, dtype=torch.float32)
        if self.layout.is_last_stage:
            start = 0
            for size, report in zip(sizes, reports, strict=True):
                out[start : start + size, : report["log_prob"].shape[1]] = report["log_prob"][:size]
                start += size
        if self.layout.pp_size > 1:
            torch.distributed.broadcast(out, src=self.layout.pp_last_rank, group=self.layout.pp_group)
        return out

    def sharded_state_dict(self, model_state: dict[str, Any], *, is_loading: bool = False) -> dict[str, Any]:
        """The optimizer, sharded by the global tensors of `model_state` (the model's sharded state dict),
        and the LR schedule: the part of the resume point that loads under any layout."""
        return {
            "optimizer": sharded_optimizer_state(self.optimizer, model_state, is_loading=is_loading),
            "scheduler": self.scheduler.state_dict(),
        }

    def check_loadable(self, saved: dict[str, Any]) -> None:
        check_optimizer_kind(self.optimizer, saved["optimizer"])

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's RNG states: restorable in the same layout only."""
        return {"rng": rng_state()}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state["rng"])
        self.rng_restored = True

    def train_step(self, rows: PolicyRows, micro_batch_size: int | Sequence[int]) -> dict[str, float]:
        """One optimizer step on `rows` (this rank's share of the batch)."""
        reports = self.backward(rows, micro_batch_size)
        self.scheduler.step(1)
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise FloatingPointError(
                "the optimizer skipped the step: non-finite gradients (see the loss metrics)"
            )
        metrics = reduce_reports(reports, self.layout)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics


def update_policy(
    actor: Actor,
    share: RankShare,
    *,
    off_policy: bool = False,
    before_each_step: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """train_batch_size / ppo_mini_batch_size optimizer steps on this rank's share. With more than one,
    the later steps are off-policy, so they need the old log-probs: computed once before the first update,
    or the engine's (`algo.old_log_prob_source`). With exactly one, the ratio is 1 by construction and
    no old log-probs are needed, unless the batch was sampled by older weights (`off_policy`: generated
    ahead; or rows that lag, carried over), whose log-probs the engine gave. Against the trainer's π_old,
    the rows that lag get decoupled PPO's behaviour weight in the loss (`algo.lag_is_cap`)."""
    started, old_log_prob_seconds = time.perf_counter(), 0.0
    steps = len(share.micro_batch_sizes)
    off_policy = off_policy or share.rows.any_lagged
    if (steps > 1 or off_policy) and actor.algo.old_log_prob_source == "rollout":
        # The engine's log-probs become π_old; kept as rollout log-probs too they would report a
        # trainer-engine mismatch of exactly zero, so they are not.
        share.rows.old_log_prob, share.rows.rollout_log_prob = share.rows.rollout_log_prob, None
    elif steps > 1:
        share.rows.old_log_prob = actor.compute_log_probs(share.rows, share.all_micro_batch_sizes)
        old_log_prob_seconds = time.perf_counter() - started
    per_step = []
    for mini, micro in share.mini_batches():
        before_each_step()
        per_step.append(actor.train_step(mini, micro))
    metrics = {f"actor/{name}": value for name, value in combine_steps(per_step).items()}
    metrics["timing_s/update_actor"] = time.perf_counter() - started - old_log_prob_seconds
    if old_log_prob_seconds:
        metrics["timing_s/old_log_prob"] = old_log_prob_seconds
    return metrics


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": backends.detect().rng_state(),  # the accelerator's generators (None on CPU)
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["cuda"] is not None:
        backends.detect().set_rng_state(state["cuda"])
