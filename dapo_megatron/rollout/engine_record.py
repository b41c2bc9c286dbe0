"""A running SGLang engine as any rank sees it, and how a dead one is told apart: `EngineRecord` (what another
rank needs to address an engine and explain its death), the liveness checks a failed request calls, and the
error that quotes the engine's log."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil
import requests

LOG_TAIL_LINES = 40
_REMOTE_HEALTH_TIMEOUT_S = 10.0


class EngineError(RuntimeError):
    """The SGLang engine could not start, died, or refused a control request."""


class Watched(Protocol):
    """An engine whose death a failed request can be blamed on: `SGLangEngine` on its own rank, `EngineRecord`
    elsewhere."""

    url: str

    def check_alive(self) -> None: ...


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file; reads at most 256 KB from its end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return "<no log file>"
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class EngineRecord:
    """A running engine as seen from another rank (picklable): the rank that drives rollouts talks to every
    engine, but only the rank that launched one holds its `SGLangEngine`."""

    url: str
    log_file: str
    host: str
    """Hostname of the launching rank."""
    processes: tuple[tuple[int, float], ...]
    """(pid, start time) of the server's guard and SGLang workers; the start time tells a reused pid
    apart."""
    api_key: str | None = field(default=None, repr=False)
    """What every request but a health check needs (`rollout/engine_auth.py`)."""

    def check_alive(self) -> None:
        """Raise EngineError with the log tail when a process of the engine is gone (checked on its own host;
        from another host: when it does not answer its health endpoint)."""
        if self.host == socket.gethostname():
            for pid, started in self.processes:
                if not _running_since(pid, started):
                    raise self._error(f"the SGLang engine died (pid {pid} is gone)")
            return
        try:
            requests.get(f"{self.url}/health", timeout=_REMOTE_HEALTH_TIMEOUT_S).raise_for_status()
        except requests.RequestException as err:
            raise self._error(f"the SGLang engine on {self.host} does not answer ({err})") from err

    def _error(self, what: str) -> EngineError:
        return EngineError(
            f"{what}; {self.url}, log {self.log_file} on {self.host}, last lines:\n"
            f"{read_log_tail(Path(self.log_file))}"
        )


def liveness_check(engines: Sequence[Watched]) -> Callable[[str], None]:
    """A `RolloutClient.on_error` hook: given the URL of the engine a request failed on, raise EngineError if
    that engine died, so the failure names the engine and quotes its log instead of a refused connection."""
    by_url = {engine.url.rstrip("/"): engine for engine in engines}

    def check(url: str) -> None:
        engine = by_url.get(url.rstrip("/"))
        if engine is not None:
            engine.check_alive()

    return check


def raise_if_any_died(engines: Sequence[Watched], failure: BaseException) -> None:
    """After `failure` of a request to some engine (a weight push, a control call): raise EngineError,
    caused by it, for the first engine that died, so the job names the engine and quotes its log."""
    for engine in engines:
        try:
            engine.check_alive()
        except EngineError as died:
            raise died from failure


def _running_since(pid: int, started: float) -> bool:
    try:
        process = psutil.Process(pid)
        return process_running(process) and process.create_time() == started
    except psutil.NoSuchProcess:
        return False


def process_running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
