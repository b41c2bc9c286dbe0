"""Which rank launches which SGLang engine, and the errors for layouts that cannot be spread evenly."""

from __future__ import annotations

import pytest

from dapo_megatron import backends, config
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.trainer.placement import engine_placement


def test_cuda_default_is_one_engine_per_tp_group_of_gpus() -> None:
    placement = engine_placement(16, RolloutConfig(engine_tp_size=4), backends.CUDA)
    assert (placement.num_engines, placement.ranks_per_engine) == (4, 4)
    assert [placement.owner(e) for e in range(4)] == [0, 4, 8, 12]
    assert [placement.engine_of(r) for r in (0, 3, 4, 15)] == [0, 0, 1, 3]
    assert [placement.owns(r) for r in (0, 1, 4, 13)] == [0, None, 1, None]


def test_cpu_default_is_one_engine_and_num_engines_asks_for_more() -> None:
    assert engine_placement(4, RolloutConfig(), backends.CPU).num_engines == 1
    placement = engine_placement(4, RolloutConfig(num_engines=2), backends.CPU)
    assert [placement.owner(e) for e in range(2)] == [0, 2]


def test_engines_that_do_not_divide_the_ranks_are_refused() -> None:
    with pytest.raises(ValueError, match=r"rollout.num_engines=3 must divide the world size 4"):
        engine_placement(4, RolloutConfig(num_engines=3), backends.CPU)
    with pytest.raises(ValueError, match=r"not a multiple of rollout.engine_tp_size=4"):
        engine_placement(8, RolloutConfig(engine_tp_size=4, num_engines=4), backends.CUDA)
    with pytest.raises(config.ConfigError, match=r"rollout.num_engines=3"):
        config.load(["rollout.num_engines=3"], world_size=4)
    with pytest.raises(ValueError, match=r"rollout.num_engines must be >= 0"):
        RolloutConfig(num_engines=-1)
