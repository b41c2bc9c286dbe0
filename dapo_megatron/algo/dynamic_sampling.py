"""DAPO's dynamic sampling: keep only prompt groups whose samples disagree, until the batch is full.

A group whose G samples are all right (or all wrong) has zero GRPO advantage everywhere, so it adds
nothing to the gradient but still dilutes the token-mean. DAPO drops such groups and keeps generating
until `target_groups` informative groups are collected (paper Eq. 11: 0 < |correct| < G).

The filter looks at raw accuracy, never at the shaped reward: the overlong penalty gives an all-wrong
group a spread of rewards and would let it through. Singleton groups (G = 1) are kept, as in verl.

`BatchCollector` is the streaming form used by the driver: it judges each group the moment it is
scored, stops accepting once the batch is full, and keeps surplus informative groups (groups that were
already generated when the batch filled up) for the next step instead of throwing that compute away.
Pure Python; the driver owns generation and aborting.
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
    """Collects informative groups for one training batch.

    `carry` holds groups left over from the previous step; they fill the batch first (they were judged
    already). `offer(group, accuracies)` judges a freshly scored group. Once `full`, further informative
    groups go to `surplus`, which the driver passes on as the next step's carry (bounded by
    `max_carry`, so a very easy/hard dataset cannot grow it without limit).
    """

    target_groups: int
    carry: list[G] = field(default_factory=list)
    max_carry: int | None = None
    kept: list[G] = field(default_factory=list)
    surplus: list[G] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.target_groups < 1:
            raise ValueError(f"target_groups must be >= 1; got {self.target_groups}")
        take = min(len(self.carry), self.target_groups)
        self.kept.extend(self.carry[:take])
        self.surplus.extend(self.carry[take:])
        self.reasons["carried_over"] += take
        self.carry = []

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target_groups

    @property
    def missing(self) -> int:
        return max(self.target_groups - len(self.kept), 0)

    def offer(self, group: G, accuracies: Sequence[bool]) -> str:
        """Judge a scored group; returns its reason. Informative groups beyond the target become surplus."""
        reason = judge_group(accuracies)
        self.reasons[reason] += 1
        if reason in KEEP_REASONS:
            (self.surplus if self.full else self.kept).append(group)
        return reason

    def next_carry(self) -> list[G]:
        """Surplus groups for the next step, oldest first, at most `max_carry`."""
        limit = len(self.surplus) if self.max_carry is None else self.max_carry
        dropped = len(self.surplus) - min(limit, len(self.surplus))
        self.reasons["surplus_discarded"] += dropped
        return self.surplus[:limit]

    def metrics(self) -> dict[str, Any]:
        judged = sum(self.reasons[r] for r in (*KEEP_REASONS, *DROP_REASONS))
        informative = sum(self.reasons[r] for r in KEEP_REASONS)
        return {
            "kept_groups": len(self.kept),
            "judged_groups": judged,
            "keep_ratio": informative / judged if judged else 0.0,
            **{f"drop_{reason}": self.reasons[reason] for reason in DROP_REASONS},
            "carried_over": self.reasons["carried_over"],
            "surplus": len(self.surplus),
        }
