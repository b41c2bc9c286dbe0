"""A CPU engine's intra-op threads, changed by the trainer while the engine runs.

On CPU the engine and the trainer compute on the same cores. While the trainer updates the policy beside a
generating engine each keeps to its own threads; while the trainer only waits for the engine (the batch it
needs next, an evaluation) the engine may take the trainer's cores too (`rollout.cpu_idle_cores`), as the
trainer takes the engine's once the engine is idle (`trainer.cpu_idle_cores`). SGLang has no request for
that, so the engine follows a small file: the trainer writes the count it wants there
(`request_threads`), and before every forward pass the engine reads it (`follow`) in the thread that runs
the forward, since under OpenMP torch's count belongs to the calling thread. A read is one `pread` of a few
bytes, next to a forward pass of milliseconds. The change takes effect at the engine's next forward pass.

The engine process finds the file through `THREADS_FILE_ENV` (set by `SGLangEngine` on CPU); without it
`follow` does nothing. It is called from the batched CPU attention backend (`backends/cpu_attention.py`), the
one piece of this project that runs on every forward pass; the stock backend (`DAPO_CPU_ATTENTION=stock`)
keeps the engine at its start-up count.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

THREADS_FILE_ENV = "DAPO_ENGINE_THREADS_FILE"
_WIDTH = 8  # bytes: the count, right-aligned; always written whole, in place, so a reader sees one count

logger = logging.getLogger(__name__)


def request_threads(path: Path, threads: int) -> None:
    """Ask the engine that follows `path` to compute on `threads` intra-op threads from its next forward
    pass."""
    if threads < 1:
        raise ValueError(f"an engine needs at least one thread; got {threads}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, f"{threads:>{_WIDTH}}".encode(), 0)
    finally:
        os.close(fd)


def _parse(raw: bytes) -> int | None:
    try:
        threads = int(raw)
    except ValueError:  # empty: created but not written yet
        return None
    return threads if threads >= 1 else None


class _Follower:
    def __init__(self, path: str) -> None:
        import torch  # here, in the engine: the trainer imports this module before it imports torch

        self._fd = os.open(path, os.O_RDONLY)
        self._get_threads, self._set_threads = torch.get_num_threads, torch.set_num_threads

    def __call__(self) -> None:
        threads = _parse(os.pread(self._fd, _WIDTH, 0))
        if threads is not None and threads != self._get_threads():
            self._set_threads(threads)
            logger.info("engine computes on %d intra-op threads", threads)


@functools.cache
def _follower() -> _Follower | None:
    path = os.environ.get(THREADS_FILE_ENV)
    return _Follower(path) if path else None


def follow() -> None:
    """In the engine, before a forward pass: take the thread count the trainer asked for, if it changed."""
    follower = _follower()
    if follower is not None:
        follower()
