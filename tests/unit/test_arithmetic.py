"""The synthetic tasks' splits: evaluation is held out from everything trained on, targets are right, and
DAPO's scorer grades their final answers."""

from __future__ import annotations

import itertools
import re

import pytest

from dapo_megatron.data import arithmetic, char_tokenizer
from dapo_megatron.data.config import DataConfig
from dapo_megatron.rewards.math_dapo import compute_score

COLUMN_LINE = re.compile(r"(\w+): (\d)\+(\d)\+([01])=(\d\d) write (\d) carry ([01])")


def prompts(split: str, seed: int = 0, task: str = "addition") -> set[str]:
    return {p.prompt for p in arithmetic.problems(split, seed=seed, task=task)}


def operands(problem: arithmetic.Problem) -> tuple[str, str]:
    a, b = problem.prompt.removeprefix("Solve: ").removesuffix("=? ").split("+")
    return a, b


def test_evaluation_is_held_out_and_the_warmup_is_part_of_the_rl_prompts() -> None:
    warmup, rl, held_out = prompts("warmup"), prompts("rl"), prompts("eval")
    assert not held_out & rl and not held_out & warmup
    assert warmup < rl
    total = (arithmetic.MAX_FIRST + 1) * (arithmetic.MAX_SECOND + 1)
    assert len(rl) + len(held_out) == total
    assert len(held_out) == round(arithmetic.HELD_OUT_FRACTION * total)


def test_answers_are_the_sums_in_dapo_format() -> None:
    for problem in arithmetic.problems("eval")[:50]:
        a, b = operands(problem)
        assert problem.answer == str(int(a) + int(b))
        assert problem.target == f"Answer: {int(a) + int(b)}"


def test_seeds_reshuffle_the_split_and_unknown_splits_fail() -> None:
    assert prompts("eval", seed=0) != prompts("eval", seed=1)
    assert [p.prompt for p in arithmetic.problems("eval")] == [p.prompt for p in arithmetic.problems("eval")]
    with pytest.raises(ValueError, match="unknown split"):
        arithmetic.problems("test")
    with pytest.raises(ValueError, match="unknown task"):
        arithmetic.problems("eval", task="subtraction")


def test_column_splits_are_disjoint_even_with_swapped_operands() -> None:
    def pairs(split: str) -> set[frozenset[str]]:
        return {frozenset(operands(p)) for p in arithmetic.problems(split, task="column_addition")}

    warmup, rl, held_out = pairs("warmup"), pairs("rl"), pairs("eval")
    assert not held_out & rl and warmup < rl
    assert len(rl) + len(held_out) == arithmetic.COLUMN_PROBLEMS
    assert len(held_out) == round(arithmetic.HELD_OUT_FRACTION * arithmetic.COLUMN_PROBLEMS)
    assert prompts("eval", seed=1, task="column_addition") != prompts("eval", seed=0, task="column_addition")


