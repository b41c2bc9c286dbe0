"""The API keys of the SGLang engines this process talks to, and the requests auth that sends them.

Every engine gets a random key when it is created (`SGLangEngine`), and answers nothing but its health checks
without it: on a shared cluster network anyone could otherwise replace the rollout weights, load adapters or
release memory. The process that launches an engine registers its key here; `EngineFleet.connect` registers
the keys of the job's other engines, received with their records. HTTP clients of an engine (rollout client,
weight sync, memory control) attach `ENGINE_AUTH` to their requests and so send the key of whichever engine
a request goes to; requests to an unregistered address go without one.
"""

from __future__ import annotations

import secrets
import threading
from urllib.parse import urlsplit

import requests
from requests.auth import AuthBase

_keys: dict[str, str] = {}
_lock = threading.Lock()


def new_key() -> str:
    return secrets.token_urlsafe(32)


def _address(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


def register(url: str, key: str | None) -> None:
    """Requests to `url`'s host and port carry `key` from now on (None: no key)."""
    with _lock:
        if key is None:
            _keys.pop(_address(url), None)
        else:
            _keys[_address(url)] = key


def forget(url: str) -> None:
    register(url, None)


def key_for(url: str) -> str | None:
    with _lock:
        return _keys.get(_address(url))


class _EngineAuth(AuthBase):
    """`Authorization: Bearer <key>` for the engine a request is addressed to."""

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        key = key_for(request.url or "")
        if key is not None:
            request.headers["Authorization"] = f"Bearer {key}"
        return request


ENGINE_AUTH = _EngineAuth()
"""Pass as `auth=` to `requests` calls, or set as a `requests.Session`'s `auth`."""
