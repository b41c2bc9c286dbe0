"""What differs between a job on CPU and a job on CUDA GPUs, owned by one object per device.

Engine, weight sync, model and trainer code ask the backend (`backends.detect()` for this machine's,
`backends.of(device)` for a tensor's) instead of testing the device: how an SGLang server is started and in
which order beside the policy, what the device refuses, how weights reach an engine, how the trainer's state
moves to host memory, where the process groups and the model live.

No backend module imports torch at import time: a CPU trainer launches its engine before torch loads, and
the memory planner (`dapo-plan-memory`) plans a GPU cluster without it; the methods that need torch import
it when called.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EngineArgs:
    """What an SGLang server's command line is made of (`rollout/engine.py` fills it from the rollout
    settings)."""

    model_path: str
    host: str
    port: int
    seed: int | None
    dtype: str
    """`auto`: the model's own."""
    tp_size: int
    base_gpu_id: int
    mem_fraction_static: float
    max_total_tokens: int
    quantization: str | None
    deterministic: bool
    extra_args: tuple[str, ...] = ()
    """Further `sglang.launch_server` flags, appended verbatim."""


class Backend:
    """One device's answers. Subclasses: `CpuBackend`, `CudaBackend`."""

    name: ClassVar[str]
    """`cpu` or `cuda`: the torch device type."""
    engine_before_policy: ClassVar[bool]
    """Whether a rank launches its engine before it builds its policy (and, on CPU, before it imports
    torch), so that the engine's start-up overlaps with the trainer's."""
    engine_memory_moves: ClassVar[bool]
    """Whether an engine gives its memory back while the policy updates and takes it back for the next
    rollout; the ranks then meet at barriers so no engine takes memory a peer still holds."""
    engine_stop_by_kill: ClassVar[bool]
    """Whether an engine is SIGKILLed at shutdown instead of stopped gracefully."""
    engine_follows_thread_count: ClassVar[bool]
    """Whether a launched engine follows a thread count the trainer sets (`backends/engine_threads.py`)."""
    engine_relays_weights: ClassVar[bool]
    """Whether a bucket reaches every engine on the sender's node where it lies (shared memory), so that no
    engine there needs its weights relayed through its own rank."""
    reuses_bucket_buffer: ClassVar[bool]
    """Whether one bucket buffer serves every bucket of every sync: the engine has copied a bucket out by the
    time its request returns."""
    runs_transformer_engine: ClassVar[bool]
    """Whether Transformer Engine's layers run here (`model.transformer_impl=auto` picks them where so)."""
    init_on_host: ClassVar[bool]
    """Whether megatron-core initialises the weights in host memory (`use_cpu_initialization`)."""
    process_group_backend: ClassVar[str]
    """torch.distributed's backend for `parallel.backend=auto`."""

    # ------------------------------------------------------------------ engines

    def engine_count(self, world_size: int, engine_tp_size: int) -> int:
        """Engines a job runs when `rollout.num_engines` leaves it automatic."""
        return 1

    def check_engine_block(self, ranks_per_engine: int, engine_tp_size: int, engines: int) -> None:
        """Raise ValueError naming the field when an engine's block of ranks cannot hold its TP group."""

    def node_engine_gpus(self, gpus: int, engine_tp_size: int, num_engines: int) -> list[int]:
        """The first device of each engine one process starts on a node with `gpus` GPUs (`dapo-eval`):
        one engine here."""
        return [0]

    def check_overlap(self, overlap_rollout: bool) -> None:
        """Raise ValueError naming the field when generating beside the update is impossible here."""

    def check_engine(self, args: EngineArgs, kv_shortfall: str | None) -> None:
        """Raise ValueError naming the setting this device cannot serve (`kv_shortfall`: why the KV cache
        may be too small for one batch, from `RolloutConfig.kv_shortfall`)."""
        raise NotImplementedError

    def engine_command(self, args: EngineArgs) -> list[str]:
        """The server's command line, `python -m MODULE ARGS`."""
        raise NotImplementedError

    @staticmethod
    def server_flags(args: EngineArgs) -> list[str]:
        """The flags every device's server takes: where the model is, where to listen, the sampler's seed."""
        return [
            "--model-path",
            args.model_path,
            "--host",
            args.host,
            "--port",
            str(args.port),
            *(["--random-seed", str(args.seed)] if args.seed is not None else []),
        ]

    def engine_environment(self, env: MutableMapping[str, str]) -> None:
        """Complete an engine's environment (built by `rollout/engine.py`) with this device's settings."""

    # ------------------------------------------------------------------ the trainer's device

    def check_transformer_engine(self) -> None:
        """Raise RuntimeError naming the fix when `model.transformer_impl=transformer_engine` cannot run."""

    def start(self, local_rank: int) -> torch.device:
        """Make this process's device current, before the process groups start; returns it."""
        raise NotImplementedError

    def pin_host_memory(self) -> bool:
        """Whether host buffers the device copies into and out of are pinned."""
        return False

    def synchronize(self, device: torch.device) -> None:
        """Wait for the device's queued copies (nothing to wait for on CPU)."""

    def empty_cache(self) -> None:
        """Hand the allocator's cached blocks back to the driver, where an engine can map them."""

    def rng_state(self) -> Any:
        """The device's random generators' state (None: it has none of its own)."""
        return None

    def set_rng_state(self, state: Any) -> None:
        """Restore `rng_state()`'s result."""

    def peak_memory_gib(self) -> float | None:
        """This process's peak of allocated device memory so far (None: the device does not count it)."""
        return None

    def device_count(self) -> int:
        """Accelerators this process sees (0 on CPU)."""
        return 0

    def device_name(self) -> str | None:
        """The accelerator's product name (`flops.peak_tflops` knows its peak); None on CPU."""
        return None

    def device_capability(self) -> tuple[int, int] | None:
        """The accelerator's compute capability (FP8 needs 8.9 or later); None on CPU."""
        return None

    # ------------------------------------------------------------------ weights into the engines

    def share_with_engines(self, parameters: list[torch.Tensor]) -> None:
        """Prepare the policy's parameters so an engine can open them (once per sync)."""

    def engine_opens_in_place(self, tensor: torch.Tensor) -> bool:
        """Whether the engine opens `tensor` where it lies, with no copy into a bucket."""
        return False

    def bucket_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """uint8 [nbytes]: a fresh buffer a bucket is flattened into, one the engine can open."""
        raise NotImplementedError

    def engine_payload(self, payload: Any) -> tuple[Any, str | None]:
        """A push (a flattened bucket, or named tensors) as this device's engine loads it, with the load
        format to ask for (None: SGLang's own)."""
        return payload, None
