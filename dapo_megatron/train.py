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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dapo_megatron import config as job_config
from dapo_megatron.config import JobConfig
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.distributed.stop import StopRequest
from dapo_megatron.metrics import MetricsLogger, format_line
from dapo_megatron.models.sequence_padding import job_sequence_multiple
from dapo_megatron.records import RankShare
from dapo_megatron.trainer.actor import Actor
from dapo_megatron.trainer.batch import split_rows

if TYPE_CHECKING:
    from dapo_megatron.distributed.launch import ProcessEnv

IMPORTED_AT = time.perf_counter()
"""Start-up is counted from here (torch already imported, ~1.5 s). Not from the process's start time: launch
scripts `exec` the trainer from a shell that may have spent minutes on set-up first (tools/demo.sh)."""


def main(argv: list[str] | None = None) -> int:
    from dapo_megatron import preflight
    from dapo_megatron.cli import CONFIG_ERRORS, USAGE, report_config_error, wants_help
    from dapo_megatron.distributed.launch import process_env
    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.distributed.timeout import collective_timeout

    args = sys.argv[1:] if argv is None else argv
    if wants_help(args):
        print(f"{__doc__}\n{USAGE}", end="")
        return 0
    try:
        job = job_config.to_job_config(job_config.compose(args))
        if job.dry_run:  # the planned cluster's world size, not this process's; nothing is started
            from dapo_megatron.planning.report import dry_run

            return _dry_run_paths(preflight.find_problems(job)) or dry_run(job)
        env = process_env()
        job_config.validate(job, world_size=env.world_size)
        preflight.check_job(job)  # before the engine and the policy start: a typo costs seconds, not minutes
    except CONFIG_ERRORS as error:
        return report_config_error(error)
    try:
        # The process groups start inside the set-up: on CPU after the engine launched (`trainer/setup.py`).
        train(
            job,
            env,
            lambda: initialize(job.parallel, job.seed, timeout=collective_timeout(job, env.world_size)),
        )
    finally:
        shutdown()
    return 0


def _dry_run_paths(problems: list[Any]) -> int:
    """Report the job's path problems; 2 if one is more than a path missing here (the cluster may have it)."""
    for problem in problems:
        label = "warning (not found here; must exist where the job runs)" if problem.missing else "error"
        print(f"{label}: {problem.message}", file=sys.stderr, flush=True)
    return 2 if any(not problem.missing for problem in problems) else 0


