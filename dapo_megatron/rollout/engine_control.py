"""An SGLang server's HTTP control requests: readiness, memory release and resume, the prefix cache, the
weight version. Every request but a health check carries the engine's API key (`rollout/engine_auth.py`).
`SGLangEngine` is one, with the server process behind it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import requests

from dapo_megatron.rollout import engine_auth
from dapo_megatron.rollout.engine_record import EngineError

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""What SGLang can release and resume separately (`sglang/srt/constants.py`)."""
_CONTROL_TIMEOUT_S = 120.0  # release/resume/flush move whole model states; generous but bounded


class EngineControl:
    """Control requests to the SGLang server at `host:port`."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._session = requests.Session()
        self._session.auth = engine_auth.ENGINE_AUTH

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def check_alive(self) -> None:
        """Raise EngineError when the server is known to be dead (here nothing is known of its process;
        `SGLangEngine` checks it)."""

    def close(self) -> None:
        self._session.close()

    def generates(self, timeout: float) -> bool:
        """Whether the server answers a one-token generation within `timeout` seconds."""
        # A one-token greedy generation: 200 means the scheduler really works. Not /health_generate, which
        # does the same but sleeps a whole second before it looks for the answer. The server listens only
        # once its scheduler is up, so until then each try is a refused connection and costs nothing.
        body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        try:
            return self._session.post(f"{self.url}/generate", json=body, timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        timeout: float = _CONTROL_TIMEOUT_S,
    ) -> requests.Response:
        try:
            response = self._session.request(method, f"{self.url}{path}", json=body, timeout=timeout)
        except requests.RequestException as err:
            self.check_alive()
            raise EngineError(f"{method} {path} on the SGLang engine at {self.url} failed: {err}") from err
        if response.status_code != 200:
            raise EngineError(
                f"{method} {path} on the SGLang engine at {self.url} returned "
                f"HTTP {response.status_code}: {response.text[:2000]}"
            )
        return response

    def server_info(self) -> dict[str, Any]:
        """SGLang's resolved server arguments plus live scheduler state."""
        return self._request("GET", "/server_info").json()

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the given parts of the engine's GPU memory (all of them by default) while megatron trains.

        Needs `--enable-memory-saver` (set on CUDA); on CPU SGLang accepts the call and keeps its memory."""
        self._request("POST", "/release_memory_occupation", {"tags": _checked_tags(tags)})

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Re-occupy released memory. Resume in stages to keep the peak low: `["weights"]`, then push the
        new weights, then `["kv_cache"]` (and `["cuda_graph"]`) once the trainer's buffers are freed."""
        self._request("POST", "/resume_memory_occupation", {"tags": _checked_tags(tags)})

    def flush_cache(self, wait_s: float = 0.0) -> None:
        """Drop the prefix (radix) cache. SGLang refuses while requests are running; with `wait_s` > 0
        it waits up to that long for them to finish first."""
        self._request("POST", f"/flush_cache?timeout={wait_s:g}", timeout=_CONTROL_TIMEOUT_S + wait_s)

    def update_weight_version(self, version: str) -> None:
        """Label the served weights; every later sample carries it in `weight_version`."""
        self._request("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})


def _checked_tags(tags: Sequence[str] | None) -> list[str] | None:
    if tags is None:
        return None
    unknown = set(tags) - set(MEMORY_TAGS)
    if unknown:
        raise ValueError(f"unknown memory tags {sorted(unknown)}; choose from {MEMORY_TAGS}")
    return list(tags)
