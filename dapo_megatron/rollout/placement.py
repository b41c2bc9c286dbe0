"""Where the rollout engines run: which trainer rank launches each SGLang engine, and on which devices.

Colocated placement: the ranks are cut into consecutive blocks of `ranks_per_engine`, and the first rank of
each block launches one engine on its own GPU and the next `engine_tp_size - 1` (an engine's TP group shares
GPUs with trainer ranks, never straddles nodes as long as a node's GPU count is a multiple of the block).
On CPU the trainer's ranks share one host, so one engine per job is the default; `rollout.num_engines`
asks for more (the multi-engine paths are tested that way).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def engine_placement(world_size: int, rollout: RolloutConfig, device: str) -> EnginePlacement:
    """One engine per `engine_tp_size` GPUs on CUDA, one per job on CPU, unless `rollout.num_engines` says.

    Raises ValueError naming the field when the engines cannot be spread evenly over the ranks."""
    count = rollout.num_engines or (world_size // rollout.engine_tp_size if device == "cuda" else 1)
    if count < 1 or world_size % count:
        raise ValueError(f"rollout.num_engines={count} must divide the world size {world_size}: each engine is "
                         "launched by the first of an equal block of ranks; choose a divisor (0 = automatic)")
    per_engine = world_size // count
    if device == "cuda" and per_engine % rollout.engine_tp_size:
        raise ValueError(f"{count} engine(s) over {world_size} GPUs leave {per_engine} GPU(s) per engine, not a "
                         f"multiple of rollout.engine_tp_size={rollout.engine_tp_size}; lower rollout.num_engines "
                         f"to a divisor of {world_size // rollout.engine_tp_size} (0 = one per TP group)")
    return EnginePlacement(num_engines=count, ranks_per_engine=per_engine)
