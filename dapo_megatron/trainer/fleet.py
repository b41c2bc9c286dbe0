"""The job's SGLang engines as the trainer runs them: placement, launch, liveness, memory, weight sync.

Life cycle, in the order `trainer/setup.py` calls it: `launch` (this rank's engine, if it launches one; the
only place a training job starts an engine) -> `connect` (collective: every engine ready, their records
exchanged) -> `open_sync` (collective: the weight sync and its probe batch) -> per step `release_memory`
and `sync_weights` (with the probe's check when due) -> `close_sync` -> `shutdown`. `train.py` makes the fleet
and, on CPU, launches its engine before it imports torch, so torch is imported only by the methods that use
the process groups.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from dapo_megatron.backends.base import Backend
from dapo_megatron.config import JobConfig
from dapo_megatron.rollout import engine_auth
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engine import SGLangEngine, address_towards
from dapo_megatron.rollout.engine_record import EngineRecord, liveness_check, raise_if_any_died
from dapo_megatron.trainer.placement import engine_placement

if TYPE_CHECKING:
    import torch

    from dapo_megatron.distributed.launch import ProcessEnv
    from dapo_megatron.distributed.layout import ParallelLayout
    from dapo_megatron.rollout.client import RolloutClient
    from dapo_megatron.rollout.weight_sync import WeightSync
    from dapo_megatron.trainer.actor import Actor
    from dapo_megatron.trainer.sync_probe import SyncProbe


def job_on_one_node(world_size: int, environ: Mapping[str, str] | None = None) -> bool:
    """Whether all of the job's processes run on this node, from the launcher's variables (torchrun's
    LOCAL_WORLD_SIZE, Slurm's SLURM_JOB_NUM_NODES; a process without a launcher is alone)."""
    env = os.environ if environ is None else environ
    if "LOCAL_WORLD_SIZE" in env:
        return int(env["LOCAL_WORLD_SIZE"]) == world_size
    if "SLURM_JOB_NUM_NODES" in env:
        return int(env["SLURM_JOB_NUM_NODES"]) == 1
    return world_size == 1


def engine_host(world_size: int, master_addr: str, environ: Mapping[str, str] | None = None) -> str:
    """Where an engine listens: loopback when every process that talks to it (the driving rank, the weight
    senders, its own rank) is on its node, else this node's address towards the rendezvous host, where the
    driving rank can reach it. Either way only holders of its API key get an answer."""
    return "127.0.0.1" if job_on_one_node(world_size, environ) else address_towards(master_addr)


def rollout_config(job: JobConfig) -> RolloutConfig:
    """The rollout settings with the engine dtype (`auto` = the policy's), the seed (None = the job's) and the
    request timeout (None = derived from the response budget) resolved."""
    rollout = job.rollout
    return dataclasses.replace(
        rollout,
        dtype=job.model.params_dtype if rollout.dtype == "auto" else rollout.dtype,
        seed=job.seed if rollout.seed is None else rollout.seed,
        request_timeout_s=rollout.resolved_request_timeout_s,
    )


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """One `EngineFleet.sync_weights`."""

    seconds: float
    """The sync, the check included and the trainer state's offload not."""
    offload_seconds: float
    probe_gap: float | None
    """The largest difference between an engine's and the trainer's log-probs on the probe batch, when it was
    checked (0.0 off the driving rank); None when no check was due."""


class EngineFleet:
    """This rank's view of the job's engines: the one it launched, if any, and the records of all of them.

    Args:
        rank, world_size, local_rank, master_addr: this process's place (`distributed/launch.ProcessEnv`); no
            process group is needed until `connect`.
        backend: the device's (`backends/`): how engines start and step aside beside the policy.
    Raises ValueError naming the field when the engines cannot be placed (`trainer/placement.py`).
    """

    def __init__(
        self,
        job: JobConfig,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        master_addr: str,
        backend: Backend,
    ) -> None:
        self.job, self.backend = job, backend
        self.rank, self.local_rank, self.master_addr = rank, local_rank, master_addr
        self.world_size = world_size
        self.placement = engine_placement(world_size, job.rollout, backend)
        backend.check_overlap(job.trainer.overlap_rollout)
        self.engine: SGLangEngine | None = None
        """The engine this rank launched."""
        self.records: list[EngineRecord] = []
        """Every engine of the job, in engine order (after `connect`)."""
        self.watched: list[SGLangEngine | EngineRecord] = []
        self.sync: WeightSync | None = None
        self.probe: SyncProbe | None = None
        self._released = False
        self._last_check = -1

    @classmethod
    def of_process(cls, job: JobConfig, env: ProcessEnv | ParallelLayout, backend: Backend) -> EngineFleet:
        """The fleet as this process (`env`: its place) sees it."""
        return cls(
            job,
            rank=env.rank,
            world_size=env.world_size,
            local_rank=env.local_rank,
            master_addr=env.master_addr,
            backend=backend,
        )

    @property
    def launches_before_policy(self) -> bool:
        """Whether this rank's engine starts before its policy is built (`Backend.engine_before_policy`; on
        CPU `train.py` launches it before it imports torch)."""
        return self.backend.engine_before_policy

    @property
    def log_files(self) -> list[Path]:
        """Each engine's log, in engine order."""
        log_dir = Path(self.job.rollout.log_dir or Path(self.job.output_dir) / "logs")
        if self.placement.num_engines == 1:
            return [log_dir / "sglang_engine.log"]
        return [log_dir / f"sglang_engine_{index}.log" for index in range(self.placement.num_engines)]

    def launch(self) -> None:
        """Start (without waiting for it) the engine this rank launches, if any: colocated, its TP group
        starts at this rank's GPU; it listens where the job's other processes reach it (`engine_host`).

        On GPUs collective: every rank calls it once its policy is built and its state offloaded, and no
        engine starts before all of them have."""
        if not self.launches_before_policy:
            import torch

            # An engine's TP ranks run on its peers' GPUs too. Started while a peer still holds its state, it
            # sizes its KV cache from that GPU's smaller free memory, or SGLang's check that its TP ranks
            # found about the same free memory (distributed/bootstrap.py, _check_tp_memory_balance) raises.
            torch.distributed.barrier()
        index = self.placement.owns(self.rank)
        if index is None or self.engine is not None:  # no engine here, or launched already
            return
        job = self.job
        log_file = self.log_files[index]
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self.engine = SGLangEngine(
            job.model.hf_dir,
            rollout_config(job),
            log_file=log_file,
            host=engine_host(self.world_size, self.master_addr),
            backend=self.backend,
            base_gpu_id=self.local_rank,
            index=index,
        ).launch()

    def connect(self, layout: ParallelLayout) -> None:
        """Wait for this rank's engine, then exchange every engine's record, and with it its API key.
        Collective."""
        import torch

        if self.engine is not None:
            self.engine.wait_until_ready()
        records: list[EngineRecord | None] = [None] * layout.world_size
        torch.distributed.all_gather_object(
            records, self.engine.record() if self.engine is not None else None
        )
        self.records = [record for record in records if record is not None]  # in engine order
        for record in self.records:
            engine_auth.register(record.url, record.api_key)
        # This rank's own engine is watched through its processes, the others through their records.
        self.watched = [
            self.engine if self.engine is not None and record.url == self.engine.url else record
            for record in self.records
        ]

    @property
    def urls(self) -> list[str]:
        return [record.url for record in self.records]

    def liveness_check(self) -> Callable[[str], None]:
        """A `RolloutClient.on_error` hook that names the engine that died and quotes its log."""
        return liveness_check(self.watched)

    def open_sync(self, layout: ParallelLayout, probe: SyncProbe) -> None:
        """The weight sync of `rollout.sync_method` into every engine, checked on `probe`. Collective."""
        from dapo_megatron.rollout.weight_sync import SYNC_METHODS

        rollout = self.job.rollout
        self.sync = SYNC_METHODS[rollout.sync_method](
            self.urls,
            self.job.model,
            layout,
            bucket_bytes=rollout.sync_bucket_mb * 2**20,
            engine_tp_size=rollout.engine_tp_size,
            timeout_s=rollout.resolved_request_timeout_s,
            engine_owners=[self.placement.owner(e) for e in range(self.placement.num_engines)],
        )
        self.probe = probe

    def release_memory(self) -> None:
        """The engine steps aside for the update (GPU). Collective."""
        import torch

        if self.backend.engine_memory_moves and self.engine is not None:
            self.engine.release_memory()
            self._released = True
        torch.distributed.barrier()

    def sync_weights(
        self,
        actor: Actor,
        client: RolloutClient | None,
        step: int,
        *,
        offload: Callable[[], float] | None = None,
    ) -> SyncReport:
        """Push the weights as version `step-N` and, when due (rollout.sync_check), check them against the
        trainer on the probe batch. Collective. `offload`: moves the trainer's state to host memory
        (`Policy.offload_state`), called once the trainer is done with it and before the engine takes back
        its KV cache.

        On GPUs the engine's memory comes back in stages so the peak stays low: its weights first, then the
        push and the trainer's side of the check, then the trainer's state leaves (`offload`), then the KV
        cache comes back, into that memory too, and the engines' side of the check runs on it. An engine's TP
        ranks take that memory on its peers' GPUs too, so each stage waits at a barrier for every rank to have
        freed its part, and no engine is asked to generate before every engine holds its KV cache again."""
        import torch

        from dapo_megatron.rollout.weight_sync import WeightSyncError

        started = time.perf_counter()
        version = f"step-{step}"
        released = self._released
        if self.backend.engine_memory_moves:
            # PyTorch's caching allocator still holds the training step's peak; every rank hands it back to
            # the driver so SGLang can allocate its weights and KV cache in that memory.
            self.backend.empty_cache()
            torch.distributed.barrier()
        if released:
            self.engine.resume_memory(["weights"])
        torch.distributed.barrier()
        try:
            self.sync.sync(actor.model, version)
        except WeightSyncError as failure:  # a push refused because an engine died: say which, with its log
            raise_if_any_died(self.watched, failure)
            raise
        mode, every = self.job.rollout.sync_check, self.job.rollout.sync_check_every
        check = mode == "always" or (
            mode == "first" and (self._last_check < 0 or step - self._last_check >= every)
        )
        trainer_log_probs = self._trainer_probe(actor) if check else None
        moving = time.perf_counter()
        offload_seconds = offload() if offload is not None else 0.0
        moved = time.perf_counter() - moving
        if self.backend.engine_memory_moves:
            self.backend.empty_cache()  # the sync's and the probe's buffers, the state `offload` moved out
            torch.distributed.barrier()  # every rank's state has left before an engine takes its KV cache
        if released:
            self.engine.resume_memory(["kv_cache", "cuda_graph"])
            self._released = False
        if self.backend.engine_memory_moves:
            # SGLang does not refuse a request while its KV cache is released: the driving rank's probe and
            # rollouts wait for every engine.
            torch.distributed.barrier()
        gap = None
        if trainer_log_probs is not None:
            gap = self._compare_probe(version, trainer_log_probs, client)
            self._last_check = step
        return SyncReport(time.perf_counter() - started - moved, offload_seconds, gap)

    def _trainer_probe(self, actor: Actor) -> torch.Tensor:
        assert self.probe is not None
        return self.probe.trainer_log_probs(actor, micro_batch_size=self.job.trainer.micro_batch_size)

    def _compare_probe(
        self, version: str, trainer_log_probs: torch.Tensor, client: RolloutClient | None
    ) -> float:
        """Every engine's log-probs on the probe batch against the trainer's; raises WeightSyncError beyond
        rollout.sync_check_tolerance. `client`: the driving rank's (None elsewhere). Returns the largest
        difference (0.0 off the driving rank)."""
        assert self.probe is not None
        return self.probe.compare(
            trainer_log_probs, client, version=version, tolerance=self.job.rollout.sync_check_tolerance
        )

    def close_sync(self) -> None:
        """First in the tear-down: a distributed sync's group is torn down on the engine's side too, while it
        still runs."""
        if self.sync is not None:
            self.sync.close()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
