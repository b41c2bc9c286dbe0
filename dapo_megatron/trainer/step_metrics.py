"""A training step's metrics and console line, assembled in one place so that `train.py`'s loop reads as the
algorithm: the phase timings and the throughput, the update's MFU and peak memory, the latest evaluation,
and the step line with the run's elapsed time and its ETA (README's Monitoring table names every tag).

`StepLog` is made once the loop starts: the ETA is the mean step time since then, without the start-up.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dapo_megatron import backends, flops
from dapo_megatron.backends.base import Backend
from dapo_megatron.metrics import MetricsLogger, console, format_duration, format_line
from dapo_megatron.trainer.evaluate import eval_accuracy

if TYPE_CHECKING:
    from dapo_megatron.config import JobConfig
    from dapo_megatron.distributed.layout import ParallelLayout
    from dapo_megatron.records import PolicyRows
    from dapo_megatron.trainer.fleet import SyncReport


class StepLog:
    """The metrics and console line of each step the loop trains, written to `metrics` at the step.

    Per step: `start_step` when it begins (its clock: `timing_s/step`), `updated` right after the policy
    update, `finish` once the weights are synced and any evaluation is done.

    Args:
        first_step: the step the loop resumes after (0 on a fresh start): the ETA's mean counts the steps
            trained since.
        process_started: `time.perf_counter()` when the trainer started: the line's elapsed time.
        last_eval: the evaluation before training, (step, held-out accuracy), if there was one.
    """

    def __init__(
        self,
        job: JobConfig,
        layout: ParallelLayout,
        metrics: MetricsLogger,
        *,
        first_step: int,
        process_started: float,
        last_eval: tuple[int, float] | None = None,
    ) -> None:
        self.job, self.layout, self.metrics = job, layout, metrics
        self.first_step, self.process_started = first_step, process_started
        self.last_eval = last_eval
        """(step, held-out accuracy) of the latest evaluation: on every step line after it."""
        self.peak_tflops = actor_peak_tflops(job, backends.of(layout.device))
        self.loop_started = time.perf_counter()
        self.step_started = self.loop_started

    def start_step(self) -> None:
        """A step begins: its `timing_s/step` counts from here."""
        self.step_started = time.perf_counter()

    def updated(self, rows: PolicyRows, train_metrics: dict[str, float]) -> dict[str, float]:
        """The update's metrics with its MFU and peak memory (`actor_perf`), measured now: before the
        checkpoint and the weight sync allocate their own buffers. Collective on GPUs."""
        seconds = train_metrics["timing_s/update_actor"]
        train_metrics.update(actor_perf(self.job, rows, seconds, self.layout, self.peak_tflops))
        return train_metrics

    def finish(
        self,
        step: int,
        rollout_metrics: Mapping[str, float],
        batch_metrics: Mapping[str, float],
        train_metrics: Mapping[str, float],
        sync: SyncReport,
        reload_seconds: float,
        wait_seconds: float,
        evaluation: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """Log step `step`'s metrics, and on the logging rank (the only one holding them all) print its line.

        Args:
            rollout_metrics, batch_metrics, train_metrics: what the step's phases reported (`collect`,
                `training_batch`, `updated`), logged in that order.
            sync: the step's weight sync (`timing_s/update_weights`).
            reload_seconds: the training state's way back to the device before the update; with the sync's
                offload, `timing_s/offload` (`trainer.offload_during_rollout` only).
            wait_seconds: what the loop waited for the batch generated ahead (`timing_s/gen_wait`,
                `trainer.overlap_rollout` only).
            evaluation: this step's held-out evaluation, if one was due; empty when a stop request cut it
                short, and then the line keeps showing the previous one.
        Returns the metrics logged.
        """
        trainer = self.job.trainer
        step_metrics = {
            **rollout_metrics,
            **batch_metrics,
            **train_metrics,
            "timing_s/update_weights": sync.seconds,
        }
        if trainer.offload_during_rollout:
            step_metrics["timing_s/offload"] = reload_seconds + sync.offload_seconds
        if trainer.overlap_rollout:
            step_metrics["timing_s/gen_wait"] = wait_seconds
        if evaluation is not None:
            step_metrics.update(evaluation)
            accuracy = eval_accuracy(evaluation)
            if accuracy is not None:  # None: a stop request cut it short
                self.last_eval = (step, accuracy)
        step_metrics["timing_s/step"] = time.perf_counter() - self.step_started
        # verl's throughput: tokens (prompts and responses) per second and device.
        step_metrics["perf/throughput"] = batch_metrics["perf/total_num_tokens"] / (
            step_metrics["timing_s/step"] * self.layout.world_size
        )
        self.metrics.log(step_metrics, step)
        if self.layout.is_logging_rank:  # the only rank holding every metric of the line
            now = time.perf_counter()
            progress = Progress(
                elapsed=now - self.process_started,
                eta=(now - self.loop_started) / (step - self.first_step) * (trainer.total_steps - step),
                last_eval=self.last_eval,
            )
            console.info(console_line(step, trainer.total_steps, step_metrics, progress))
        return step_metrics


def actor_peak_tflops(job: JobConfig, backend: Backend) -> float | None:
    """One device's dense peak for the policy's matmul precision; None on CPU or a GPU `flops` does not
    know."""
    name = backend.device_name()
    return None if name is None else flops.peak_tflops(name, "fp8" if job.model.fp8.enabled else "bf16")


def actor_perf(
    job: JobConfig, rows: PolicyRows, seconds: float, layout: ParallelLayout, peak_tflops: float | None
) -> dict[str, float]:
    """Where the device counts its memory (GPU): `perf/max_memory_allocated_gb` (the largest of any rank's
    peak) and `perf/mfu/actor` (the update's model FLOPs over the devices' peak, as verl reports it).
    Collective there."""
    peak_gib = backends.of(layout.device).peak_memory_gib()
    if peak_gib is None:
        return {}
    peak = torch.tensor([peak_gib], device=layout.device)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    metrics = {"perf/max_memory_allocated_gb": float(peak)}
    if peak_tflops is not None:
        lengths = (rows.widths() + 1).tolist()  # label positions + the first token
        metrics["perf/mfu/actor"] = flops.mfu(
            flops.training_flops(job.model, lengths),
            seconds,
            num_gpus=layout.world_size,
            peak_tflops_per_gpu=peak_tflops,
        )
    return metrics


@dataclass(frozen=True)
class Progress:
    """Where the run stands, for the step line."""

    elapsed: float
    """Seconds since the trainer started (start-up included)."""
    eta: float
    """Seconds the remaining steps take at this run's mean step time so far."""
    last_eval: tuple[int, float] | None = None
    """(step, held-out accuracy) of the latest evaluation: shown on every line after it."""


