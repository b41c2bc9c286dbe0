"""The one object that describes how this job is split: built once, asked questions everywhere else.

`initialize(parallel, seed)` starts torch.distributed (gloo on CPU, NCCL on GPU) from torchrun or
Slurm variables, sets up megatron-core's parallel state, seeds the RNGs, and returns a frozen
`ParallelLayout`. The rest of the code never calls `megatron.core.parallel_state` getters itself.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from megatron.core import parallel_state, tensor_parallel

from dapo_megatron import backends
from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.distributed.launch import ProcessEnv, process_env

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    rank: int
    local_rank: int
    node: int
    """Which node this rank runs on (0 .. nodes - 1)."""
    master_addr: str
    """Where rank 0 serves the rendezvous: engines of a multi-node job listen on the address towards it."""
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    pp_last_rank: int
    """Global rank of the last stage of this rank's pipeline (where logits and losses live)."""
    device: torch.device
    backend: str

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_logging_rank(self) -> bool:
        """Global rank 0 prints, writes TensorBoard and drives rollouts."""
        return self.rank == 0

    @property
    def is_loss_rank(self) -> bool:
        """The rank whose micro-batch losses represent its model replica (last stage, TP rank 0)."""
        return self.is_last_stage and self.tp_rank == 0

    @cached_property
    def tp_group(self) -> ProcessGroup:
        return parallel_state.get_tensor_model_parallel_group()

    @cached_property
    def pp_group(self) -> ProcessGroup:
        return parallel_state.get_pipeline_model_parallel_group()

    @cached_property
    def dp_group(self) -> ProcessGroup:
        return parallel_state.get_data_parallel_group()

    def describe(self) -> str:
        return (
            f"world {self.world_size} = dp {self.dp_size} x tp {self.tp_size} x pp {self.pp_size} "
            f"({self.backend} on {self.device.type})"
        )

    @classmethod
    def from_parallel_state(cls, env: ProcessEnv, device: torch.device, backend: str) -> ParallelLayout:
        return cls(
            world_size=env.world_size,
            rank=env.rank,
            local_rank=env.local_rank,
            node=env.node,
            master_addr=env.master_addr,
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
            dp_size=parallel_state.get_data_parallel_world_size(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            dp_rank=parallel_state.get_data_parallel_rank(),
            pp_last_rank=parallel_state.get_pipeline_model_parallel_last_rank(),
            device=device,
            backend=backend,
        )


def initialize(
    parallel: ParallelConfig, seed: int, timeout: datetime.timedelta | None = None
) -> ParallelLayout:
    """Start torch.distributed and megatron-core's model-parallel groups for this process.

    Call once per process, after `dapo_megatron.config.validate` accepted the layout for this world size.
    `timeout`: of every collective; default `parallel.timeout_minutes`. A trainer whose ranks wait in a
    collective while one of them generates passes `trainer.timeout.collective_timeout(job, world_size)`.
    """
    env = process_env()
    device_backend = backends.detect()
    backend = parallel.backend if parallel.backend != "auto" else device_backend.process_group_backend
    device = device_backend.start(env.local_rank)

    if not torch.distributed.is_initialized():
        # Slurm's srun sets no MASTER_* for torch's env:// rendezvous; pass them explicitly.
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        torch.distributed.init_process_group(
            backend=backend,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout or datetime.timedelta(minutes=parallel.timeout_minutes),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        )
    # Same seed on every rank; megatron derives distinct per-TP-rank streams for dropout and init.
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelLayout.from_parallel_state(env, device, backend)


def shutdown() -> None:
    """Tear down megatron-core's groups and the default process group (safe to call twice)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
