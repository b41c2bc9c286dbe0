"""DAPO training: `python -m dapo_megatron.train [hydra overrides]` (also under torchrun and srun).

One step: the driving rank generates with SGLang and keeps only informative prompt groups (dynamic
sampling) -> shaped rewards and GRPO advantages -> every rank trains on its share, one optimizer step
per mini-batch, with the token-level DAPO loss -> the new weights go into the engine -> metrics,
evaluation and checkpoints. With `trainer.overlap_rollout` the engine generates the next batch while the
policy trains on this one (one step off-policy), and takes the new weights once that batch is complete.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Nothing here imports torch (tests/unit/test_engine_first.py): a CPU trainer launches its engine first.
from dapo_megatron import config as job_config
from dapo_megatron.config import JobConfig
from dapo_megatron.metrics import MetricsLogger, configure_console, console, format_duration, format_line
from dapo_megatron.models.sequence_padding import job_sequence_multiple
from dapo_megatron.trainer import startup

if TYPE_CHECKING:
    from dapo_megatron.distributed.launch import ProcessEnv
    from dapo_megatron.distributed.layout import ParallelLayout
    from dapo_megatron.records import PolicyRows, RankShare
    from dapo_megatron.trainer.actor import Actor
    from dapo_megatron.trainer.fleet import EngineFleet

IMPORTED_AT = time.perf_counter()
"""Start-up is counted from here (~0.2 s after the interpreter started; torch is imported later). Not from the
process's start time: launch scripts `exec` the trainer from a shell that may have spent minutes on set-up
first (tools/demo.sh)."""


def main(argv: list[str] | None = None) -> int:
    from dapo_megatron import preflight
    from dapo_megatron.cli import (
        CONFIG_ERRORS,
        report_config_error,
        resolved_config,
        split_cfg_flag,
        usage,
        wants_help,
    )
    from dapo_megatron.distributed.launch import process_env
    from dapo_megatron.distributed.run_tmpdir import use_run_tmpdir

    args = sys.argv[1:] if argv is None else argv
    if wants_help(args):
        print(f"{__doc__}\n{usage()}", end="")
        return 0
    try:
        show_config, args = split_cfg_flag(args)
        cfg = job_config.compose(args)
        job = job_config.to_job_config(cfg)
        if show_config:
            print(resolved_config(cfg), end="")
            return 0
        if job.dry_run:  # the planned cluster's world size, not this process's; nothing is started
            from dapo_megatron.planning.report import dry_run

            return _dry_run_paths(preflight.find_problems(job)) or dry_run(job)
        env = process_env()
        job_config.validate(job, world_size=env.world_size)
        preflight.check_job(job)  # before the engine and the policy start: a typo costs seconds, not minutes
    except CONFIG_ERRORS as error:
        return report_config_error(error)
    use_run_tmpdir()  # before anything makes temporary files: none outlives the run, even a killed one
    fleet = launch_engine_first(job, env)
    try:
        # torch loads from here on.
        from dapo_megatron.distributed.layout import initialize, shutdown
        from dapo_megatron.trainer.timeout import collective_timeout

        try:
            # The process groups start inside the set-up: on CPU after the policy's imports.
            train(
                job,
                env,
                lambda: initialize(job.parallel, job.seed, timeout=collective_timeout(job, env.world_size)),
                fleet,
            )
        finally:
            shutdown()
    finally:
        if fleet is not None:
            fleet.shutdown()
    return 0


def launch_engine_first(job: JobConfig, env: ProcessEnv) -> EngineFleet | None:
    """The job's engines as this process sees them, its own engine launched already where that comes before
    the policy (`EngineFleet.launches_before_policy`, CPU): there it starts before the trainer imports torch,
    so that torch's import (~1 s) runs beside SGLang's start-up (~6.5 s of one core), the longest part of
    the trainer's. None without `model.hf_dir` (the session says what is missing)."""
    from dapo_megatron.distributed.launch import accelerator
    from dapo_megatron.trainer.fleet import EngineFleet

    if not job.model.hf_dir:
        return None
    fleet = EngineFleet.of_process(job, env, accelerator())
    if fleet.launches_before_policy:
        fleet.launch()
    return fleet


def _dry_run_paths(problems: list[Any]) -> int:
    """Report the job's path problems; 2 if one is more than a path missing here (the cluster may have it)."""
    for problem in problems:
        label = "warning (not found here; must exist where the job runs)" if problem.missing else "error"
        print(f"{label}: {problem.message}", file=sys.stderr, flush=True)
    return 2 if any(not problem.missing for problem in problems) else 0


