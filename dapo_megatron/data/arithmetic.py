"""Synthetic arithmetic tasks, answered in DAPO's `Answer: <value>` format (`data.task` picks one).

* `addition`, the laptop demo: a number up to 99 plus a digit, `Solve: 87+6=? ` -> `Answer: 93`. Small
  enough that a 4-layer, 64-wide model learns it in minutes on two CPU cores.
* `column_addition`, the ~30M-parameter size of bench/bench_e2e_trl.py: two 3-digit numbers added column by
  column, `Solve: 517+817=? ` ->
      units: 7+7+0=14 write 4 carry 1
      tens: 1+1+1=03 write 3 carry 0
      hundreds: 5+8+0=13 write 3 carry 1
      Answer: 1334
  (each column's digits, carry in, two-digit sum, digit written and carry out), ~110 characters: with the
  character tokenizer responses are ~110 tokens, so generation and training compute, not per-step
  overheads, set the step time.

Both are scored by the real DAPO scorer (`rewards.math_dapo`) on the final `Answer:` line only (the working
is not graded), so they exercise the same reward path as AIME training. Held-out evaluation problems are
never trained on; the warm-up's problems are a subset of the RL prompts.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

SPLITS = ("warmup", "rl", "eval")
TASKS = ("addition", "column_addition")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    working: str = ""
    """What a correct policy writes before its `Answer:` line (empty for the short task)."""

    @property
    def target(self) -> str:
        """The completion a correct policy writes (before its end-of-text token)."""
        return f"{self.working}Answer: {self.answer}"


MAX_FIRST = 99
MAX_SECOND = 9
"""The demo adds a number up to 99 and a digit: digit sums and carries into the tens and hundreds are
there, and a 4-layer, 64-wide model masters it (supervised training goes from 24% to 92% greedy accuracy
between steps 330 and 480), so DAPO has room to take the base from ~20% towards that. With both operands
up to 99 the same model needs ~900 supervised steps for 75%, and DAPO from a 20% base stalled near 55%;
with the second operand up to 19 DAPO's progress depended strongly on where the base stopped."""

HELD_OUT_FRACTION = 0.2
"""Evaluation takes 200 of the 1000 operand pairs; RL prompts are the other 800, and the warm-up sees 550
of those. With only a disjoint 250 for RL the policy memorised them (rollout accuracy 0.81 against 0.56
held out after 160 steps); the warm-up only taught the answer format on its share."""
WARMUP_FRACTION = 0.55

COLUMN_NAMES = ("units", "tens", "hundreds")
"""One per digit of `column_addition`'s operands. Named columns give every line a content anchor: a
3M-parameter model learned this format (then with a comma before `write`) in ~250 supervised steps (held-out
exact match 0.03 at step 200, 0.25 at 225, 0.77 at 325), while with 9-digit operands on unlabelled lines
(`7+6+1=14`, ~100 characters) the 30M model was still at 0% after 150. Targets are 109-110 characters (110-111
tokens with EOS), inside a 128-token response cap and its 16-token overlong buffer; prompts are 17
characters."""
COLUMN_PROBLEMS = 20_000
"""Distinct operand pairs drawn per seed, split with the same fractions as `addition`: 4000 held out (an
evaluation takes the first few hundred), 11000 for the warm-up, which sees each at most once or twice in a
few hundred steps of 32, and 16000 RL prompts."""


def warmed_up_on(summary: dict[str, Any]) -> tuple[str, int]:
    """The task and split seed of a base, from its warm-up's warmup_summary.json: its held-out problems are
    that split's. Bases from before tasks existed are `addition`; from before task_seed, split with the job
    seed."""
    return summary.get("task", "addition"), summary.get("task_seed", summary["seed"])


def problems(split: str, *, seed: int = 0, task: str = "addition") -> list[Problem]:
    """All problems of one split of `task`, in a fixed order for a given seed."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    return list(_splits(task, seed)[split])


@functools.cache
def _splits(task: str, seed: int) -> dict[str, tuple[Problem, ...]]:
    # Cached: the column task's 20000 worked solutions are built once per process, not once per split.
    if task == "addition":
        pairs = [(a, b) for a in range(MAX_FIRST + 1) for b in range(MAX_SECOND + 1)]
        random.Random(seed).shuffle(pairs)
        make = _addition
    else:
        pairs = _column_pairs(seed)
        make = _column_addition
    held_out = len(pairs) - int(HELD_OUT_FRACTION * len(pairs))
    chosen = {
        "warmup": pairs[: int(WARMUP_FRACTION * len(pairs))],
        "rl": pairs[:held_out],
        "eval": pairs[held_out:],
    }
    return {split: tuple(make(a, b) for a, b in chosen[split]) for split in SPLITS}


def _addition(a: int, b: int) -> Problem:
    return Problem(prompt=f"Solve: {a}+{b}=? ", answer=str(a + b))


def _column_pairs(seed: int) -> list[tuple[int, int]]:
    """`COLUMN_PROBLEMS` random pairs of numbers with one digit per column name, no pair twice in either order
    (so no held-out problem is a trained one with its operands swapped)."""
    rng = random.Random(seed)
    low, high = 10 ** (len(COLUMN_NAMES) - 1), 10 ** len(COLUMN_NAMES) - 1
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < COLUMN_PROBLEMS:
        a, b = rng.randint(low, high), rng.randint(low, high)
        if (min(a, b), max(a, b)) not in seen:
            seen.add((min(a, b), max(a, b)))
            pairs.append((a, b))
    return pairs


def _column_addition(a: int, b: int) -> Problem:
    """Units column first; the sum always has two digits, its tens digit being the carry out."""
    lines, carry = [], 0
    for name, x, y in zip(COLUMN_NAMES, reversed(str(a)), reversed(str(b)), strict=True):
        total = int(x) + int(y) + carry
        lines.append(f"{name}: {x}+{y}+{carry}={total:02d} write {total % 10} carry {total // 10}\n")
        carry = total // 10
    return Problem(prompt=f"Solve: {a}+{b}=? ", answer=str(a + b), working="".join(lines))
