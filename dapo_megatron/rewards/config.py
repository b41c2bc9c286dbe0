"""Configuration of reward scoring (the ``reward`` group)."""

import math
from dataclasses import dataclass

from dapo_megatron.rewards.registry import AUTO, SCORERS

__all__ = ["RewardConfig"]


@dataclass
class RewardConfig:
    """How finished samples are graded and which rewards they get."""

    scorer: str = "math_dapo"
    """Scorer for every sample (a name in ``rewards.registry.SCORERS``), or ``"auto"`` to pick one
    per sample from its ``data_source``. DAPO trains and evaluates with ``"math_dapo"``."""

    boxed_fallback: bool = False
    """When a response has no ``Answer:`` line, grade its last ``\\boxed{}`` instead (verl 0.9.1
    behaviour). DAPO's own scorer does not do this."""

    symbolic_equivalence: bool = False
    """Give an answer that fails DAPO's exact string match a second chance through the safe sympy
    check in ``rewards.symbolic`` (``0.5`` = ``\\frac{1}{2}``). Off in DAPO."""

    num_workers: int = 2
    """Scoring processes. 0 scores in the calling process, without timeouts (tests, debugging)."""

    timeout_s: float = 10.0
    """Per-sample time limit; a sample over it is killed and gets ``wrong_score``."""

    correct_score: float = 1.0
    """Reward of a correct answer (DAPO: +1)."""

    wrong_score: float = -1.0
    """Reward of a wrong, missing, timed-out or crashed answer (DAPO: -1)."""

    def __post_init__(self) -> None:
        choices = [*SCORERS, AUTO]
        if self.scorer not in choices:
            raise ValueError(f"reward.scorer must be one of {choices}; got {self.scorer!r}")
        if self.num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0 (0 scores in-process); got {self.num_workers}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"reward.timeout_s must be a finite number > 0; got {self.timeout_s}")
        for name in ("correct_score", "wrong_score"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"reward.{name} must be finite; got {getattr(self, name)}")
        if self.correct_score <= self.wrong_score:
            raise ValueError(
                "reward.correct_score must be greater than reward.wrong_score; got "
                f"correct_score={self.correct_score}, wrong_score={self.wrong_score} (swapped?)"
            )
