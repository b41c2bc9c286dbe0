"""Where the rollout engines run: which trainer rank launches each SGLang engine, and on which devices
(arithmetic on the config only; `trainer/fleet.py` launches them).

Colocated placement: the ranks are cut into consecutive blocks of `ranks_per_engine`, and the first rank of
each block launches one engine on its own GPU and the next `engine_tp_size - 1` (an engine's TP group shares
GPUs with trainer ranks, never straddles nodes as long as a node's GPU count is a multiple of the block).
On CPU the trainer's ranks share one host, so one engine per job is the default; `rollout.num_engines`
asks for more (the multi-engine paths are tested that way).
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.backends.base import Backend
from dapo_megatron.rollout.config import RolloutConfig


@dataclass(frozen=True)
class EnginePlacement:
    num_engines: int
    ranks_per_engine: int

    def engine_of(self, rank: int) -> int:
        """The engine whose devices this rank shares."""
        return rank // self.ranks_per_engine

    def owner(self, engine: int) -> int:
        """The global rank that launches `engine` and pushes weights into it."""
        return engine * self.ranks_per_engine

    def owns(self, rank: int) -> int | None:
        """The engine `rank` launches, or None."""
        return rank // self.ranks_per_engine if rank % self.ranks_per_engine == 0 else None


def engine_placement(world_size: int, rollout: RolloutConfig, backend: Backend) -> EnginePlacement:
    """The backend's number of engines (`Backend.engine_count`: one per `engine_tp_size` GPUs on CUDA, one per
    job on CPU) unless `rollout.num_engines` says.

    Raises ValueError naming the field when the engines cannot be spread evenly over the ranks."""
    count = rollout.num_engines or backend.engine_count(world_size, rollout.engine_tp_size)
    if count < 1 or world_size % count:
        raise ValueError(
            f"rollout.num_engines={count} must divide the world size {world_size}: each engine is "
            "launched by the first of an equal block of ranks; choose a divisor (0 = automatic)"
        )
    per_engine = world_size // count
    backend.check_engine_block(per_engine, rollout.engine_tp_size, count)
    return EnginePlacement(num_engines=count, ranks_per_engine=per_engine)