def train(
    job: JobConfig,
    env: ProcessEnv | ParallelLayout,
    initialize: Callable[[], ParallelLayout],
    fleet: EngineFleet | None = None,
) -> None:
    """The DAPO loop. `env`, `initialize`, `fleet`: this process's place, how its process groups start and
    its engines if launched already (`trainer.setup.Session`).

    A prompt's way to the loss, one owner per stage (the records it becomes: `records.py`):
        rollouts.collect            trainer/collect.py     generate (rollout/client.py), score, filter
        rollouts.training_batch     trainer/batch.py       shaped rewards, GRPO advantages, token rows
        split_rows                  trainer/batch.py       this data-parallel rank's share, per optimizer step
        update_policy -> Actor.train_step                  trainer/actor.py: one optimizer step
            -> run_schedule         trainer/forward.py     megatron-core's forward/backward over micro-batches
            -> dapo_loss_fn         trainer/actor.py       log-probs of the vocab-parallel logits
            -> compute_actor_loss   algo/loss.py           compute_policy_loss (+ entropy), summed
        fleet.sync_weights          trainer/fleet.py       the new weights into every engine, checked
    """
    import torch

    from dapo_megatron.distributed.stop import StopRequest
    from dapo_megatron.trainer.batch import split_rows
    from dapo_megatron.trainer.evaluate import eval_accuracy
    from dapo_megatron.trainer.setup import Session

    configure_console(logging_rank=env.rank == 0, level=job.trainer.log_level)
    resolved = startup.resolved_config(job)
    if env.rank == 0:
        startup.save_config(resolved, Path(job.output_dir))
    with (
        Session(job, env, initialize, fleet) as session,
        MetricsLogger(
            Path(job.output_dir) / "tensorboard",
            enabled=session.layout.is_logging_rank,
            loggers=job.trainer.loggers,
            config=resolved,
            run_name=job.experiment_name,
            wandb_project=job.trainer.wandb_project,
        ) as metrics,
    ):
        layout, fleet, policy, rollouts = session.layout, session.fleet, session.policy, session.rollouts
        stop = StopRequest()
        step = saved = first = session.start_step
        fleet.release_memory()  # GPU: the engine steps aside for the trainer's state to come back
        policy.reload_state()  # trainer.offload_during_rollout: it left before the engine started
        first_sync = fleet.sync_weights(policy.actor, rollouts.client, step, offload=policy.offload_state)
        startup_metrics = {
            **session.timings,
            "startup/first_sync_s": first_sync.seconds,
            "startup/total_s": time.perf_counter() - IMPORTED_AT,
        }
        metrics.log(startup_metrics, step)
        console.info(
            "start-up: first weight sync %.1fs; ready in %.1fs",
            startup_metrics["startup/first_sync_s"],
            startup_metrics["startup/total_s"],
        )
        last_eval: tuple[int, float] | None = None
        if job.eval.every and step == 0:
            before = rollouts.evaluate()
            metrics.log(before, step)
            last_eval = (step, eval_accuracy(before) or 0.0)
            console.info(format_line("before training", {"eval_acc": last_eval[1]}))
        ahead = job.trainer.overlap_rollout
        # Token budgets count the padding the model computes (sequence parallelism, FP8).
        multiple = job_sequence_multiple(job.parallel, job.model.fp8)
        peak_tflops = actor_peak_tflops(job)
        loop_started = time.perf_counter()
        while step < job.trainer.total_steps and not stop.requested():
            step += 1
            started = time.perf_counter()
            # Phase lines at DEBUG: where a hung or killed job was (bench/faults.py aims at them too).
            console.debug("step %d: generate", step)
            groups, rollout_metrics = rollouts.collect(stop.seen_here)  # driving rank only
            batch = rollouts.training_batch(groups, step)  # rewards, advantages
            if batch is None:  # a stop request cut the generation short: step - 1 is the one to keep
                console.info("stop requested while step %d generated: its requests were aborted", step)
                step -= 1
                break
            rows, batch_metrics = batch
            if ahead and step < job.trainer.total_steps:
                # The next batch, sampled by the weights before this update.
                rollouts.generate_ahead(session.threads)
            fleet.release_memory()  # GPU: engine steps aside
            moved_seconds = policy.reload_state()  # the training state back from host memory
            share = split_rows(rows, layout.dp_size, layout.dp_rank, job.trainer, multiple=multiple)
            # CPU: the trainer also takes the cores the engine frees.
            console.debug("step %d: update", step)
            train_metrics = update_policy(
                policy.actor, share, off_policy=ahead, before_each_step=session.threads.take_idle_cores
            )
            train_metrics.update(
                actor_perf(job, rows, train_metrics["timing_s/update_actor"], layout.world_size, peak_tflops)
            )
            wait_seconds = rollouts.wait_for_ahead(session.threads)  # no weights enter mid-generation
            # Checkpoints and exports come while the engine's memory is released (GPU): after the sync the
            # engine holds its KV cache again, and the trainer's state would have to come back beside it.
            last = step == job.trainer.total_steps
            if (job.trainer.save_every and step % job.trainer.save_every == 0) or last or stop.requested():
                console.debug("step %d: checkpoint", step)
                session.save(step)
                console.debug("step %d: checkpoint written", step)
                saved = step
            if job.trainer.hf_export_every and step % job.trainer.hf_export_every == 0:
                policy.export_hf(step)
            console.debug("step %d: weight sync", step)
            # The training state leaves mid-sync: the engine generates in the memory it leaves.
            sync = fleet.sync_weights(policy.actor, rollouts.client, step, offload=policy.offload_state)
            console.debug("step %d: synced", step)
            moved_seconds += sync.offload_seconds
            step_metrics = {
                **rollout_metrics,
                **batch_metrics,
                **train_metrics,
                "timing_s/update_weights": sync.seconds,
            }
            if job.trainer.offload_during_rollout:
                step_metrics["timing_s/offload"] = moved_seconds
            if ahead:
                step_metrics["timing_s/gen_wait"] = wait_seconds
            if job.eval.every and step % job.eval.every == 0:
                evaluation = rollouts.evaluate(stop.seen_here)
                step_metrics.update(evaluation)
                accuracy = eval_accuracy(evaluation)
                if accuracy is not None:  # None: a stop request cut it short
                    last_eval = (step, accuracy)
            step_metrics["timing_s/step"] = time.perf_counter() - started
            # verl's throughput: tokens (prompts and responses) per second and device.
            step_metrics["perf/throughput"] = batch_metrics["perf/total_num_tokens"] / (
                step_metrics["timing_s/step"] * layout.world_size
            )
            metrics.log(step_metrics, step)
            if layout.is_logging_rank:  # the only rank holding every metric of the line
                now = time.perf_counter()
                progress = Progress(
                    elapsed=now - IMPORTED_AT,
                    eta=(now - loop_started) / (step - first) * (job.trainer.total_steps - step),
                    last_eval=last_eval,
                )
                console.info(console_line(step, job.trainer.total_steps, step_metrics, progress))
        if saved != step:  # stopped while generating the step after the last checkpoint
            fleet.release_memory()
            session.save(step)
            console.info("checkpoint of step %d written", step)
        # The driving rank may still be using every rank's engine (the last sync's check, the last
        # evaluation): no rank leaves and shuts its engine down before it is done.
        torch.distributed.barrier()
        console.info("done at step %d; checkpoints and logs in %s", step, job.output_dir)


