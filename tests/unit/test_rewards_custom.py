"""A user's own reward function, by file and by import path: scored in the reward pool's worker processes
with the built-in scorer's timeout, error and type checks, and refused at config time when it cannot load."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_megatron.config import ConfigError, compose, to_job_config
from dapo_megatron.rewards.config import RewardConfig
from dapo_megatron.rewards.pool import RewardPool, status_counts

USER_FILE = """
import time

CALLS = []


def score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "sleep":
        time.sleep(3600)
    if solution_str == "raise":
        raise RuntimeError("user bug")
    if solution_str == "float":
        return 0.5
    if solution_str == "string acc":
        return {"acc": "yes"}
    if data_source == "bool":
        return solution_str.strip() == ground_truth
    return {"acc": solution_str.endswith(ground_truth), "pred": solution_str[-len(ground_truth):]}


NOT_A_FUNCTION = 3


def wrong_arguments(text, answer):
    return True
"""


@pytest.fixture
def user_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    monkeypatch.chdir(tmp_path)  # the config names it relative to the directory the job starts in
    return path


def test_a_user_file_scores_in_the_workers_with_the_pools_timeout_and_checks(user_file: Path) -> None:
    config = to_job_config(
        compose(
            [
                f"reward.function_file={user_file.name}",
                "reward.function_name=score",
                "reward.num_workers=1",
                "reward.timeout_s=1.0",
                "reward.correct_score=2.0",
                "reward.wrong_score=-0.5",
            ]
        )
    ).reward
    items = [
        ("the answer is 42", "42", "math"),
        ("the answer is 41", "42", "math"),
        (" 7 ", "7", "bool"),
        ("8", "7", "bool"),
        ("sleep", "1", "math"),
        ("raise", "1", "math"),
        ("float", "1", "math"),
        ("string acc", "1", "math"),
    ]
    with RewardPool(config) as pool:
        results = pool.score(items)
    assert [(r.score, r.acc, r.status) for r in results] == [
        (2.0, True, "ok"),
        (-0.5, False, "ok"),
        (2.0, True, "ok"),
        (-0.5, False, "ok"),
        (-0.5, False, "timeout"),
        (-0.5, False, "error"),
        (-0.5, False, "error"),
        (-0.5, False, "error"),
    ]
    assert results[0].pred == "42"
    assert "RuntimeError: user bug" in results[5].error
    assert "returned 0.5 of type float; return a bool or {'acc': bool" in results[6].error
    assert "acc='yes' of type str; it must be a bool" in results[7].error
    assert status_counts(results) == {"reward/timeouts": 1, "reward/errors": 3}


def test_an_import_path_and_the_documented_example_config() -> None:
    reward = to_job_config(compose(["reward=last_number", "reward.num_workers=0"])).reward
    assert reward.function == "dapo_megatron.rewards.example:last_number_matches"
    with RewardPool(reward) as pool:
        results = pool.score([("about 1,000 apples", "1000", "gsm8k"), ("42, then 7", "42", "gsm8k")])
    assert [(r.acc, r.pred) for r in results] == [(True, "1000"), (False, "7")]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.function_file=missing.py"], r"reward\.function_file=missing\.py: no such file"),
        (
            ["reward.function_file=my_reward.py", "reward.function_name=scor"],
            r"has no attribute 'scor'; its functions: score, wrong_arguments",
        ),
        (
            ["reward.function_file=my_reward.py", "reward.function_name=NOT_A_FUNCTION"],
            r"NOT_A_FUNCTION is a int, not a function",
        ),
        (
            ["reward.function_file=my_reward.py", "reward.function_name=wrong_arguments"],
            r"wrong_arguments cannot be called as wrong_arguments\(data_source=\.\.\., solution_str=",
        ),
        (["reward.function=no_such_module_xyz:score"], r"cannot import no_such_module_xyz"),
        (["reward.function=dapo_megatron.rewards.example"], r"must be 'module:function'"),
        (
            [
                "reward.function=dapo_megatron.rewards.example:last_number_matches",
                "reward.function_file=a.py",
            ],
            r"reward\.function_file=a\.py each choose how samples are graded; keep one",
        ),
    ],
)
def test_a_function_that_cannot_load_is_a_config_error(
    user_file: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        to_job_config(compose(overrides))


def test_without_a_function_the_builtin_scorer_grades() -> None:
    assert RewardConfig().custom_function() is None
    with RewardPool(RewardConfig(num_workers=0)) as pool:
        assert pool.score([("Answer: 3", "3", "math_dapo")])[0].acc