def test_column_targets_work_every_column_and_end_in_the_sum() -> None:
    for problem in arithmetic.problems("eval", task="column_addition")[:300]:
        a, b = operands(problem)
        assert len(a) == len(b) == len(arithmetic.COLUMN_NAMES)
        *working, answer_line = problem.target.split("\n")
        assert answer_line == f"Answer: {int(a) + int(b)}" and problem.answer == str(int(a) + int(b))
        carry, digits = 0, ""
        for line, name, x, y in zip(working, arithmetic.COLUMN_NAMES, reversed(a), reversed(b), strict=True):
            match = COLUMN_LINE.fullmatch(line)
            assert match, line
            assert match.groups()[:4] == (name, x, y, str(carry))
            total = int(match.group(5))
            assert total == int(x) + int(y) + carry
            assert (int(match.group(6)), int(match.group(7))) == (total % 10, total // 10)
            carry, digits = total // 10, str(total % 10) + digits
        assert problem.answer == (str(carry) if carry else "") + digits


def test_the_scorer_grades_the_final_answer_of_column_targets() -> None:
    problem = arithmetic.problems("eval", task="column_addition")[0]
    assert compute_score(problem.target, problem.answer) == {
        "score": 1.0,
        "acc": True,
        "pred": problem.answer,
    }
    off_by_one = str(int(problem.answer) + 1)
    wrong = problem.working + f"Answer: {off_by_one}"
    assert (
        compute_score(wrong, problem.answer)["score"] == -1.0
        and not compute_score(wrong, problem.answer)["acc"]
    )
    assert not compute_score(problem.working, problem.answer)["acc"]  # working without an answer line
    # Only the answer line is graded: wrong working with the right answer still scores.
    assert compute_score("units: 1+1+0=02 write 2 carry 0\n" + f"Answer: {problem.answer}", problem.answer)[
        "acc"
    ]


def test_column_lengths_fit_the_benchmark_budget() -> None:
    """~110-token responses under bench_e2e_trl's 128-token cap, short of its 16-token overlong buffer, and
    prompts within configs/experiment/demo.yaml's 32-token prompt limit."""
    problems = arithmetic.problems("eval", task="column_addition") + arithmetic.problems(
        "rl", task="column_addition"
    )
    response = {len(char_tokenizer.encode(p.target)) + 1 for p in problems}  # + EOS
    assert min(response) >= 100 and max(response) <= 128 - 16
    assert max(len(char_tokenizer.encode(p.prompt)) for p in problems) <= 32
    # Both lengths occur: sums with and without a carry out of the top column.
    assert len(response) == 2


def digits(problem: arithmetic.Problem) -> list[int]:
    return [int(d) for d in problem.prompt.removeprefix("Solve: ").removesuffix("=? ").split("+")]


def test_digit_sum_splits_are_disjoint_and_deterministic() -> None:
    warmup, rl, held_out = (prompts(split, task="digit_sum") for split in arithmetic.SPLITS)
    assert not held_out & rl and warmup < rl
    per_count = [min(arithmetic.DIGIT_SUM_PER_COUNT, 10**n) for n in arithmetic.DIGIT_COUNTS]
    assert len(rl) + len(held_out) == sum(per_count)
    assert len(held_out) == round(arithmetic.HELD_OUT_FRACTION * sum(per_count))
    assert arithmetic.problems("eval", task="digit_sum") == arithmetic.problems("eval", task="digit_sum")
    assert prompts("eval", seed=1, task="digit_sum") != prompts("eval", seed=0, task="digit_sum")


def test_digit_sum_working_is_the_running_sums_and_ends_in_the_answer() -> None:
    for problem in arithmetic.problems("eval", task="digit_sum"):
        working, answer_line = problem.target.split("\n")
        running = [int(n) for n in working.split(" ")]
        assert running == list(itertools.accumulate(digits(problem)))
        assert answer_line == f"Answer: {sum(digits(problem))}" == f"Answer: {problem.answer}"
        assert compute_score(problem.target, problem.answer)["acc"]
    # Only the answer line is graded: a wrong chain with the right answer still scores.
    assert (
        compute_score("1 2\nAnswer: 19", "19")["acc"] and not compute_score("1 19\nAnswer: 18", "19")["acc"]
    )


def test_digit_sum_lengths_vary_over_the_ladders_range() -> None:
    """Every count of digits in every split, responses from 14 to 31 tokens (end-of-text included) spread
    over that range, every character a token of its own, and prompts within the demo's 32-token limit."""
    for split in arithmetic.SPLITS:
        problems = arithmetic.problems(split, task="digit_sum")
        assert {len(digits(p)) for p in problems} == set(arithmetic.DIGIT_COUNTS)
        lengths = [len(char_tokenizer.encode(p.target)) + 1 for p in problems]
        assert (min(lengths), max(lengths)) == (14, 31)
        assert len(set(lengths)) >= 15
        assert (
            sum(n <= 20 for n in lengths) > len(lengths) / 5
            and sum(n >= 26 for n in lengths) > len(lengths) / 5
        )
        for p in problems:
            ids = char_tokenizer.encode(p.prompt + p.target)
            assert char_tokenizer.VOCAB.index(char_tokenizer.UNK) not in ids
            assert char_tokenizer.decode(ids) == p.prompt + p.target
        assert max(len(char_tokenizer.encode(p.prompt)) for p in problems) <= 32


def test_data_config_names_the_task() -> None:
    assert DataConfig(task="column_addition").task == "column_addition"
    with pytest.raises(ValueError, match=r"data\.task"):
        DataConfig(task="multiplication")
