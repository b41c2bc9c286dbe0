"""No orphan engines: every started engine is shut down when the trainer exits (`atexit`) or is stopped by
SIGTERM (what Slurm, torchrun and `kill` send) or SIGINT, before the previous handler runs. The engine guard
(`rollout/engine_guard.py`) covers what this cannot: a trainer that is SIGKILLed."""

from __future__ import annotations

import atexit
import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any, Protocol


class Stoppable(Protocol):
    def shutdown(self) -> None: ...


class _EngineRegistry:
    """Engines that are started and not yet shut down, for atexit and the signal handlers."""

    def __init__(self) -> None:
        self._engines: set[Stoppable] = set()
        # Reentrant: a signal handler runs on the main thread, possibly while that thread holds the lock.
        self._lock = threading.RLock()

    def add(self, engine: Stoppable) -> None:
        with self._lock:
            self._engines.add(engine)

    def discard(self, engine: Stoppable) -> None:
        with self._lock:
            self._engines.discard(engine)

    def shutdown_all(self) -> None:
        with self._lock:
            engines = list(self._engines)
        for engine in engines:
            engine.shutdown()


LIVE_ENGINES = _EngineRegistry()
atexit.register(LIVE_ENGINES.shutdown_all)


_handlers_installed = False


def install_handlers_once() -> None:
    # Python installs handlers from the main thread only; an engine launched elsewhere still has its guard.
    if not _handlers_installed and threading.current_thread() is threading.main_thread():
        install_signal_handlers()


def install_signal_handlers(signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """On each of `signals`, shut down every live engine, then do what the previous handler would have done.

    The first `SGLangEngine.launch` from the main thread calls it (Python only installs signal handlers
    there); call it yourself only to install the handlers earlier. A previous Python handler is called (for
    SIGINT: KeyboardInterrupt, so the caller's clean-up still runs); with the default action the signal is
    re-delivered so the process still dies of it; an ignored signal stays ignored, and stops nothing. A second
    signal while the engines are being shut down acts at once: their guards finish the job when the trainer
    is gone. The trainer's `distributed/stop.StopRequest`, installed later, turns SIGTERM into a request to
    checkpoint and exit at the next step boundary, after which the engines are shut down as usual.
    """
    global _handlers_installed
    _handlers_installed = True
    stopping = threading.Event()
    for signum in signals:
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:
            continue

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            if not stopping.is_set():
                stopping.set()
                try:
                    LIVE_ENGINES.shutdown_all()
                finally:
                    stopping.clear()
            if callable(previous):
                previous(signum, frame)
            else:  # the default action; None: a handler not installed from Python, treated alike
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(signum, handler)
