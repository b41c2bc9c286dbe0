"""The laptop demo's task: add two numbers and answer in DAPO's `Answer: <value>` format.

Small enough that a 4-layer, 64-wide model learns it in minutes on two CPU cores, and scored by the
real DAPO scorer (`rewards.math_dapo`), so the demo exercises the same reward path as AIME training.
Held-out evaluation problems are never trained on; the warm-up's problems are a subset of the RL prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SPLITS = ("warmup", "rl", "eval")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str

    @property
    def target(self) -> str:
        """The completion a correct policy writes (before its end-of-text token)."""
        return f"Answer: {self.answer}"


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


def problems(split: str, *, seed: int = 0, max_first: int = MAX_FIRST,
             max_second: int = MAX_SECOND) -> list[Problem]:
    """All problems `a+b` (0 <= a <= max_first, 0 <= b <= max_second) of one split, in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    pairs = [(a, b) for a in range(max_first + 1) for b in range(max_second + 1)]
    random.Random(seed).shuffle(pairs)
    held_out = len(pairs) - int(HELD_OUT_FRACTION * len(pairs))
    chosen = {"warmup": pairs[:int(WARMUP_FRACTION * len(pairs))], "rl": pairs[:held_out],
              "eval": pairs[held_out:]}[split]
    return [Problem(prompt=f"Solve: {a}+{b}=? ", answer=str(a + b)) for a, b in chosen]
