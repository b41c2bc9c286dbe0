"""Where the driver's prompts come from: token ids, ground truth and data source, in a resumable order."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from dapo_megatron.data import arithmetic
from dapo_megatron.trainer.rollout import Prompt


class ShuffledPrompts:
    """An endless stream over `prompts`, reshuffled (seeded) every epoch; its position is checkpointed."""

    def __init__(self, prompts: Sequence[Prompt], *, seed: int, shuffle: bool = True) -> None:
        if not prompts:
            raise ValueError("no training prompts: check data.train_files")
        self.prompts, self.seed, self.shuffle = list(prompts), seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def __iter__(self) -> ShuffledPrompts:
        return self

    def __next__(self) -> Prompt:
        if self.index == len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._epoch_order()
        self.index += 1
        return self.prompts[self._order[self.index - 1]]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": len(self.prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != len(self.prompts) or state["seed"] != self.seed:
            raise ValueError(f"the checkpoint's prompt stream had {state['size']} prompts and seed {state['seed']}; "
                             f"this run has {len(self.prompts)} and {self.seed}: the data changed since it was saved")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._epoch_order()


def arithmetic_prompts(split: str, encode: Callable[[str], list[int]], *, seed: int) -> list[Prompt]:
    """The demo task's problems, scored by DAPO's scorer (`Answer: <sum>`)."""
    return [Prompt(uid=f"arithmetic-{split}-{i}", ids=encode(p.prompt), ground_truth=p.answer, data_source="math_dapo")
            for i, p in enumerate(arithmetic.problems(split, seed=seed))]
