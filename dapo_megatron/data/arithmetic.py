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
* `digit_sum`, the ablation ladder's (bench/ablation.py): 2 to 7 digits summed with their running sums,
  `Solve: 3+5+2+8+1=? ` ->
      3 8 10 18 19
      Answer: 19
  each step the demo's skill (a number up to 63 plus a digit), chained. Responses are 14-31 tokens with their
  end-of-text, so how the loss weights short against long responses, and what happens to those that ramble
  into the cap, change the gradient.

All are scored by the real DAPO scorer (`rewards.math_dapo`) on the final `Answer:` line only (the working
is not graded), so they exercise the same reward path as AIME training. Held-out evaluation problems are
never trained on; the warm-up's problems are a subset of the RL prompts.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass
from typing import Any

SPLITS = ("warmup", "rl", "eval")
TASKS = ("addition", "column_addition", "digit_sum")


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

DIGIT_COUNTS = range(2, 8)
"""How many digits a `digit_sum` prompt adds: the number of running sums, hence the response length,
varies from 14 tokens (two digits, `3 8\nAnswer: 8` and end-of-text) to 31 (seven, sums past 9 from the
second on)."""
DIGIT_SUM_PER_COUNT = 200
"""Distinct digit sequences drawn per count (all 100 of the two-digit ones), 1100 in all, split with the
same fractions as `addition`: 220 held out (an evaluation takes 200), 880 RL prompts, 605 for the warm-up.
Sequences are distinct in order, not as multisets: a reordering is another chain of running sums."""


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
        operands = [(a, b) for a in range(MAX_FIRST + 1) for b in range(MAX_SECOND + 1)]
        random.Random(seed).shuffle(operands)
        make = _addition
    elif task == "column_addition":
        operands = _column_pairs(seed)
        make = _column_addition
    else:
        operands = _digit_sequences(seed)
        make = _digit_sum
    held_out = len(operands) - int(HELD_OUT_FRACTION * len(operands))
    chosen = {
        "warmup": operands[: int(WARMUP_FRACTION * len(operands))],
        "rl": operands[:held_out],
        "eval": operands[held_out:],
    }
    return {split: tuple(make(*item) for item in chosen[split]) for split in SPLITS}


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


def _digit_sequences(seed: int) -> list[tuple[int, ...]]:
    """`DIGIT_SUM_PER_COUNT` distinct digit sequences of each length in `DIGIT_COUNTS` (every one where fewer
    exist), shuffled together: each split gets every length in about the same shares."""
    rng = random.Random(seed)
    sequences: list[tuple[int, ...]] = []
    for count in DIGIT_COUNTS:
        drawn: set[tuple[int, ...]] = set()
        while len(drawn) < min(DIGIT_SUM_PER_COUNT, 10**count):
            drawn.add(tuple(rng.randrange(10) for _ in range(count)))
        sequences += sorted(drawn)  # sorted: a set's order is not reproducible across processes
    rng.shuffle(sequences)
    return sequences


def _digit_sum(*digits: int) -> Problem:
    """The running sums, the first digit's included, on one line: the last of them is the answer."""
    sums = list(itertools.accumulate(digits))
    return Problem(
        prompt=f"Solve: {'+'.join(map(str, digits))}=? ",
        answer=str(sums[-1]),
        working=" ".join(map(str, sums)) + "\n",
    )
