"""The demo task's splits: evaluation is held out from everything trained on, answers are right."""

from __future__ import annotations

import pytest

from dapo_megatron.data import arithmetic


def prompts(split: str, seed: int = 0) -> set[str]:
    return {p.prompt for p in arithmetic.problems(split, seed=seed)}


def test_evaluation_is_held_out_and_the_warmup_is_part_of_the_rl_prompts() -> None:
    warmup, rl, held_out = prompts("warmup"), prompts("rl"), prompts("eval")
    assert not held_out & rl and not held_out & warmup
    assert warmup < rl
    total = (arithmetic.MAX_FIRST + 1) * (arithmetic.MAX_SECOND + 1)
    assert len(rl) + len(held_out) == total
    assert len(held_out) == round(arithmetic.HELD_OUT_FRACTION * total)


def test_answers_are_the_sums_in_dapo_format() -> None:
    for problem in arithmetic.problems("eval")[:50]:
        a, b = problem.prompt.removeprefix("Solve: ").removesuffix("=? ").split("+")
        assert problem.answer == str(int(a) + int(b))
        assert problem.target == f"Answer: {int(a) + int(b)}"


def test_seeds_reshuffle_the_split_and_unknown_splits_fail() -> None:
    assert prompts("eval", seed=0) != prompts("eval", seed=1)
    assert [p.prompt for p in arithmetic.problems("eval")] == [p.prompt for p in arithmetic.problems("eval")]
    with pytest.raises(ValueError, match="unknown split"):
        arithmetic.problems("test")
