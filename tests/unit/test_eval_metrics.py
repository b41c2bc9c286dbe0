"""avg@k, pass@k and response length per data source, under verl's validation names, by hand."""

from __future__ import annotations

import pytest

from dapo_megatron.trainer.evaluate import ProblemOutcome, by_source, eval_accuracy, eval_metrics

SEVERAL = [
    ProblemOutcome("aime2024", 4, (10, 10, 10, 10)),
    ProblemOutcome("aime2024", 0, (2, 2, 2, 2)),
    ProblemOutcome("gsm8k", 1, (1, 2, 3, 6)),
]


def test_metrics_per_data_source_and_overall() -> None:
    metrics = eval_metrics(SEVERAL, k=4)
    assert metrics == pytest.approx(
        {
            "val-core/aime2024/acc/mean@4": 4 / 8,
            "val-core/aime2024/acc/best@4/mean": 1 / 2,
            "val-aux/aime2024/response_length/mean@4": 6.0,
            "val-core/gsm8k/acc/mean@4": 1 / 4,
            "val-core/gsm8k/acc/best@4/mean": 1.0,
            "val-aux/gsm8k/response_length/mean@4": 3.0,
            "val-aux/all/acc/mean@4": 5 / 12,
            "val-aux/all/acc/best@4/mean": 2 / 3,
            "val-aux/all/response_length/mean@4": 60 / 12,
        }
    )
    assert eval_accuracy(metrics) == pytest.approx(5 / 12)
    assert by_source(metrics, 4)["gsm8k"] == pytest.approx({"avg": 0.25, "pass": 1.0, "response_length": 3.0})


def test_one_data_source_and_one_sample() -> None:
    """One source: no summary over all; one sample per problem: best@1 would repeat mean@1 (verl omits it)."""
    outcomes = [ProblemOutcome("math_dapo", 1, (3,)), ProblemOutcome("math_dapo", 0, (5,))]
    metrics = eval_metrics(outcomes, k=1)
    assert metrics == pytest.approx(
        {"val-core/math_dapo/acc/mean@1": 0.5, "val-aux/math_dapo/response_length/mean@1": 4.0}
    )
    assert eval_accuracy(metrics) == 0.5
    assert eval_accuracy({"critic/score/mean": 1.0}) is None
