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
    """Shard activations outside the matmuls over the TP group along the sequence (needs TP > 1; every
    micro-batch is right-padded to a multiple of TP, see `models/sequence_padding.py`)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer states (and fp32 main params) over the data-parallel group (ZeRO-1)."""
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    recompute_granularity: str = "none"
    """Activation recompute: `none`, or `full` (keep only each recompute unit's input; rerun its forward
    in backward). Trades about one extra forward pass for most of the activation memory."""
    recompute_method: str = "uniform"
    """With `full`: `uniform` checkpoints every chunk of `recompute_num_layers` layers of a pipeline stage;
    `block` recomputes only the first `recompute_num_layers` layers of each stage (the rest keep
    everything)."""
    recompute_num_layers: int = 1
    """Layers per recompute unit (`uniform`; must divide a stage's layers) or recomputed layers per stage
    (`block`)."""
    backend: str = "auto"
    """Process-group backend: `auto` (nccl for CUDA tensors plus gloo for host tensors with CUDA, else gloo),
    `nccl` or `gloo`."""
    timeout_minutes: int = 30
    """Collective timeout beyond the longest wait the recipe allows: the trainer adds the bound on a rollout
    step and an evaluation, which the ranks that do not drive the rollout spend in a collective
    (`distributed/timeout.collective_timeout`). A hung rank fails the job after it instead of hanging
    forever."""

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "timeout_minutes",
            "recompute_num_layers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1; got {getattr(self, name)}.")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"parallel.backend must be auto, nccl or gloo; got {self.backend!r}.")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1; "
                "set parallel.sequence_parallel=false."
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "parallel.overlap_param_gather=true needs parallel.use_distributed_optimizer=true."
            )
        if self.recompute_granularity not in ("none", "full"):
            raise ValueError(
                f"parallel.recompute_granularity must be none or full; got {self.recompute_granularity!r}."
            )
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(
                f"parallel.recompute_method must be uniform or block; got {self.recompute_method!r}."
            )

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def recompute_kwargs(self) -> dict[str, str | int]:
        """megatron-core `TransformerConfig` fields for activation recompute (none when it is off)."""
        if self.recompute_granularity == "none":
            return {}
        return {
            "recompute_granularity": self.recompute_granularity,
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
        }


@dataclass
class ClusterConfig:
    """The hardware a recipe is planned for. The memory planner and the dry run read it; a real launch
    takes its world size from torchrun/srun instead (run the dry run with the same overrides first)."""

    nodes: int = 1
    gpus_per_node: int = 1
    gpu_memory_gib: float = 80.0
    """Memory of one GPU (H100 SXM: 80)."""
    reserved_gib: float = 4.0
    """Per-GPU memory the planner sets aside for the trainer's and the engine's CUDA contexts (about 0.5 GiB
    each), NCCL communicator buffers and allocator fragmentation: an estimate; replace it with what
    `nvidia-smi` shows beyond torch.cuda.memory_reserved() on your cluster."""
    cuda_context_gib: float = 0.5
    """GPU memory one more process's CUDA context takes on a GPU: the planner counts one for each engine TP
    worker that opens a weight bucket on another rank's GPU (`planning.memory.foreign_cuda_contexts`).
    ~0.5 GiB is the usual size of a CUDA 12 context with cuBLAS and NCCL loaded on an H100; replace it with
    what `nvidia-smi` shows per extra process on your GPUs."""
    storage_write_gb_per_s: float = 2.0
    """Write bandwidth from one node to the checkpoint filesystem, in GB/s, all its ranks writing at once.
    2 GB/s is the modest end of a shared parallel filesystem's per-client rate (a Lustre or GPFS client on
    a 200-400 Gb/s storage link writes several GB/s when it is not shared), and roughly what a 16-node job
    gets of a filesystem that sustains ~32 GB/s in all: an assumption, never measured here; set the
    cluster's own figure (the checkpoint save time and the time-limit lead scale with it)."""
    storage_read_gb_per_s: float = 4.0
    """Read bandwidth from the checkpoint filesystem to one node, in GB/s (reads are typically about twice
    as fast as writes on parallel filesystems): an assumption like storage_write_gb_per_s."""
    train_mfu: float = 0.25
    """Model FLOPs utilisation the planner assumes for the policy update (the `perf/mfu/actor` the trainer
    logs and tools/gpu_check.py measures: model FLOPs over the GPUs' dense peak, recompute not credited). A
    quarter of the peak is below what Megatron-LM reaches on dense GPT pretraining at this scale: variable-
    length packed rows, full recompute and TP 8 communication lower it, and the time-limit lead must not fall
    short, so the assumption errs low. Replace it with the job's measured perf/mfu/actor."""
    gpu_peak_tflops: float = 989.0
    """Dense bf16 tensor-core peak of one GPU in TFLOP/s (H100 SXM: 989; `flops.PEAK_TFLOPS` lists others)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be >= 1; got {getattr(self, name)}.")
        if self.gpu_memory_gib <= 0:
            raise ValueError(f"cluster.gpu_memory_gib must be > 0; got {self.gpu_memory_gib}.")
        if not 0 <= self.reserved_gib < self.gpu_memory_gib:
            raise ValueError(
                f"cluster.reserved_gib must be in [0, cluster.gpu_memory_gib); got {self.reserved_gib}."
            )
        if not 0 <= self.cuda_context_gib < self.gpu_memory_gib:
            raise ValueError(
                "cluster.cuda_context_gib must be in [0, cluster.gpu_memory_gib); "
                f"got {self.cuda_context_gib}."
            )
        for name in ("storage_write_gb_per_s", "storage_read_gb_per_s", "gpu_peak_tflops"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cluster.{name} must be > 0; got {getattr(self, name)}.")
        if not 0 < self.train_mfu <= 1:
            raise ValueError(f"cluster.train_mfu must be in (0, 1]; got {self.train_mfu}.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node
