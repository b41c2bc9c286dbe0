"""How the policy is split across processes: tensor, pipeline and data parallelism."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Ranks that split every layer's matmuls (keep within one node's NVLink domain)."""
    pipeline_model_parallel_size: int = 1
    """Stages the layers are split into; layers must divide evenly."""
    sequence_parallel: bool = False
    """Shard activations outside the matmuls over the TP group (needs TP > 1 and Transformer Engine)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer states (and fp32 main params) over the data-parallel group (ZeRO-1)."""
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    backend: str = "auto"
    """Process-group backend: `auto` (nccl with CUDA, else gloo), `nccl` or `gloo`."""
    timeout_minutes: int = 30
    """Collective timeout; a hung rank fails the job after this instead of hanging forever."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "timeout_minutes"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1; got {getattr(self, name)}.")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"parallel.backend must be auto, nccl or gloo; got {self.backend!r}.")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1; "
                             "set parallel.sequence_parallel=false.")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("parallel.overlap_param_gather=true needs parallel.use_distributed_optimizer=true.")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size
