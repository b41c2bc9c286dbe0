"""DAPO training: `python -m dapo_megatron.train [hydra overrides]` (also under torchrun and srun).

One step: the driving rank generates with SGLang and keeps only informative prompt groups (dynamic
sampling) -> shaped rewards and GRPO advantages -> every rank trains on its share, one optimizer step
per mini-batch, with the token-level DAPO loss -> the new weights go into the engine -> metrics,
evaluation and checkpoints. With `trainer.overlap_rollout` the engine generates the next batch while the
policy trains on this one (one step off-policy), and takes the new weights once that batch is complete.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Nothing here imports torch (tests/unit/test_torch_free.py): a CPU trainer launches its engine first.
from dapo_megatron import backends, preflight
from dapo_megatron import config as job_config
from dapo_megatron.cli import (
    CONFIG_ERRORS,
    report_config_error,
    resolved_config,
    split_cfg_flag,
    usage,
    wants_help,
)
from dapo_megatron.config import JobConfig
from dapo_megatron.distributed.launch import ProcessEnv, process_env
from dapo_megatron.distributed.run_tmpdir import use_run_tmpdir
from dapo_megatron.metrics import MetricsLogger, configure_console, console
from dapo_megatron.models.sequence_padding import job_sequence_multiple
from dapo_megatron.trainer import startup
from dapo_megatron.trainer.fleet import EngineFleet

if TYPE_CHECKING:
    from dapo_megatron.distributed.layout import ParallelLayout
    from dapo_megatron.distributed.stop import StopRequest
    from dapo_megatron.trainer.setup import Session

IMPORTED_AT = time.perf_counter()
"""Start-up is counted from here (~0.2 s after the interpreter started; torch is imported later). Not from the
process's start time: launch scripts `exec` the trainer from a shell that may have spent minutes on set-up
first (tools/demo.sh)."""


def main(argv: list[str] | None = None) -> int:
    parsed = parse_job(sys.argv[1:] if argv is None else argv)
    if isinstance(parsed, int):  # help, the resolved config, a dry run or a config error: nothing to train
        return parsed
    job, env = parsed
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
        fleet.shutdown()
    return 0


def parse_job(args: list[str]) -> tuple[JobConfig, ProcessEnv] | int:
    """The job the command line describes, checked, and this process's place; or the exit code when there is
    nothing to train: `--help`, `--cfg job`, a dry run, or a config error (reported). Torch-free."""
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
    return job, env


def launch_engine_first(job: JobConfig, env: ProcessEnv | ParallelLayout) -> EngineFleet:
    """The job's engines as this process sees them: the one place that makes them (`trainer.setup.Session`
    receives them). Its own engine is launched already where that comes before the policy
    (`EngineFleet.launches_before_policy`, CPU): there it starts before the trainer imports torch, so that
    torch's import (~1 s) runs beside SGLang's start-up (~6.5 s of one core), the longest part of the
    trainer's. Not launched without `model.hf_dir` (the session says what is missing)."""
    fleet = EngineFleet.of_process(job, env, backends.detect())
    if job.model.hf_dir and fleet.launches_before_policy:
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
    fleet: EngineFleet,
) -> None:
    """The DAPO loop. `env`, `initialize`, `fleet`: this process's place, how its process groups start and
    its engines (`launch_engine_first`; `trainer.setup.Session`).

    A prompt's way to the loss, one owner per stage (the records it becomes: `records.py`):
        rollouts.collect            trainer/collect.py     generate (rollout/client.py), score, filter
        rollouts.training_batch     trainer/batch.py       shaped rewards, GRPO advantages, token rows
        split_rows                  trainer/batch.py       this data-parallel rank's share, per optimizer step
        update_policy -> Actor.train_step                  trainer/actor.py: one optimizer step
            -> run_schedule         trainer/forward.py     megatron-core's forward/backward over micro-batches
            -> dapo_loss_fn         trainer/actor.py       log-probs of the vocab-parallel logits
            -> compute_actor_loss   algo/loss.py           compute_policy_loss (+ entropy), summed
        fleet.sync_weights          trainer/fleet.py       the new weights into every engine, checked
    The step's metrics and line: `trainer/step_metrics.py`.
    """
    from dapo_megatron.distributed.stop import StopRequest
    from dapo_megatron.trainer.actor import update_policy
    from dapo_megatron.trainer.batch import split_rows
    from dapo_megatron.trainer.step_metrics import StepLog

    with _session_and_metrics(job, env, initialize, fleet) as (session, metrics):
        layout, fleet, policy, rollouts = session.layout, session.fleet, session.policy, session.rollouts
        stop = StopRequest()
        step = saved = session.start_step
        last_eval = session.start_training(metrics, IMPORTED_AT)  # the first sync; evaluation before training
        log = StepLog(job, layout, metrics, first_step=step, process_started=IMPORTED_AT, last_eval=last_eval)
        ahead = job.trainer.overlap_rollout
        # Token budgets count the padding the model computes (sequence parallelism, FP8).
        multiple = job_sequence_multiple(job.parallel, job.model.fp8)
        while step < job.trainer.total_steps and not stop.requested():
            step += 1
            log.start_step()
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
            reloaded = policy.reload_state()  # the training state back from host memory
            share = split_rows(rows, layout.dp_size, layout.dp_rank, job.trainer, multiple=multiple)
            # CPU: the trainer also takes the cores the engine frees.
            console.debug("step %d: update", step)
            update = update_policy(
                policy.actor, share, off_policy=ahead, before_each_step=session.threads.take_idle_cores
            )
            train_metrics = log.updated(rows, update)  # + its MFU and peak memory, measured now
            waited = rollouts.wait_for_ahead(session.threads)  # no weights enter mid-generation
            if _save_and_export(session, step, stop):  # before the sync: the engine's memory is released
                saved = step
            console.debug("step %d: weight sync", step)
            # The training state leaves mid-sync: the engine generates in the memory it leaves.
            sync = fleet.sync_weights(policy.actor, rollouts.client, step, offload=policy.offload_state)
            console.debug("step %d: synced", step)
            due = job.eval.every and step % job.eval.every == 0
            evaluation = rollouts.evaluate(stop.seen_here) if due else None
            log.finish(
                step, rollout_metrics, batch_metrics, train_metrics, sync, reloaded, waited, evaluation
            )
        session.finish_training(step, saved)


