"""A reward service over HTTP (``reward.endpoint=http://host:port/path``), for graders that live outside the
job (a sandbox running code, a model judge, a shared verifier), as verl's and slime's remote rewards.

Each sample is POSTed on its own as JSON with the keywords of a custom reward function
(:mod:`~dapo_megatron.rewards.custom`), so a service can call such a function with the body as it is::

    {"data_source": "math_dapo", "solution_str": "... Answer: 540", "ground_truth": "540"}

and the reply is what such a function returns: ``true`` / ``false``, or ``{"acc": bool, "pred": str}``
(``pred`` optional). The reward is ``reward.correct_score`` or ``reward.wrong_score``. Requests run in the
reward pool's workers, under its per-sample ``reward.timeout_s``.

Failures, by whose they are:

* transient (no connection, no reply within ``reward.endpoint_timeout_s``, HTTP 429 or 5xx): retried up to
  ``reward.endpoint_retries`` times, after ``reward.endpoint_backoff_s`` x 1, 2, 4, ... seconds;
* the service's (still failing after the retries, or another HTTP error such as 404 for a wrong path): no
  sample can be scored, so :class:`RewardServiceError` names the endpoint and the pool stops the job;
* the sample's (a reply that is not JSON, or not a verdict of the right types): that sample scores wrong and
  counts in ``reward/errors``, as a scorer bug does.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from dapo_megatron.rewards.custom import as_verdict

if TYPE_CHECKING:
    import requests

__all__ = ["TRANSIENT_STATUS", "RewardEndpoint", "RewardServiceError", "check_url"]

TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
"""HTTP statuses worth retrying: the service is overloaded, restarting or behind a proxy that lost it."""


class RewardServiceError(RuntimeError):
    """The reward endpoint cannot score any sample: unreachable after its retries, or refusing requests."""


def check_url(url: str) -> None:
    """Raises ValueError unless `url` is an http(s) URL with a host (checked when the config is read)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"reward.endpoint={url!r} must be an http:// or https:// URL with a host")


@dataclass(frozen=True)
class RewardEndpoint:
    """The pool's ``ScoreFn`` for a reward service: ``(solution, ground_truth, data_source)`` -> verdict.
    Picklable: only these settings travel to the workers; each keeps its own connection pool."""

    url: str
    timeout_s: float
    retries: int
    backoff_s: float

    def worst_case_s(self) -> float:
        """Seconds one sample may take before its last attempt gives up: every attempt waits for its full
        timeout, plus the waits between them."""
        return (self.retries + 1) * self.timeout_s + self.backoff_s * (2**self.retries - 1)

    def __call__(self, solution: str, ground_truth: str, data_source: str) -> Mapping[str, object]:
        body = {"data_source": data_source, "solution_str": solution, "ground_truth": ground_truth}
        reply = self._post(body)
        try:
            output = reply.json()
        except ValueError:
            text = reply.text
            raise ValueError(f"reward endpoint {self.url} replied with no JSON: {text!r:.200}") from None
        return as_verdict(output, f"reward endpoint {self.url}")

    def _post(self, body: dict[str, str]) -> requests.Response:
        """The service's 2xx reply to `body`, after retrying transient failures."""
        import requests  # in the workers only: importing the rewards package stays standard-library only

        failures: list[str] = []
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                reply = _session().post(self.url, json=body, timeout=self.timeout_s)
            except requests.Timeout:
                failures.append(f"no reply within reward.endpoint_timeout_s={self.timeout_s} s")
                continue
            except requests.ConnectionError as error:
                failures.append(f"no connection: {error}")
                continue
            if reply.ok:
                return reply
            failure = f"HTTP {reply.status_code} {reply.reason}: {reply.text.strip()!r:.200}"
            if reply.status_code not in TRANSIENT_STATUS:
                raise RewardServiceError(
                    f"reward.endpoint={self.url} answered {failure}; check the URL, and that the service "
                    "takes POSTed JSON {data_source, solution_str, ground_truth}"
                )
            failures.append(failure)
        raise RewardServiceError(
            f"reward.endpoint={self.url} is unavailable: {len(failures)} attempts failed "
            f"(reward.endpoint_retries={self.retries}), the last with {failures[-1]}"
        )


@functools.cache
def _session() -> requests.Session:
    """This process's connection pool (keep-alive to the service), made at the first request of each worker
    (workers are started, not forked from a process that used one)."""
    import requests

    return requests.Session()
