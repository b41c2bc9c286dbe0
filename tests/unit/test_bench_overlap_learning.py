"""bench/bench_overlap_learning.py's summary over seeds, on hand-made run results (the runs are the
benchmark)."""

from __future__ import annotations

import pytest

from tests.conftest import load_bench_script

bench = load_bench_script("bench_overlap_learning")


def test_the_late_accuracy_averages_the_last_evaluations_every_seed_reached() -> None:
    runs = [
        {"accuracy": {0: 0.2, 5: 0.3, 10: 0.4, 15: 0.5}, "step_s": 1.0},
        {"accuracy": {0: 0.2, 5: 0.5, 10: 0.6}, "step_s": 3.0},  # stopped before step 15
        {"accuracy": {0: 0.2, 5: 0.4, 10: 0.8, 15: 0.1}, "step_s": 2.0},
    ]
    summary = bench.summarise(runs, late=2)
    assert list(summary["curve"]) == [0, 5, 10]  # only steps every seed evaluated
    assert summary["curve"][10] == pytest.approx(0.6)
    assert summary["late_steps"] == [5, 10]
    assert summary["late_accuracy"] == pytest.approx((0.3 + 0.4 + 0.5 + 0.6 + 0.4 + 0.8) / 6)
    assert summary["step_s"] == 2.0
