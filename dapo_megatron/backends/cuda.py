"""The CUDA backend: `sglang.launch_server` colocated with the trainer's GPUs, its memory released while the
policy updates (`--enable-memory-saver`), weights through CUDA IPC handles, NCCL beside gloo.

Nothing here runs on the CPU CI machine but the command line, the checks and the placement rules; what only a
GPU shows is listed in README's GPU-only table (`tools/gpu_check.py` runs it).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from dapo_megatron.backends.base import Backend, EngineArgs

if TYPE_CHECKING:
    import torch


class CudaBackend(Backend):
    name = "cuda"
    # An engine sizes its KV cache from the memory left free, which must already exclude the policy's.
    engine_before_policy = False
    engine_memory_moves = True
    # SGLang's launcher shuts down gracefully on SIGTERM (its watchdog notices within 5 s) and stops its
    # children, whereas a scheduler signalled directly makes it wait seconds for crash diagnostics.
    engine_stop_by_kill = False
    engine_follows_thread_count = False
    engine_relays_weights = False  # a GPU buffer is best opened by the engine's own GPU
    # The engine's copy out of an IPC handle is not synchronised with our next write into it.
    reuses_bucket_buffer = False
    runs_transformer_engine = True
    init_on_host = False
    # NCCL for CUDA tensors, gloo for the host-side values the driver all-reduces (stop flags, loss
    # reports), which NCCL alone would reject.
    process_group_backend = "cpu:gloo,cuda:nccl"

    def engine_count(self, world_size: int, engine_tp_size: int) -> int:
        return world_size // engine_tp_size  # one per TP group, colocated with the trainer's ranks

    def check_engine_block(self, ranks_per_engine: int, engine_tp_size: int, engines: int) -> None:
        if ranks_per_engine % engine_tp_size:
            world_size = ranks_per_engine * engines
            raise ValueError(
                f"{engines} engine(s) over {world_size} GPUs leave {ranks_per_engine} GPU(s) per engine, not "
                f"a multiple of rollout.engine_tp_size={engine_tp_size}; lower rollout.num_engines to a "
                f"divisor of {world_size // engine_tp_size} (0 = one per TP group)"
            )

    def node_engine_gpus(self, gpus: int, engine_tp_size: int, num_engines: int) -> list[int]:
        """`num_engines` engines (0 = as many as fit) of `engine_tp_size` GPUs each, side by side.

        Raises ValueError naming the field when they do not fit the node."""
        tp = engine_tp_size
        if gpus < tp:
            raise ValueError(
                f"rollout.engine_tp_size={tp} needs {tp} GPUs per engine but this node has {gpus}; "
                f"lower rollout.engine_tp_size to at most {gpus} (the model must still fit)"
            )
        fit = gpus // tp
        count = num_engines or fit
        if count > fit:
            raise ValueError(
                f"rollout.num_engines={count} engines of rollout.engine_tp_size={tp} GPUs need {count * tp} "
                f"GPUs but this node has {gpus}; set rollout.num_engines to at most {fit} "
                "(0 = as many as fit)"
            )
        return [engine * tp for engine in range(count)]

    def check_overlap(self, overlap_rollout: bool) -> None:
        if overlap_rollout:
            raise ValueError(
                "trainer.overlap_rollout=true generates while the policy trains, but a colocated GPU "
                "engine hands its memory to the trainer during the update; set trainer.overlap_rollout=false"
            )

    def check_engine(self, args: EngineArgs, kv_shortfall: str | None) -> None:
        """Nothing refused: the memory fraction sizes the KV cache, so `kv_shortfall` does not apply."""

    def engine_command(self, args: EngineArgs) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            *self.server_flags(args),
            "--dtype",
            args.dtype,
            "--tp-size",
            str(args.tp_size),
            "--base-gpu-id",
            str(args.base_gpu_id),
            "--mem-fraction-static",
            str(args.mem_fraction_static),
            "--enable-memory-saver",
            *(["--enable-deterministic-inference"] if args.deterministic else []),
            *(["--quantization", args.quantization] if args.quantization else []),
            *args.extra_args,
        ]

    def start(self, local_rank: int) -> torch.device:
        import torch

        # Megatron's TP communication overlap relies on one hardware queue ordering kernels; set before CUDA
        # initialises (srun/torchrun users need not remember it).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    def pin_host_memory(self) -> bool:
        return True

    def synchronize(self, device: torch.device) -> None:
        import torch

        torch.cuda.synchronize(device)

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def rng_state(self) -> Any:
        import torch

        return torch.cuda.get_rng_state_all()

    def set_rng_state(self, state: Any) -> None:
        import torch

        torch.cuda.set_rng_state_all(state)

    def peak_memory_gib(self) -> float | None:
        import torch

        return torch.cuda.max_memory_allocated() / 2**30

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count()

    def device_name(self) -> str | None:
        import torch

        return torch.cuda.get_device_name()

    def device_capability(self) -> tuple[int, int] | None:
        import torch

        return torch.cuda.get_device_capability()

    def bucket_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=device)
