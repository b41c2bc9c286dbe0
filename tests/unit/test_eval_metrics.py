"""avg@k, pass@k and response length, overall and per data source, from hand-made outcomes."""

from __future__ import annotations

import pytest

from dapo_megatron.trainer.evaluate import ProblemOutcome, eval_metrics


def test_metrics_per_data_source_and_overall() -> None:
    outcomes = [
        ProblemOutcome("aime2024", 4, (10, 10, 10, 10)),
        ProblemOutcome("aime2024", 0, (2, 2, 2, 2)),
        ProblemOutcome("gsm8k", 1, (1, 2, 3, 6)),
    ]
    assert eval_metrics(outcomes, k=4) == pytest.approx(
        {
            "eval/accuracy": 5 / 12,
            "eval/pass@4": 2 / 3,
            "eval/response_length": 60 / 12,
            "eval/aime2024/accuracy": 4 / 8,
            "eval/aime2024/pass@4": 1 / 2,
            "eval/aime2024/response_length": 6.0,
            "eval/gsm8k/accuracy": 1 / 4,
            "eval/gsm8k/pass@4": 1.0,
            "eval/gsm8k/response_length": 3.0,
        }
    )


def test_one_data_source_keeps_the_overall_names_only() -> None:
    outcomes = [ProblemOutcome("math_dapo", 2, (3, 5)), ProblemOutcome("math_dapo", 0, (4, 4))]
    assert eval_metrics(outcomes, k=2) == pytest.approx(
        {"eval/accuracy": 0.5, "eval/pass@2": 0.5, "eval/response_length": 4.0}
    )
