"""Configuration of reward scoring (the ``reward`` group)."""

import math
from dataclasses import dataclass
from pathlib import Path

from dapo_megatron.rewards.custom import CustomRewardFunction
from dapo_megatron.rewards.endpoint import RewardEndpoint, check_url
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

    endpoint: str | None = None
    """A reward service's URL (``http://host:port/path``) instead of ``scorer`` or a function: each sample is
    POSTed as JSON ``{"data_source", "solution_str", "ground_truth"}`` and the reply is a bool or
    ``{"acc": bool, "pred": str}``. Protocol, retries and errors: ``rewards.endpoint``."""

    endpoint_timeout_s: float = 2.0
    """Seconds a request to ``endpoint`` waits for the connection, and for its reply, before it counts as
    failed (and is retried)."""

    endpoint_retries: int = 2
    """Retries of a request that failed transiently (no connection, no reply in time, HTTP 429 or 5xx); after
    them the job stops with an error naming the endpoint. All attempts must fit in ``timeout_s``."""

    endpoint_backoff_s: float = 0.5
    """Wait before the first retry; each further retry waits twice as long as the one before."""

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
        chosen = [
            f"reward.{name}={getattr(self, name)}"
            for name in ("function", "function_file", "endpoint")
            if getattr(self, name) is not None
        ]
        if len(chosen) > 1:
            raise ValueError(f"{' and '.join(chosen)} each choose how samples are graded; keep one")
        custom = self.custom_function(resolve=False)  # messages show the path as the user wrote it
        if custom is not None:
            custom.load()  # a wrong path or name is reported now, not by every worker at the first batch
        endpoint = self.reward_endpoint()
        if endpoint is not None:
            self._check_endpoint(endpoint)
        if self.correct_score <= self.wrong_score:
            raise ValueError(
                "reward.correct_score must be greater than reward.wrong_score; got "
                f"correct_score={self.correct_score}, wrong_score={self.wrong_score} (swapped?)"
            )

    def _check_endpoint(self, endpoint: RewardEndpoint) -> None:
        check_url(endpoint.url)
        if not (math.isfinite(self.endpoint_timeout_s) and self.endpoint_timeout_s > 0):
            raise ValueError(
                f"reward.endpoint_timeout_s must be a finite number > 0; got {self.endpoint_timeout_s}"
            )
        if not (math.isfinite(self.endpoint_backoff_s) and self.endpoint_backoff_s >= 0):
            raise ValueError(
                f"reward.endpoint_backoff_s must be a finite number >= 0; got {self.endpoint_backoff_s}"
            )
        if self.endpoint_retries < 0:
            raise ValueError(f"reward.endpoint_retries must be >= 0; got {self.endpoint_retries}")
        worst = endpoint.worst_case_s()
        if worst >= self.timeout_s:
            # Past it the pool kills the worker and counts a timeout: the service's error would be lost.
            raise ValueError(
                f"reward.endpoint: {self.endpoint_retries + 1} attempts of reward.endpoint_timeout_s="
                f"{self.endpoint_timeout_s} s and their back-off take up to {worst:.1f} s, not less than "
                f"reward.timeout_s={self.timeout_s} (the limit per sample); raise reward.timeout_s or lower "
                "reward.endpoint_timeout_s / reward.endpoint_retries"
            )

    def reward_endpoint(self) -> RewardEndpoint | None:
        """The reward service, if ``endpoint`` is set."""
        if self.endpoint is None:
            return None
        return RewardEndpoint(
            self.endpoint, self.endpoint_timeout_s, self.endpoint_retries, self.endpoint_backoff_s
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