@contextlib.contextmanager
def _session_and_metrics(
    job: JobConfig,
    env: ProcessEnv | ParallelLayout,
    initialize: Callable[[], ParallelLayout],
    fleet: EngineFleet,
) -> Iterator[tuple[Session, MetricsLogger]]:
    """What the loop runs in: the console, the resolved config saved beside the outputs, the session and
    the run's metrics (`trainer.loggers`, written by the logging rank only). Closed in reverse order."""
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
        yield session, metrics


def _save_and_export(session: Session, step: int, stop: StopRequest) -> bool:
    """Step `step`'s checkpoint (every `trainer.save_every` steps, at the last step and on a stop request) and
    Hugging Face export (`trainer.hf_export_every`). True when a checkpoint was written.

    Both come while the engine's memory is released (GPU): after the sync the engine holds its KV cache
    again, and the trainer's state would have to come back beside it."""
    trainer = session.job.trainer
    last = step == trainer.total_steps
    saving = (trainer.save_every and step % trainer.save_every == 0) or last or stop.requested()
    if saving:
        console.debug("step %d: checkpoint", step)
        session.save(step)
        console.debug("step %d: checkpoint written", step)
    if trainer.hf_export_every and step % trainer.hf_export_every == 0:
        session.policy.export_hf(step)
    return bool(saving)


if __name__ == "__main__":
    sys.exit(main())
