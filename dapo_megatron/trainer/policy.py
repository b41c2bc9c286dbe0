"""This rank's shard of the policy: the model, its optimizer and schedule (`Actor`), its checkpoints, and
where its training state is while the engine generates (`trainer.offload_during_rollout`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from dapo_megatron import checkpoint
from dapo_megatron.config import JobConfig
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.models.qwen2 import build_gpt_model
from dapo_megatron.models.weights import export_hf, load_hf_weights
from dapo_megatron.trainer.actor import Actor
from dapo_megatron.trainer.offload import TrainerStateOffload
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
        self._offload = (
            TrainerStateOffload(self.model, optimizer) if job.trainer.offload_during_rollout else None
        )

    def offload_state(self) -> float:
        """trainer.offload_during_rollout: parameters, gradient buffers and optimizer state to host memory,
        for the engine to generate in the device memory they leave. Returns the seconds taken (0 when off)."""
        return self._offload.offload() if self._offload is not None else 0.0

    def reload_state(self) -> float:
        """Back to the device what `offload_state` moved, bit for bit. Returns the seconds taken (0 when
        off)."""
        return self._offload.reload() if self._offload is not None else 0.0

    def _resident(self) -> contextlib.AbstractContextManager[None]:
        """The training state on the device for the duration (checkpoints and exports read it)."""
        return self._offload.resident() if self._offload is not None else contextlib.nullcontext()

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
        with self._resident():
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
        with self._resident():
            export_hf(
                self.model,
                self.job.model,
                self.layout,
                Path(self.job.output_dir) / "hf" / f"step_{step:07d}",
                tokenizer_dir=self.job.model.hf_dir,
            )
