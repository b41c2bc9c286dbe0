"""DAPO's dynamic sampling: keep only prompt groups whose samples disagree, until the batch is full.

A group whose G samples are all right (or all wrong) has zero GRPO advantage everywhere, so it adds
nothing to the gradient but still dilutes the token-mean. DAPO drops such groups and keeps generating
until `target_groups` informative groups are collected (paper Eq. 11: 0 < |correct| < G).

The filter looks at raw accuracy, never at the shaped reward: the overlong penalty gives an all-wrong
group a spread of rewards and would let it through. Singleton groups (G = 1) are kept, as in verl.

`BatchCollector` is the form the driver uses: it judges each group the moment it is scored and admits
informative ones in draw order until the batch is full; what was resolved past that point is left for
the driver to carry over. Pure Python; the driver owns generation, aborting and carry-over.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

KEEP_REASONS = ("mixed", "singleton")
DROP_REASONS = ("all_correct", "all_wrong")

G = TypeVar("G")


def judge_group(accuracies: Sequence[bool]) -> str:
    """The reason a group is kept (`mixed`, `singleton`) or dropped (`all_correct`, `all_wrong`)."""
    if len(accuracies) == 0:
        raise ValueError("a prompt group needs at least one sample")
    if len(accuracies) == 1:
        return "singleton"
    correct = sum(bool(a) for a in accuracies)
    if correct == len(accuracies):
        return "all_correct"
    if correct == 0:
        return "all_wrong"
    return "mixed"


@dataclass
class BatchCollector(Generic[G]):
    """Collects the informative groups of one training batch, admitted in the order their prompts were drawn.

    Groups are numbered by submission (0, 1, 2, ...) but complete out of order: a group is done when its
    slowest sample is. Admitting groups as they complete, then aborting the rest once the batch is full,
    would favour prompts whose samples are all short, and the slow groups it leaves out are the ones with
    long, rambling or truncated samples, which tend to carry the overlong penalty and the negative
    advantage of wrong answers. So `offer` judges a group the moment it completes but admits it only once
    every earlier index is resolved: the batch is the first `target_groups` informative groups in draw order,
    the set the batch-synchronous recipe picks too, whatever the timing.

    `carry_in(index, group)` places a group judged in an earlier step. Once `full`, nothing more is
    admitted; `leftover()` holds what was resolved past the batch, for the driver to carry over.
    """

    target_groups: int
    kept: list[G] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    _resolved: dict[int, G | None] = field(default_factory=dict)
    """Groups completed ahead of their turn (None: dropped by the filter)."""
    _next: int = 0
    """The lowest index not yet admitted or skipped."""

    def __post_init__(self) -> None:
        if self.target_groups < 1:
            raise ValueError(f"target_groups must be >= 1; got {self.target_groups}")

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target_groups

    def offer(self, index: int, group: G, accuracies: Sequence[bool]) -> str:
        """Judge the group drawn `index`-th; returns its reason. Informative groups wait for their turn."""
        reason = self._judge(accuracies)
        self._resolve(index, group if reason in KEEP_REASONS else None)
        return reason

    def take(self, group: G, accuracies: Sequence[bool]) -> str:
        """Keep `group` whatever it is (dynamic sampling off), judging it only for the metrics: `keep_ratio`
        is then the share of trained groups that carry a gradient."""
        reason = self._judge(accuracies)
        self.kept.append(group)
        return reason

    def _judge(self, accuracies: Sequence[bool]) -> str:
        reason = judge_group(accuracies)
        self.reasons[reason] += 1
        return reason

    def carry_in(self, index: int, group: G) -> None:
        """Place an informative group judged in an earlier step at position `index`."""
        self.reasons["carried_over"] += 1
        self._resolve(index, group)

    def leftover(self) -> dict[int, G | None]:
        """Groups resolved past the point where the batch filled, by index (None: dropped by the filter)."""
        return dict(self._resolved)

    def _resolve(self, index: int, group: G | None) -> None:
        if index < self._next or index in self._resolved:
            raise ValueError(f"group {index} was already resolved")
        self._resolved[index] = group
        while not self.full and self._next in self._resolved:
            admitted = self._resolved.pop(self._next)
            self._next += 1
            if admitted is not None:
                self.kept.append(admitted)

    def metrics(self) -> dict[str, Any]:
        judged = sum(self.reasons[r] for r in (*KEEP_REASONS, *DROP_REASONS))
        informative = sum(self.reasons[r] for r in KEEP_REASONS)
        return {
            "kept_groups": len(self.kept),
            "judged_groups": judged,
            "keep_ratio": informative / judged if judged else 0.0,
            **{f"drop_{reason}": self.reasons[reason] for reason in DROP_REASONS},
            "carried_over": self.reasons["carried_over"],
        }
