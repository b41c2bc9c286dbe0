"""Configuration of reward scoring (the ``reward`` group)."""

import math
from dataclasses import dataclass
from pathlib import Path

from dapo_megatron.rewards.custom import CustomRewardFunction
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

    function: str | None = None
    """Your own reward function instead of ``scorer``, as ``module:function`` (importable here and in the
    reward workers). Its contract: ``rewards.custom``; an example: ``rewards.example``."""

    function_file: str | None = None
    """Your own reward function's ``.py`` file, instead of ``function``; ``function_name`` names it."""

    function_name: str = "compute_score"
    """The function in ``function_file`` (verl's default name)."""

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
        if self.function is not None and self.function_file is not None:
            raise ValueError(
                f"reward.function={self.function} and reward.function_file={self.function_file} name two "
                "reward functions; keep one"
            )
        custom = self.custom_function(resolve=False)  # messages show the path as the user wrote it
        if custom is not None:
            custom.load()  # a wrong path or name is reported now, not by every worker at the first batch
        if self.correct_score <= self.wrong_score:
            raise ValueError(
                "reward.correct_score must be greater than reward.wrong_score; got "
                f"correct_score={self.correct_score}, wrong_score={self.wrong_score} (swapped?)"
            )

    def custom_function(self, resolve: bool = True) -> CustomRewardFunction | None:
        """The user's reward function, if one is set (its file resolved against this process's directory,
        which the workers may not share, unless `resolve` is false)."""
        if self.function is not None:
            return CustomRewardFunction(import_path=self.function)
        if self.function_file is not None:
            file = Path(self.function_file).resolve() if resolve else Path(self.function_file)
            return CustomRewardFunction(file=str(file), name=self.function_name)
        return None
