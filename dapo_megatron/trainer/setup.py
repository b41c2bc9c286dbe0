"""The job's set-up and tear-down: what one training process holds, built once, in a fixed order.

The parts (each owns its data, `train.py` drives them):
    fleet      `trainer/fleet.py`         the SGLang engines: placement, launch, liveness, memory, weight sync
    policy     `trainer/policy.py`        this rank's shard of the model, its optimizer, its checkpoints
    rollouts   `trainer/rollout_side.py`  the driving rank's prompts, client, reward workers, batch collection
    threads    `trainer/cpu_threads.py`   on CPU, how the engine and the trainer share the cores
The fleet is made, and on CPU its engine launched, by the caller before torch loads
(`train.launch_engine_first`): the session receives it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from dapo_megatron import backends
from dapo_megatron.config import JobConfig
from dapo_megatron.data.tokenizer import load_tokenizer
from dapo_megatron.distributed.launch import ProcessEnv
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.metrics import MetricsLogger, console, format_line
from dapo_megatron.models.fused_kernels import describe
from dapo_megatron.models.qwen2 import resolve_transformer_impl
from dapo_megatron.trainer.cpu_threads import TrainerThreads
from dapo_megatron.trainer.evaluate import eval_accuracy
from dapo_megatron.trainer.fleet import EngineFleet
from dapo_megatron.trainer.policy import Policy
from dapo_megatron.trainer.rollout_side import RolloutSide
from dapo_megatron.trainer.startup import banner
from dapo_megatron.trainer.sync_probe import PROBE_CONTINUATION, SyncProbe


class Session:
    """Built on entry, in this order (each step may use what the ones before it made):

    1. the start-up banner (the engines' placement is the caller's `fleet`);
    2. this rank's engine launched (on CPU the caller launched it already) and the policy built, in the
       order the device needs (`EngineFleet.launches_before_policy`): the tokenizer, the process groups
       (`initialize`), the model and optimizer, and their initial state (resume, `trainer.load` or the HF
       weights);
    3. every engine ready and known to every rank; the driving rank's rollout side started, with what a
       resumed checkpoint kept of it;
    4. the weight sync and its probe batch;
    5. the trainer's CPU threads.
    `start_training` then readies the training loop (the first weight sync, the evaluation before training),
    and `finish_training` ends it (the checkpoint a stop request left unwritten, the ranks' last barrier).
    Taken down on exit, whatever was built of it: a batch generated ahead stopped, the weight sync, the
    client and reward workers, the engine. The process groups are the caller's
    (`distributed.layout.shutdown`).

    Args:
        env: this process's place (`distributed/launch.ProcessEnv`, or a `ParallelLayout` already made).
        initialize: makes the process groups (`distributed.layout.initialize`); called once, in step 2.
        fleet: the job's engines as the caller made them (`train.launch_engine_first`: their placement; on
            CPU this rank's engine launched). Shut down on exit.
    """

    def __init__(
        self,
        job: JobConfig,
        env: ProcessEnv | ParallelLayout,
        initialize: Callable[[], ParallelLayout],
        fleet: EngineFleet,
    ) -> None:
        self.job, self.env, self._initialize = job, env, initialize
        self.fleet = fleet
        self.rollouts: RolloutSide | None = None
        self.timings: dict[str, float] = {}
        """Start-up phases in seconds, for the console and TensorBoard."""
        self.resumed_from: Path | None = None
        """The checkpoint directory the job resumed from (None: a fresh start)."""

    def __enter__(self) -> Session:
        try:
            self._set_up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _set_up(self) -> None:
        job, env = self.job, self.env
        if not job.model.hf_dir:
            raise ValueError(
                "model.hf_dir is required: the Hugging Face directory with the tokenizer (and the "
                "initial weights unless trainer.load is set); the demo builds one with "
                "tools/make_demo_base.py"
            )
        transformer_engine = resolve_transformer_impl(job.model) == "transformer_engine"
        layers = "Transformer Engine" if transformer_engine else "local"
        for line in banner(
            job,
            world_size=env.world_size,
            device=self.fleet.backend.name,
            engine_logs=self.fleet.log_files,
            kernels=f"{layers}; {describe(transformer_engine)}",
        ):
            console.info(line)
        stages = (self.fleet.launch, self._build_policy)
        for stage in stages if self.fleet.launches_before_policy else reversed(stages):
            stage()
        layout = self.layout
        self.rollouts = RolloutSide(job, layout, self.tokenizer)
        if layout.is_logging_rank:
            self.rollouts.start_rewards()  # the workers import their scorers while the engines start
        started = time.perf_counter()
        self.fleet.connect(layout)
        self._phase("engine_wait", started, f"{len(self.fleet.records)} SGLang engine(s) ready")

        started = time.perf_counter()
        self.rollouts.restore(self.resumed)
        if layout.is_logging_rank:
            self.rollouts.start(self.fleet.urls, on_error=self.fleet.liveness_check())
        self._phase("rollout_side", started, "prompts, rollout client and reward workers")

        probe = SyncProbe.from_driving_rank(
            self.rollouts.eval_prompts if layout.is_logging_rank else None,
            self.rollouts.encode(PROBE_CONTINUATION),
            pad_token_id=self.rollouts.pad_token_id,
        )
        self.fleet.open_sync(layout, probe)

        nodes: list[int | None] = [None] * layout.world_size
        torch.distributed.all_gather_object(nodes, layout.node)
        self.threads = TrainerThreads.for_job(
            backends.of(layout.device),
            use_idle_cores=job.trainer.cpu_idle_cores,
            ranks_on_node=nodes.count(layout.node),
            engine=self.fleet.engine,
            engine_idle_cores=job.rollout.cpu_idle_cores,
        )
        self.threads.engine_idle()  # until a batch is generated ahead

    def start_training(self, metrics: MetricsLogger, process_started: float) -> tuple[int, float] | None:
        """Ready the loop at `start_step`: the engine steps aside (GPU) for the training state to come back
        (`trainer.offload_during_rollout`: it left before the engine started) and the first weight sync;
        start-up's metrics and line (`startup/total_s`: since `process_started`); on a fresh start with
        `eval.every`, the evaluation before training. Returns that evaluation's (step, held-out accuracy),
        or None."""
        fleet, policy, rollouts, step = self.fleet, self.policy, self.rollouts, self.start_step
        fleet.release_memory()  # GPU: the engine steps aside for the trainer's state to come back
        policy.reload_state()  # trainer.offload_during_rollout: it left before the engine started
        first_sync = fleet.sync_weights(policy.actor, rollouts.client, step, offload=policy.offload_state)
        startup_metrics = {
            **self.timings,
            "startup/first_sync_s": first_sync.seconds,
            "startup/total_s": time.perf_counter() - process_started,
        }
        metrics.log(startup_metrics, step)
        console.info(
            "start-up: first weight sync %.1fs; ready in %.1fs",
            startup_metrics["startup/first_sync_s"],
            startup_metrics["startup/total_s"],
        )
        if not (self.job.eval.every and step == 0):
            return None
        before = rollouts.evaluate()
        metrics.log(before, step)
        last_eval = (step, eval_accuracy(before) or 0.0)
        console.info(format_line("before training", {"eval_acc": last_eval[1]}))
        return last_eval

    def finish_training(self, step: int, saved: int) -> None:
        """The loop ended after step `step`, the last checkpoint written at `saved`: a checkpoint of `step` if
        they differ (a stop request cut the next step's generation short), then every rank waits for all the
        others before any leaves."""
        if saved != step:  # stopped while generating the step after the last checkpoint
            self.fleet.release_memory()
            self.save(step)
            console.info("checkpoint of step %d written", step)
        # The driving rank may still be using every rank's engine (the last sync's check, the last
        # evaluation): no rank leaves and shuts its engine down before it is done.
        torch.distributed.barrier()
        console.info("done at step %d; checkpoints and logs in %s", step, self.job.output_dir)

    def _build_policy(self) -> None:
        started = time.perf_counter()
        self.tokenizer = load_tokenizer(self.job.model.hf_dir)
        self.layout = self._initialize()
        self._phase("process_groups", started, f"tokenizer and process groups ({self.layout.describe()})")
        started = time.perf_counter()
        self.policy = Policy(self.job, self.layout)
        self.start_step, self.resumed = self.policy.load_initial_state()
        self.resumed_from = self.policy.resumed_from
        # trainer.offload_during_rollout: on GPUs the engine launches next and sizes its KV cache from the
        # memory left free, which then includes the state's; it comes back for the first weight sync.
        self.policy.offload_state()
        self._phase("policy", started, f"policy built, {self._initial_state()}")

    def _phase(self, name: str, started: float, what: str) -> None:
        """Record a start-up phase's time (`startup/<name>_s`) and say what it did."""
        seconds = self.timings[f"startup/{name}_s"] = time.perf_counter() - started
        console.info("start-up: %s in %.1fs", what, seconds)

    def _initial_state(self) -> str:
        """Where the policy's state came from, and on resume what the checkpoint restored."""
        job = self.job
        if self.resumed is None:
            if job.trainer.load:
                return f"weights from trainer.load {job.trainer.load}; starting at step 0"
            return f"weights from model.hf_dir {job.model.hf_dir}; starting at step 0"
        rng = "RNG states" if self.policy.actor.rng_restored else "not the RNG states (another layout)"
        restored = ["model", "optimizer and LR schedule", rng, "prompt position"]
        backlog = len(self.resumed.get("backlog") or [])
        if backlog:
            restored.append(f"{backlog} carried-over prompts")
        if self.resumed.get("ahead") is not None:
            restored.append("the batch generated ahead")
        return f"resumed from {self.resumed_from} at step {self.start_step}: restored {', '.join(restored)}"

    def close(self) -> None:
        """The tear-down, in order; safe on a partial set-up."""
        if self.rollouts is not None:
            self.rollouts.stop_generating()
        if self.fleet is not None:
            self.fleet.close_sync()
        if self.rollouts is not None:
            self.rollouts.close()
        if self.fleet is not None:
            self.fleet.shutdown()

    def save(self, step: int) -> Path:
        """A checkpoint: the policy, and the rollout side's position, backlog and batch generated ahead."""
        return self.policy.save(step, self.rollouts.state_dict())
