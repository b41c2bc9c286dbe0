"""Reward scoring: DAPO's math scorer, an optional safe symbolic check, and a process pool.

* :mod:`.math_dapo` - DAPO's exact-match ``Answer:`` scorer (the reward of the paper).
* :mod:`.symbolic` - lenient equivalence through a small eval-free LaTeX parser (sympy, lazily).
* :mod:`.registry` - which scorer grades which ``data_source``.
* :mod:`.custom` - a user's own reward function, by import path or file (example: :mod:`.example`).
* :mod:`.endpoint` - a reward service over HTTP, with timeouts and retries.
* :mod:`.pool` - grading in worker processes with a per-sample timeout.
* :mod:`.config` - :class:`RewardConfig` (the ``reward`` config group).

Importing this package loads only the standard library. The modules depend one way: ``config`` on
``registry`` (the scorer names), ``custom`` and ``endpoint`` (which uses ``custom``'s verdict check),
``registry`` on the scorers, ``pool`` on ``config``, ``endpoint`` and ``registry``.
"""

from dapo_megatron.rewards.config import RewardConfig
from dapo_megatron.rewards.math_dapo import compute_score
from dapo_megatron.rewards.pool import RewardItem, RewardPool, RewardResult, status_counts
from dapo_megatron.rewards.symbolic import is_equivalent

__all__ = [
    "RewardConfig",
    "RewardItem",
    "RewardPool",
    "RewardResult",
    "compute_score",
    "is_equivalent",
    "status_counts",
]
