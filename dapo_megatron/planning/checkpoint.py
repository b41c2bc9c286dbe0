"""A training checkpoint of a job, from its config alone (no torch): its bytes, who writes them, the host
memory a save and a load hold, and how long they take.

What a training checkpoint stores (`checkpoint.py`, `trainer/optimizer.py`): every parameter once, by its
global shape in the parameter dtype (vocab padding included; a tensor replicated over TP, such as a norm, and
the second stage's copy of a tied embedding, once), and for every trained element the optimizer's fp32
tensors: its moments (Adam: two), plus the fp32 main parameter of a 16-bit parameter, or of every parameter
with the distributed optimizer (which stores it under its own key even where it is the fp32 parameter itself).
RNG states, the step, the manifest and the metadata are kilobytes and left out.

Who writes what: the save is fully parallel over the data-parallel group. A tensor every DP replica holds (the
weights; a non-distributed optimizer's state) is written by one replica, megatron-core balancing them by size
(`FullyParallelSaveStrategyWrapper`, greedy, so about 1/DP of them each); the distributed optimizer's shard of
a rank by that rank; a tensor replicated over TP by TP rank 0. A load spreads its reads over the DP group the
same way and sends each tensor to the ranks that need it, so a resume reads the checkpoint about once.

Host memory: torch_dist's writer copies every tensor a rank writes to host memory before writing any
(megatron-core's `FileSystemWriterAsync.preload_tensors`), so a save holds the bytes its rank writes. A load
reads one stored chunk at a time into host memory (torch.distributed.checkpoint's FileSystemReader loads a
whole stored chunk, then copies the part the rank needs into its tensor), so it holds about the largest one.

Time: every node writes its ranks' shares at `cluster.storage_write_gb_per_s` and reads them back at
`cluster.storage_read_gb_per_s` (assumptions, documented there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.planning.memory import (
    DTYPE_BYTES,
    FP32,
    OPTIMIZER_MOMENTS,
    ParamSpec,
    buffer_orders,
    data_parallel_size,
    ddp_bucket_size,
    grad_buffers,
    stage_parameters,
)

if TYPE_CHECKING:
    from dapo_megatron.config import JobConfig

GB = 10**9


def optimizer_bytes_per_element(dtype: str, *, distributed: bool, optimizer: str = "adam") -> int:
    """Checkpoint bytes of the optimizer state of one trained element of a `dtype` parameter: the fp32
    moments, plus the fp32 main parameter where one is stored."""
    main = distributed or DTYPE_BYTES[dtype] < FP32
    return FP32 * (OPTIMIZER_MOMENTS[optimizer] + main)


@dataclass(frozen=True)
class StageCheckpoint:
    """What the checkpoint stores of one pipeline stage, and what each of its ranks with TP rank 0 (the
    busiest: they also write the TP-replicated tensors) writes."""

    weights: int
    """Bytes of the stage's weights, each tensor once (all TP shards)."""
    optimizer: int
    """Bytes of the stage's optimizer state, each element once."""
    written: tuple[int, ...]
    """written[d]: bytes DP rank d (TP rank 0) writes."""
    largest_chunk: int
    """Bytes of the largest chunk the stage stores: a TP shard of a weight, or one optimizer tensor of a
    rank's shard of a parameter."""


def stage_checkpoint(
    model: ModelConfig, parallel: ParallelConfig, *, dp: int, pp_rank: int, optimizer: str = "adam"
) -> StageCheckpoint:
    """Checkpoint bytes of pipeline stage `pp_rank`, and the bytes each of its DP ranks writes in a fully
    parallel save (the weights and a non-distributed optimizer's state split evenly over the DP ranks, as
    megatron-core's greedy balancing about does; each rank's own shard of a distributed optimizer)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    distributed = parallel.use_distributed_optimizer
    params = stage_parameters(model, tp=tp, pp=pp, pp_rank=pp_rank)

    def stored(param: ParamSpec) -> bool:
        # The last stage's copy of an embedding tied across stages is a replica of the first stage's.
        return not (param.shared_embedding and pp_rank == pp - 1)

    def per_element(param: ParamSpec) -> int:
        return optimizer_bytes_per_element(param.dtype, distributed=distributed, optimizer=optimizer)

    weights = optimizer_bytes = replicated = 0
    largest = 0
    for param in filter(stored, params):
        copies = 1 if param.tp_replicated else tp
        weights += copies * param.numel * DTYPE_BYTES[param.dtype]
        optimizer_bytes += copies * param.numel * per_element(param)
        replicated += param.numel * (DTYPE_BYTES[param.dtype] + (0 if distributed else per_element(param)))
        largest = max(largest, param.numel * (DTYPE_BYTES[param.dtype] if distributed else FP32))
    own = [0] * dp
    if distributed:
        bucket_size = ddp_bucket_size(parallel, dp, pp_rank)
        buffers = grad_buffers(params, dp=dp, distributed_optimizer=True, bucket_size=bucket_size)
        for buffer, ordered in zip(buffers, buffer_orders(params), strict=True):
            for rank in range(dp):
                for param, owned in zip(ordered, buffer.owned[rank], strict=True):
                    if stored(param):
                        own[rank] += owned * per_element(param)
                        largest = max(largest, owned * FP32)
    return StageCheckpoint(
        weights=weights,
        optimizer=optimizer_bytes,
        written=tuple(-(-replicated // dp) + own[rank] for rank in range(dp)),
        largest_chunk=largest,
    )


@dataclass(frozen=True)
class CheckpointPlan:
    """A training checkpoint of the job, with the bandwidths it was timed at."""

    weights: int
    optimizer: int
    written_per_rank: int
    """Bytes the busiest rank writes (and, torch_dist staging them, holds in host memory while saving)."""
    written_per_node: int
    """Bytes a node writes at most: gpus_per_node ranks writing the busiest rank's share each."""
    load_host_bytes: int
    """Host memory a rank holds while loading: about the largest stored chunk."""
    write_gb_per_s: float
    read_gb_per_s: float

    @property
    def total(self) -> int:
        return self.weights + self.optimizer

    @property
    def save_host_bytes(self) -> int:
        return self.written_per_rank

    @property
    def resume_read_bytes(self) -> int:
        """Bytes a resume in the same layout reads, all ranks together: every stored chunk once."""
        return self.total

    @property
    def save_seconds(self) -> float:
        return self.written_per_node / (self.write_gb_per_s * GB)

    @property
    def load_seconds(self) -> float:
        """Each node reads back about what it wrote."""
        return self.written_per_node / (self.read_gb_per_s * GB)


def plan_checkpoint(job: JobConfig) -> CheckpointPlan:
    """The checkpoint of `job` on `job.cluster` (validate the config first)."""
    dp = data_parallel_size(job)
    stages = [
        stage_checkpoint(job.model, job.parallel, dp=dp, pp_rank=pp_rank, optimizer=job.optim.optimizer)
        for pp_rank in range(job.parallel.pipeline_model_parallel_size)
    ]
    per_rank = max(max(stage.written) for stage in stages)
    return CheckpointPlan(
        weights=sum(stage.weights for stage in stages),
        optimizer=sum(stage.optimizer for stage in stages),
        written_per_rank=per_rank,
        written_per_node=per_rank * job.cluster.gpus_per_node,
        load_host_bytes=max(stage.largest_chunk for stage in stages),
        write_gb_per_s=job.cluster.storage_write_gb_per_s,
        read_gb_per_s=job.cluster.storage_read_gb_per_s,
    )