def train(job: JobConfig, env: ProcessEnv | ParallelLayout, initialize: Callable[[], ParallelLayout]) -> None:
    """The DAPO loop. `env`, `initialize`: this process's place and how its process groups start
    (`trainer.setup.Session`).

    A prompt's way to the loss, one owner per stage (the records it becomes: `records.py`):
        rollouts.collect            trainer/collect.py     generate (rollout/client.py), score, filter
        rollouts.training_batch     trainer/batch.py       shaped rewards, GRPO advantages, token rows
        split_rows                  trainer/batch.py       this data-parallel rank's share, per optimizer step
        update_policy -> Actor.train_step                  trainer/actor.py: one optimizer step
            -> run_schedule         trainer/forward.py     megatron-core's forward/backward over micro-batches
            -> dapo_loss_fn         trainer/actor.py       log-probs of the vocab-parallel logits
            -> compute_actor_loss   algo/loss.py           compute_policy_loss (+ entropy), summed
        fleet.sync_weights          rollout/fleet.py       the new weights into every engine, checked
    """
    from dapo_megatron.trainer.setup import Session

    with (
        Session(job, env, initialize) as session,
        MetricsLogger(
            Path(job.output_dir) / "tensorboard", enabled=session.layout.is_logging_rank
        ) as metrics,
    ):
        layout, fleet, policy, rollouts = session.layout, session.fleet, session.policy, session.rollouts
        stop = StopRequest()
        step = saved = session.start_step
        startup = {
            **session.timings,
            "startup/first_sync_s": fleet.sync_weights(policy.actor, rollouts.client, step),
            "startup/total_s": time.perf_counter() - IMPORTED_AT,
        }
        metrics.log(startup, step)
        if layout.is_logging_rank:
            metrics.print(
                format_line("start-up", {k.removeprefix("startup/"): v for k, v in startup.items()})
            )
        if job.eval.every and step == 0:
            before = rollouts.evaluate()
            metrics.log(before, step)
            if layout.is_logging_rank:
                metrics.print(format_line("before training", {"eval_acc": before["eval/accuracy"]}))
        ahead = job.trainer.overlap_rollout
        # Token budgets count the padding the model computes (sequence parallelism, FP8).
        multiple = job_sequence_multiple(job.parallel, job.model.fp8)
        while step < job.trainer.total_steps and not stop.requested():
            step += 1
            started = time.perf_counter()
            groups, rollout_metrics = rollouts.collect()  # driving rank only
            rows, batch_metrics = rollouts.training_batch(groups, step)  # rewards, advantages
            if ahead and step < job.trainer.total_steps:
                # The next batch, sampled by the weights before this update.
                rollouts.generate_ahead(session.threads)
            fleet.release_memory()  # GPU: engine steps aside
            share = split_rows(rows, layout.dp_size, layout.dp_rank, job.trainer, multiple=multiple)
            # CPU: the trainer also takes the cores the engine frees.
            train_metrics = update_policy(
                policy.actor, share, off_policy=ahead, before_each_step=session.threads.take_idle_cores
            )
            wait_seconds = rollouts.wait_for_ahead(session.threads)  # no weights enter mid-generation
            sync_seconds = fleet.sync_weights(policy.actor, rollouts.client, step)
            step_metrics = {
                **rollout_metrics,
                **batch_metrics,
                **train_metrics,
                "timing_s/sync": sync_seconds,
            }
            if ahead:
                step_metrics["timing_s/gen_wait"] = wait_seconds
            if job.eval.every and step % job.eval.every == 0:
                step_metrics.update(rollouts.evaluate())
            step_metrics["timing_s/step"] = time.perf_counter() - started
            step_metrics["throughput/tokens_per_s"] = (
                batch_metrics["rollout/total_tokens"] / step_metrics["timing_s/step"]
            )
            metrics.log(step_metrics, step)
            if layout.is_logging_rank:
                metrics.print(console_line(step, job.trainer.total_steps, step_metrics))
            if (job.trainer.save_every and step % job.trainer.save_every == 0) or stop.requested():
                session.save(step)
                saved = step
            if job.trainer.hf_export_every and step % job.trainer.hf_export_every == 0:
                policy.export_hf(step)
        if saved != step:
            session.save(step)
        metrics.print(f"done at step {step}; checkpoints and logs in {job.output_dir}")


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
    ahead), whose log-probs the engine gave."""
    started = time.perf_counter()
    steps = len(share.micro_batch_sizes)
    if (steps > 1 or off_policy) and actor.algo.old_log_prob_source == "rollout":
        # The engine's log-probs become π_old; kept as rollout log-probs too they would report a
        # trainer-engine mismatch of exactly zero, so they are not.
        share.rows.old_log_prob, share.rows.rollout_log_prob = share.rows.rollout_log_prob, None
    elif steps > 1:
        share.rows.old_log_prob = actor.compute_log_probs(share.rows, share.all_micro_batch_sizes)
    totals: dict[str, float] = {}
    for mini, micro in share.mini_batches():
        before_each_step()
        for name, value in actor.train_step(mini, micro).items():
            totals[name] = totals.get(name, 0.0) + value / steps
    metrics = {f"actor/{name}": value for name, value in totals.items()}
    metrics["timing_s/train"] = time.perf_counter() - started
    return metrics


def console_line(step: int, total: int, m: dict[str, float]) -> str:
    fields: dict[str, Any] = {
        "score": m["rollout/score"],
        "acc": m["rollout/accuracy"],
        "keep": m.get("dynamic_sampling/keep_ratio", 1.0),
        "rounds": int(m.get("dynamic_sampling/gen_rounds", 1)),
        "resp_len": m["rollout/response_length"],
        "pg_loss": m["actor/pg_loss"],
        "clipfrac": m["actor/pg_clipfrac"],
        "entropy": m.get("actor/entropy", 0.0),
        "grad_norm": m["actor/grad_norm"],
    }
    if "eval/accuracy" in m:
        fields["eval_acc"] = m["eval/accuracy"]
    # Generated ahead, `gen` overlapped the previous step's update; `wait` is what the loop still waited for
    # it.
    wait = f" wait {m['timing_s/gen_wait']:.1f}" if "timing_s/gen_wait" in m else ""
    fields["t"] = (
        f"{m['timing_s/step']:.1f}s (gen {m['timing_s/gen']:.1f}{wait} train {m['timing_s/train']:.1f} "
        f"sync {m['timing_s/sync']:.1f})"
    )
    return format_line(f"step {step}/{total}", fields)


if __name__ == "__main__":
    sys.exit(main())
