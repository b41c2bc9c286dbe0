"""How long before the time limit a job needs its stop signal (`#SBATCH --signal=B:USR1@N`), from its config
alone (no torch).

The trainer checks the stop request between generation rounds and between steps (`train.py`): a request that
arrives while the engines generate aborts the round, and the job checkpoints the last finished step; one that
arrives just before the update waits for the rest of the step: the trainer's state back from host memory, the
old log-probs, the optimizer steps, the checkpoint (saved between the update and the weight sync) and the
weight sync with the state's move back to host memory. The latter is the longer, so the lead is

    state reload + update + checkpoint save + weight sync + state offload + STOP_MARGIN_S

at worst: every rollout of the batch at full length (`rollout.max_sequence_tokens`, padded as the model
computes it). The update's model FLOPs follow `flops.training_flops` (a forward pass is a third of them), at
`cluster.train_mfu` of `cluster.gpu_peak_tflops` on every GPU of the job; the save's time is
`planning.checkpoint`'s, the state moves' `planning.memory`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dapo_megatron.flops import training_flops
from dapo_megatron.models.sequence_padding import job_sequence_multiple, padded_length
from dapo_megatron.planning.checkpoint import GB, CheckpointPlan
from dapo_megatron.planning.memory import MemoryPlan, engine_weight_bytes

if TYPE_CHECKING:
    from dapo_megatron.config import JobConfig

WEIGHT_SYNC_GB_PER_S = 5.0
"""Bytes of the engine's (HF) weights a weight sync moves per second, in GB/s. Each pipeline stage's sender
gathers full tensors over TP (NVLink), relays each bucket to the engines' owner ranks (NCCL over the node
network, tens of GB/s) and every engine copies and loads it, tensor by tensor; on CPU the sync runs at about
half a memcpy (bench/RESULTS.md, 'Weight sync'). An assumption, never measured on a GPU here: a small part of
the lead next to the update and the save."""
STOP_MARGIN_S = 120.0
"""Seconds the lead keeps for what the estimate does not count: the signal's relay (job.sh -> srun -> each
launcher's stop file), aborting a generation round or an evaluation, the save's barriers, fsyncs, manifest and
pruning, the processes' exit, and Slurm's own slack (the job is killed KillWait, 30 s by default, after the
limit's SIGTERM)."""


def update_flops(job: JobConfig) -> tuple[float, float]:
    """(model FLOPs of the optimizer steps of one rollout step, of the old log-prob forward pass before
    them), every one of the train_batch_size x n_samples_per_prompt rollouts at full length. The forward pass
    runs when the batch feeds several optimizer steps and algo.old_log_prob_source=trainer
    (`trainer.actor.update_policy`)."""
    rollouts = job.trainer.train_batch_size * job.rollout.n_samples_per_prompt
    multiple = job_sequence_multiple(job.parallel, job.model.fp8)
    length = padded_length(job.rollout.max_sequence_tokens, multiple)
    train = rollouts * training_flops(job.model, [length])
    forward = job.trainer.optimizer_steps > 1 and job.algo.old_log_prob_source == "trainer"
    return train, train / 3 if forward else 0.0


@dataclass(frozen=True)
class StopLead:
    """The seconds a stop after the signal can take, at worst, by part."""

    train_flops: float
    old_log_prob_flops: float
    flops_per_s: float
    """The whole job's assumed model FLOP/s: GPUs x peak x MFU."""
    save_s: float
    sync_s: float
    state_moves_s: float
    """The trainer's state back from host memory before the update and out again during the sync (0 without
    trainer.offload_during_rollout)."""
    margin_s: float = STOP_MARGIN_S

    @property
    def update_s(self) -> float:
        return (self.train_flops + self.old_log_prob_flops) / self.flops_per_s

    @property
    def lead_s(self) -> float:
        return self.update_s + self.save_s + self.sync_s + self.state_moves_s + self.margin_s


def plan_stop_lead(job: JobConfig, memory: MemoryPlan, checkpoint: CheckpointPlan) -> StopLead:
    """The stop lead of `job` on `job.cluster`, from its memory and checkpoint plans."""
    cluster = job.cluster
    train, forward = update_flops(job)
    dtype = job.model.params_dtype if job.rollout.dtype == "auto" else job.rollout.dtype
    engine_bytes = engine_weight_bytes(job.model, engine_tp=1, dtype=dtype)
    return StopLead(
        train_flops=train,
        old_log_prob_flops=forward,
        flops_per_s=cluster.world_size * cluster.gpu_peak_tflops * 1e12 * cluster.train_mfu,
        save_s=checkpoint.save_seconds,
        sync_s=engine_bytes / (WEIGHT_SYNC_GB_PER_S * GB),
        state_moves_s=2 * memory.offload_seconds if memory.offload else 0.0,
    )
