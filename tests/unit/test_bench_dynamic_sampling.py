"""bench/bench_dynamic_sampling.py's leanest batch-synchronous baseline (the runs are the benchmark)."""

from __future__ import annotations

import pytest

from tests.conftest import load_bench_script

bench = load_bench_script("bench_dynamic_sampling")


@pytest.mark.parametrize(
    ("prompts", "keep_ratio", "expected"),
    [(32, 0.6, 54), (32, 0.5, 64), (32, 1.0, 32), (32, 0.3125, 103), (8, 0.7, 12)],
)
def test_the_leanest_generation_batch_fills_the_batch_in_one_round(
    prompts: int, keep_ratio: float, expected: int
) -> None:
    gen_batch = bench.leanest_gen_batch(prompts, keep_ratio)
    assert gen_batch == expected
    assert int(gen_batch * keep_ratio + 1e-9) >= prompts  # one round at that keep ratio fills the batch
    assert int((gen_batch - 1) * keep_ratio + 1e-9) < prompts  # one prompt fewer does not


def test_a_step_that_kept_nothing_has_no_leanest_batch() -> None:
    with pytest.raises(ValueError, match="kept no group"):
        bench.leanest_gen_batch(32, 0.0)
