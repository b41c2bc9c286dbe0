"""The CPU backend: SGLang's native-torch backends behind import-time stand-ins (`backends/sglang_cpu.py`),
weights through shared memory, megatron-core with its CUDA-only calls adapted (`backends/cpu_compat.py`).

Torch-free at import (`backends/base.py`): the engine starts before the trainer imports torch.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

from dapo_megatron.backends.base import Backend, EngineArgs
from dapo_megatron.backends.cpu_weight_loader import LOAD_FORMAT, named_views

if TYPE_CHECKING:
    import torch

SGLANG_CPU = "dapo_megatron.backends.sglang_cpu"
"""The CPU engine's entry point, named rather than imported: it installs its stand-ins at import."""

CPU_ENGINE_THREADS = 1
"""A CPU engine's intra-op threads unless the user set OMP_NUM_THREADS: beside an update more would compete
with the trainer (trainer/cpu_threads.py leaves the engine this many cores, and gives it the rank's share
while the trainer only waits for it)."""


class CpuBackend(Backend):
    name = "cpu"
    engine_before_policy = True  # SGLang's start-up (~6.5 s of one core, mostly imports) beside torch's
    engine_memory_moves = False  # SGLang accepts a release on CPU and keeps its memory anyway
    # A CPU engine holds nothing its graceful shutdown would release (no device memory): a kill stops it in
    # well under a second instead of 5-8 (bench/RESULTS.md, 'Engine stop').
    engine_stop_by_kill = True
    engine_follows_thread_count = True
    engine_relays_weights = True  # shared memory reaches every process of a node
    reuses_bucket_buffer = True
    runs_transformer_engine = False
    init_on_host = True
    process_group_backend = "gloo"

    def check_engine(self, args: EngineArgs, kv_shortfall: str | None) -> None:
        if args.tp_size != 1:
            # SGLang's CPU tensor parallelism needs the sgl_kernel CPU build, which the stand-ins replace.
            raise ValueError(f"rollout.engine_tp_size must be 1 on CPU; got {args.tp_size}")
        if args.quantization:
            raise ValueError(
                f"rollout.quantization={args.quantization} needs a CUDA GPU; set rollout.quantization=null "
                "on CPU"
            )
        if args.deterministic:
            raise ValueError(
                "rollout.deterministic=true needs a CUDA GPU: SGLang's deterministic inference runs on "
                "batch-invariant GPU attention kernels and refuses the CPU engine's torch_native "
                "attention, and without it SGLang ignores per-request sampling seeds; set "
                "rollout.deterministic=false on CPU"
            )
        if kv_shortfall is not None:
            warnings.warn(kv_shortfall, stacklevel=3)  # on GPUs the memory fraction sizes the cache

    def engine_command(self, args: EngineArgs) -> list[str]:
        return [
            sys.executable,
            "-m",
            SGLANG_CPU,
            *self.server_flags(args),
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            "--dtype",
            "float32" if args.dtype == "auto" else args.dtype,
            # On CPU the KV cache is sized by max_total_tokens; the fraction only has to let it fit.
            # SGLang checks it as "host memory that vanished while the weights loaded < fraction x free
            # memory before", so whatever a neighbour (another engine starting, a trainer building its
            # model) allocates meanwhile counts as weights, and a small fraction (0.05 of 20 GB free)
            # refuses to start beside a neighbour's ~1 GB. Half tolerates any neighbour that leaves room
            # to run.
            "--mem-fraction-static",
            "0.5",
            "--max-total-tokens",
            str(args.max_total_tokens),
            "--disable-cuda-graph",
            "--skip-server-warmup",
            # Idle, the scheduler otherwise spins a whole core while the trainer computes on the same
            # cores, and a trainer on more than one thread slows down beside it (see bench/RESULTS.md, 'CPU
            # idle cores'). It polls its sockets instead, so a request still wakes it at once.
            "--sleep-on-idle",
            "--custom-weight-loader",
            LOAD_FORMAT,
            *args.extra_args,
        ]

    def engine_environment(self, env: MutableMapping[str, str]) -> None:
        env.setdefault("OMP_NUM_THREADS", str(CPU_ENGINE_THREADS))

    def check_transformer_engine(self) -> None:
        raise RuntimeError(
            "model.transformer_impl=transformer_engine needs a CUDA GPU; this machine has none. "
            "Use model.transformer_impl=local (or auto) on CPU."
        )

    def start(self, local_rank: int) -> torch.device:
        import torch

        from dapo_megatron.backends.cpu_compat import apply

        apply()
        return torch.device("cpu")

    def share_with_engines(self, parameters: list[torch.Tensor]) -> None:
        import torch

        # The default strategy passes file descriptors, which only processes sharing our multiprocessing
        # authkey can receive; SGLang's scheduler fails to unpickle them and crashes.
        torch.multiprocessing.set_sharing_strategy("file_system")
        # Parameters in shared memory reach a same-node engine with no copy on our side: every tensor the HF
        # mapping yields as a view of one (all but the split q/k/v) is pickled where it lies, and only the
        # rest goes through the staging buffer, which saves a copy of most of the bytes (see
        # bench/RESULTS.md, 'Weight sync'). `share_memory_` moves a storage once and in place, so views
        # (DDP's buffers) follow.
        for param in parameters:
            if not param.untyped_storage().is_shared():
                param.data.share_memory_()

    def engine_opens_in_place(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.untyped_storage().is_shared()

    def bucket_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Allocated directly in shared memory (`share_memory_()` on a fresh tensor would allocate it twice
        and copy it, several times the cost of copying into a buffer reused across syncs)."""
        import torch

        return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))

    def engine_payload(self, payload: Any) -> tuple[Any, str | None]:
        # Named views of the staging buffer instead of SGLang's flattened format, so that every tensor of a
        # sync goes through the engine's loader that keeps shared memory mapped between syncs.
        named = named_views(payload) if isinstance(payload, dict) else payload
        return named, LOAD_FORMAT