def console_line(step: int, total: int, m: Mapping[str, float], progress: Progress) -> str:
    fields: dict[str, Any] = {
        "score": m["critic/score/mean"],
        "acc": m["rollout/accuracy"],
        "keep": m.get("dynamic_sampling/keep_ratio", 1.0),
        "rounds": int(m.get("dynamic_sampling/gen_rounds", 1)),
        "resp_len": m["response_length/mean"],
        "pg_loss": m["actor/pg_loss"],
        "clipfrac": m["actor/pg_clipfrac"],
        "entropy": m.get("actor/entropy", 0.0),
        "grad_norm": m["actor/grad_norm"],
    }
    if progress.last_eval is not None:
        eval_step, accuracy = progress.last_eval
        fields["eval_acc"] = f"{accuracy:.3f}" + ("" if eval_step == step else f" (step {eval_step})")
    # Generated ahead, `gen` overlapped the previous step's update; `wait` is what the loop still waited for
    # it.
    wait = f" wait {m['timing_s/gen_wait']:.1f}" if "timing_s/gen_wait" in m else ""
    fields["t"] = (
        f"{m['timing_s/step']:.1f}s (gen {m['timing_s/gen']:.1f}{wait} "
        f"train {m['timing_s/update_actor']:.1f} sync {m['timing_s/update_weights']:.1f})"
    )
    fields["elapsed"] = format_duration(progress.elapsed)
    fields["eta"] = format_duration(progress.eta)
    return format_line(f"step {step}/{total}", fields)
