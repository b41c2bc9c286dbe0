"""Which scorer grades which sample.

A scorer is a plain function ``(solution, ground_truth, config) -> {"acc": bool, "pred": str}``.
Scorers only decide correctness; :class:`~dapo_megatron.rewards.pool.RewardPool` turns ``acc``
into ``config.correct_score`` / ``config.wrong_score``, so every task, timeout and error shares
one reward scale.

Worker processes look scorers up by name in the tables below, which they build when they
import this module; entries added at run time in the trainer process would not reach them. To
add a task, write its scorer in its own module (importing only torch, numpy and the standard
library at import time), add it to :data:`SCORERS`, and route its ``data_source`` values in
:data:`DATA_SOURCE_SCORERS` or :data:`DATA_SOURCE_PREFIXES`.

Routing follows verl's ``default_compute_score`` (0.9.1) for the math sources: ``math_dapo``,
``math``, ``math_dapo_reasoning`` and every ``aime*`` source use DAPO's scorer.
"""

from collections.abc import Callable, Mapping
from typing import Protocol

import dapo_megatron.rewards.math_dapo as math_dapo
import dapo_megatron.rewards.symbolic as symbolic

__all__ = [
    "AUTO",
    "DATA_SOURCE_PREFIXES",
    "DATA_SOURCE_SCORERS",
    "SCORERS",
    "Scorer",
    "ScorerSettings",
    "score_math_dapo",
    "score_sample",
    "scorer_name_for",
]


class ScorerSettings(Protocol):
    """What a scorer reads of the ``reward`` config (``rewards.config.RewardConfig``, which imports this
    module for the scorer names it accepts)."""

    scorer: str
    boxed_fallback: bool
    symbolic_equivalence: bool
    timeout_s: float


Scorer = Callable[[str, str, ScorerSettings], Mapping[str, object]]

AUTO = "auto"
"""``RewardConfig.scorer`` value that picks the scorer per sample from its ``data_source``."""


def score_math_dapo(solution: str, ground_truth: str, config: ScorerSettings) -> dict[str, object]:
    """DAPO's scorer, with the optional boxed fallback and symbolic second chance from ``config``."""
    result = math_dapo.compute_score(solution, ground_truth, boxed_fallback=config.boxed_fallback)
    acc, pred = result["acc"], result["pred"]
    if config.symbolic_equivalence and not acc and pred != math_dapo.INVALID:
        # Half the pool's per-sample budget, so a slow sympy check gives up with a clean "wrong"
        # before the pool has to kill the worker and count a timeout.
        acc = symbolic.is_equivalent(
            pred, math_dapo.normalize_final_answer(ground_truth), timeout_s=config.timeout_s / 2
        )
    return {"acc": acc, "pred": pred}


SCORERS: dict[str, Scorer] = {"math_dapo": score_math_dapo}
"""Scorer name -> scorer function."""

DATA_SOURCE_SCORERS: dict[str, str] = {
    "math_dapo": "math_dapo",
    "math": "math_dapo",
    "math_dapo_reasoning": "math_dapo",
    # data.formats wraps GSM8K questions in DAPO's prompt (`Answer: N` on the last line); answers are
    # integers.
    "gsm8k": "math_dapo",
}
"""Exact ``data_source`` -> scorer name."""

DATA_SOURCE_PREFIXES: tuple[tuple[str, str], ...] = (("aime", "math_dapo"),)
"""``(prefix, scorer name)`` pairs tried in order when no exact ``data_source`` entry matches."""


def scorer_name_for(data_source: str) -> str:
    """The scorer name for a ``data_source``.

    Raises:
        KeyError: if no exact entry or prefix matches (scoring an unknown task with a guessed
            scorer would silently produce wrong rewards).
    """
    if data_source in DATA_SOURCE_SCORERS:
        return DATA_SOURCE_SCORERS[data_source]
    for prefix, name in DATA_SOURCE_PREFIXES:
        if data_source.startswith(prefix):
            return name
    known = sorted(DATA_SOURCE_SCORERS) + [f"{prefix}*" for prefix, _ in DATA_SOURCE_PREFIXES]
    raise KeyError(
        f"no reward scorer for data_source {data_source!r}; known: {', '.join(known)}. "
        f"Route it in dapo_megatron/rewards/registry.py or set reward.scorer to one of {sorted(SCORERS)}"
    )


def score_sample(solution: str, ground_truth: str, data_source: str, *, config: ScorerSettings) -> dict:
    """Grade one sample with ``config.scorer`` (or, for ``"auto"``, the scorer of its data source).

    Returns:
        ``{"acc": bool, "pred": str}``.
    """
    name = scorer_name_for(data_source) if config.scorer == AUTO else config.scorer
    return dict(SCORERS[name](solution, ground_truth, config))
