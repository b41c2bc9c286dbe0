"""This rank's shard of the policy: the model, its optimizer and schedule (`Actor`), and its checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dapo_megatron import checkpoint
from dapo_megatron.config import JobConfig
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.models.qwen2 import build_gpt_model
from dapo_megatron.models.weights import export_hf, load_hf_weights
from dapo_megatron.trainer.actor import Actor
from dapo_megatron.trainer.optimizer import build_optimizer, wrap_for_training


class Policy:
    def __init__(self, job: JobConfig, layout: ParallelLayout) -> None:
        self.job, self.layout = job, layout
        self.checkpoints = Path(job.output_dir) / "checkpoints"
        self.resumed_from: Path | None = None
        """The checkpoint directory `load_initial_state` resumed from."""
        self.model = wrap_for_training(build_gpt_model(job.model, job.parallel, layout), job.parallel)
        optimizer, scheduler = build_optimizer(
            self.model, job.optim, job.parallel, job.model, job.trainer.optimizer_steps
        )
        self.actor = Actor(
            self.model,
            optimizer,
            scheduler,
            job.algo,
            layout,
            vocab_size=job.model.vocab_size,
            temperature=job.rollout.temperature,
        )

    def load_initial_state(self) -> tuple[int, dict[str, Any] | None]:
        """Resume from the latest checkpoint (`trainer.resume`), else start from trainer.load or the HF
        weights. Returns the step and the state the checkpoint shares across ranks (None when not resuming):
        the rollout side's, which it restores (`RolloutSide.restore`)."""
        resume = self.job.trainer.resume
        path = None
        if resume == "auto" and (self.checkpoints / checkpoint.TRACKER_FILE).exists():
            path = self.checkpoints
        elif resume not in ("auto", "never"):
            path = Path(resume)
        if path is not None:
            directory = self.resumed_from = checkpoint.load_model(self.model, path)
            shared = checkpoint.load_training_state(self.model, directory, self.layout, self.actor)
            return shared["step"], shared
        if self.job.trainer.load:
            checkpoint.load_model(self.model, self.job.trainer.load)
        else:
            load_hf_weights(self.model, self.job.model.hf_dir, self.job.model, self.layout)
        # The optimizer copied the bf16 weights it was built over into its fp32 masters, and writes the
        # masters back after each step: without this the first step would restore the random initialisation.
        self.actor.optimizer.reload_model_params()
        return 0, None

    def save(self, step: int, rollout_state: dict[str, Any] | None) -> Path:
        """A checkpoint of step `step`: the model, the optimizer and schedule (resumable under any layout),
        every rank's RNG states, and the driving rank's `rollout_state` (None elsewhere) beside the step."""
        shared = None if rollout_state is None else {"step": step, **rollout_state}
        return checkpoint.save_model(
            self.model,
            self.checkpoints,
            step,
            self.job.model,
            self.layout,
            training=self.actor,
            shared_state=shared,
            keep_last=self.job.trainer.keep_last_checkpoints,
            keep_every=self.job.trainer.keep_checkpoint_every,
        )

    def export_hf(self, step: int) -> None:
        export_hf(
            self.model,
            self.job.model,
            self.layout,
            Path(self.job.output_dir) / "hf" / f"step_{step:07d}",
            tokenizer_dir=self.job.model.hf_dir,
        )
