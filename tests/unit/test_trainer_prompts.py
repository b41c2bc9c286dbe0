"""The driver's prompt sources: the demo task by default, data files when configured; resumable order."""

from __future__ import annotations

import pytest

from dapo_megatron import config as C
from dapo_megatron.data import arithmetic, char_tokenizer
from dapo_megatron.trainer.prompts import build_prompt_sources
from tests.sample_files import PROBLEMS, dapo_rows, write_jsonl, write_parquet


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return char_tokenizer.build()


def test_demo_task_by_default_and_resumable(tokenizer) -> None:  # type: ignore[no-untyped-def]
    job = C.load(["experiment=demo"])
    train, evaluation = build_prompt_sources(job, tokenizer)
    assert len(evaluation) == job.eval.num_problems
    first = next(train)
    assert first.ids == char_tokenizer.encode(tokenizer.decode(first.ids))  # spaces survive tokenization
    assert first.data_source == "math_dapo" and int(first.ground_truth) >= 0
    state = train.state_dict()
    ahead = [next(train).uid for _ in range(5)]
    train.load_state_dict(state)
    assert [next(train).uid for _ in range(5)] == ahead


def test_the_task_and_its_split_seed_pick_the_problems(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A base warmed up with one job seed keeps its held-out problems for RL runs with another job seed."""
    held_out = {p.prompt for p in arithmetic.problems("eval", seed=1234, task="column_addition")}
    trained = {p.prompt for p in arithmetic.problems("rl", seed=1234, task="column_addition")}
    job = C.load(["experiment=demo", "data.task=column_addition", "seed=0", "data.task_seed=1234"])
    train, evaluation = build_prompt_sources(job, tokenizer)
    assert {tokenizer.decode(p.ids) for p in evaluation} <= held_out
    assert all(tokenizer.decode(next(train).ids) in trained for _ in range(50))
    # Without task_seed the job seed splits: another held-out set.
    _, other = build_prompt_sources(
        C.load(["experiment=demo", "data.task=column_addition", "seed=0"]), tokenizer
    )
    assert {tokenizer.decode(p.ids) for p in other} != {tokenizer.decode(p.ids) for p in evaluation}


def test_data_files_replace_the_demo_task(tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # DAPO-Math-17k and AIME layouts; DAPO's prompt makes every row longer than 250 characters (tokens here).
    problems = [(f"{problem} (variant {i})", answer) for i in range(3) for problem, answer in PROBLEMS]
    train_file = write_jsonl(tmp_path / "dapo_math.jsonl", dapo_rows(problems))
    eval_file = write_parquet(tmp_path / "aime.parquet", dapo_rows(copies=4, seed=0))
    job = C.load(
        [
            "experiment=demo",
            f"data.train_files=[{train_file}]",
            f"data.eval_files=[{eval_file}]",
            "rollout.max_prompt_length=250",
            "model.max_position_embeddings=512",
        ]
    )
    train, evaluation = build_prompt_sources(job, tokenizer)
    assert len(evaluation) == 3  # 12 rows, 4 copies of each problem, de-duplicated
    seen = {next(train).uid for _ in range(9)}
    assert len(seen) == 9  # one epoch covers the 9 training rows once
    assert all(len(next(train).ids) == 250 for _ in range(9))  # left-truncated to the prompt limit
