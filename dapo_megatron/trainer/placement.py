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

from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.trainer.config import TrainerConfig


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
        raise ValueError(
            f"rollout.num_engines={count} must divide the world size {world_size}: each engine is "
            "launched by the first of an equal block of ranks; choose a divisor (0 = automatic)"
        )
    per_engine = world_size // count
    if device == "cuda" and per_engine % rollout.engine_tp_size:
        raise ValueError(
            f"{count} engine(s) over {world_size} GPUs leave {per_engine} GPU(s) per engine, not a "
            f"multiple of rollout.engine_tp_size={rollout.engine_tp_size}; lower rollout.num_engines "
            f"to a divisor of {world_size // rollout.engine_tp_size} (0 = one per TP group)"
        )
    return EnginePlacement(num_engines=count, ranks_per_engine=per_engine)


def node_engine_gpus(rollout: RolloutConfig, gpus: int) -> list[int]:
    """The first GPU of each engine that one process (tools/eval.py) starts on a node with `gpus` GPUs:
    `rollout.num_engines` engines (0 = as many as fit) of `rollout.engine_tp_size` GPUs each, side by side.

    Raises ValueError naming the field when they do not fit the node."""
    tp = rollout.engine_tp_size
    if gpus < tp:
        raise ValueError(
            f"rollout.engine_tp_size={tp} needs {tp} GPUs per engine but this node has {gpus}; "
            f"lower rollout.engine_tp_size to at most {gpus} (the model must still fit)"
        )
    fit = gpus // tp
    count = rollout.num_engines or fit
    if count > fit:
        raise ValueError(
            f"rollout.num_engines={count} engines of rollout.engine_tp_size={tp} GPUs need {count * tp} "
            f"GPUs but this node has {gpus}; set rollout.num_engines to at most {fit} "
            "(0 = as many as fit)"
        )
    return [engine * tp for engine in range(count)]


def check_overlap(trainer: TrainerConfig, device: str) -> None:
    """trainer.overlap_rollout generates while the policy trains: the engine needs cores or devices the
    trainer is not using. Raises ValueError naming the field on GPUs, where engines are colocated."""
    if trainer.overlap_rollout and device == "cuda":
        raise ValueError(
            "trainer.overlap_rollout=true generates while the policy trains, but a colocated GPU "
            "engine hands its memory to the trainer during the update; set trainer.overlap_rollout=false"
        )