def actor_peak_tflops(job: JobConfig) -> float | None:
    """One GPU's dense peak for the policy's matmul precision; None on CPU or a GPU `flops` does not know."""
    import torch

    from dapo_megatron import flops

    if not torch.cuda.is_available():
        return None
    return flops.peak_tflops(torch.cuda.get_device_name(), "fp8" if job.model.fp8.enabled else "bf16")


def actor_perf(
    job: JobConfig, rows: PolicyRows, seconds: float, world_size: int, peak_tflops: float | None
) -> dict[str, float]:
    """GPU only: `perf/mfu/actor` (the update's model FLOPs over the devices' peak, as verl reports it) and
    `perf/max_memory_allocated_gb` (the largest of any rank's peak). Collective on GPUs."""
    import torch

    from dapo_megatron import flops

    if not torch.cuda.is_available():
        return {}
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    metrics = {"perf/max_memory_allocated_gb": float(peak)}
    if peak_tflops is not None:
        lengths = (rows.widths() + 1).tolist()  # label positions + the first token
        metrics["perf/mfu/actor"] = flops.mfu(
            flops.training_flops(job.model, lengths),
            seconds,
            num_gpus=world_size,
            peak_tflops_per_gpu=peak_tflops,
        )
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
    from dapo_megatron.trainer.actor import combine_steps

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


if __name__ == "__main__":
    sys.exit(main())
