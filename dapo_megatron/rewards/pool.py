"""Score many samples in worker processes, with a per-sample timeout.

Model output is arbitrary text, and some answers make a scorer slow (sympy) or crash it. The pool
keeps the training job alive: a sample that runs past ``timeout_s`` has its worker killed and
replaced and scores as wrong (status ``"timeout"``); a scorer exception, or a worker that dies,
scores as wrong (status ``"error"``). Callers turn the statuses into ``reward/timeouts`` and
``reward/errors`` with :func:`status_counts`. Only a reward service that cannot score at all
(:class:`~dapo_megatron.rewards.endpoint.RewardServiceError`) stops the scoring: every sample would fail.

Workers are long-lived and receive small chunks of samples; each result comes back on its own so
the parent always knows which sample a worker is on and when it started. Workers are started
with ``forkserver`` where available, else ``spawn``: the trainer runs torch with threads, and
forking such a process is unsafe. As with any non-fork start method, the entry script must keep
its top level under ``if __name__ == "__main__":``.

Use the pool as a context manager so that workers are stopped on every exit path::

    with RewardPool(RewardConfig()) as pool:
        results = pool.score([RewardItem(text, "540", "math_dapo"), ...])
"""

import contextlib
import ctypes
import functools
import math
import multiprocessing
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Literal, NamedTuple

from dapo_megatron.rewards.config import RewardConfig
from dapo_megatron.rewards.endpoint import RewardServiceError
from dapo_megatron.rewards.registry import score_sample

__all__ = ["RewardItem", "RewardPool", "RewardResult", "ScoreFn", "Status", "status_counts"]

ScoreFn = Callable[[str, str, str], Mapping[str, object]]
"""``(solution, ground_truth, data_source) -> {"acc": bool, "pred": str}``; other types (``acc="False"``,
``acc=1``) score as errors. It must be picklable
(a module-level function or a ``functools.partial`` of one) to reach the workers, and it runs in
a daemonic process, so it cannot start processes of its own."""

Status = Literal["ok", "timeout", "error"]
_Outcome = (
    Status | Literal["unavailable"]
)  # a worker's report; "unavailable" (the reward service) stops score()

_MAX_CHUNK = 16  # samples per message: amortises IPC while keeping the load balanced
_CHUNKS_PER_WORKER = 4
_STARTUP_TIMEOUT_S = 120.0  # a fresh worker imports the scorer modules; generous on a busy node
_JOIN_TIMEOUT_S = 5.0
_READY = "ready"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class RewardItem(NamedTuple):
    """One sample to grade."""

    solution: str
    ground_truth: str
    data_source: str = ""


@dataclass(frozen=True, slots=True)
class RewardResult:
    """The grade of one sample. ``score`` is ``correct_score`` iff ``acc``, else ``wrong_score``."""

    score: float
    acc: bool
    pred: str
    status: Status
    error: str = ""
    """Why the sample was not scored normally (exception text, or the timeout); empty when ok."""


def status_counts(results: Iterable[RewardResult]) -> dict[str, int]:
    """``{"reward/timeouts": n, "reward/errors": m}`` for a batch of results."""
    statuses = [result.status for result in results]
    return {"reward/timeouts": statuses.count("timeout"), "reward/errors": statuses.count("error")}


def _checked_output(output: object) -> tuple[bool, str]:
    # bool("False") is True: a scorer returning the wrong types must not turn into rewards.
    if not isinstance(output, Mapping) or "acc" not in output:
        raise TypeError(f"scorer must return a mapping with an 'acc' key; got {output!r:.200}")
    acc, pred = output["acc"], output.get("pred", "")
    if not isinstance(acc, bool):
        raise TypeError(f"scorer returned acc={acc!r:.100} of type {type(acc).__name__}; it must be a bool")
    if not isinstance(pred, str):
        raise TypeError(f"scorer returned pred of type {type(pred).__name__}; it must be a str")
    return acc, pred


def _grade(score_fn: ScoreFn, item: RewardItem) -> tuple[_Outcome, bool, str, str]:
    try:
        acc, pred = _checked_output(score_fn(item.solution, item.ground_truth, item.data_source))
        return "ok", acc, pred, ""
    except RewardServiceError as error:
        return "unavailable", False, "", str(error)
    except Exception as error:  # any scorer bug must cost one sample, not the job
        return "error", False, "", f"{type(error).__name__}: {error}"


def _die_with_parent() -> None:
    # If the trainer is SIGKILLed, close() never runs. On Linux ask the kernel to kill this worker
    # when its parent goes (with forkserver that is the fork server, which itself exits when the
    # trainer does), so a worker stuck in a GIL-holding loop cannot outlive the job.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _worker_main(connection: Connection, score_fn: ScoreFn) -> None:
    _die_with_parent()
    # Ctrl-C reaches the whole process group; the trainer handles it and closes the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        connection.send(_READY)
        while (chunk := connection.recv()) is not None:
            for index, item in chunk:
                connection.send((index, *_grade(score_fn, item)))
    except (EOFError, ConnectionError):  # the trainer is gone (a SIGKILL): nothing to report to
        return


@dataclass
class _Worker:
    process: BaseProcess
    connection: Connection
    ready: bool = False
    in_flight: deque[int] = field(default_factory=deque)  # sent, not yet answered, in order
    deadline: float = math.inf  # for the first in-flight sample, or for start-up


class RewardPool:
    """Grades samples in ``config.num_workers`` processes with a per-sample timeout.

    With ``num_workers=0`` samples are graded in the calling process: scorer exceptions still
    count as errors, but **no timeout is enforced** (a hanging scorer hangs the caller).

    Args:
        config: worker count, timeout and the correct/wrong scores.
        score_fn: grading function; defaults to the user's ``config.function`` / ``config.function_file``
            if set (:mod:`~dapo_megatron.rewards.custom`), else the service at ``config.endpoint``
            (:mod:`~dapo_megatron.rewards.endpoint`), else
            :func:`~dapo_megatron.rewards.registry.score_sample` with ``config``.
    """

    def __init__(self, config: RewardConfig, score_fn: ScoreFn | None = None) -> None:
        self._config = config
        self._score_fn: ScoreFn = (
            score_fn
            or config.custom_function()
            or config.reward_endpoint()
            or functools.partial(score_sample, config=config)
        )
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        self._context = multiprocessing.get_context(method)
        self._workers: list[_Worker] = []
        self._closed = False
        try:
            for _ in range(config.num_workers):
                self._workers.append(self._start_worker())
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def score(self, items: Sequence[RewardItem | tuple[str, str, str]]) -> list[RewardResult]:
        """Grade ``items`` (``(solution, ground_truth, data_source)``), returning results in order.

        If this raises (e.g. KeyboardInterrupt, or a worker that cannot start), the pool is closed.

        Raises:
            RewardServiceError: the reward endpoint cannot score (unreachable after its retries, or refusing).
        """
        if self._closed:
            raise RuntimeError("RewardPool.score called after close()")
        batch = [RewardItem(*item) for item in items]
        if not self._workers:
            return [self._result(*_grade(self._score_fn, item)) for item in batch]
        try:
            return self._score_in_workers(batch)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop all workers (idle ones politely, busy ones with SIGKILL). Safe to call twice."""
        self._closed = True
        for worker in self._workers:
            if worker.in_flight or not worker.process.is_alive():
                worker.process.kill()
            else:
                with contextlib.suppress(OSError):  # includes BrokenPipeError
                    worker.connection.send(None)
        for worker in self._workers:
            self._reap(worker)
        self._workers.clear()

    # -- internals ---------------------------------------------------------------------------
    def _result(self, status: _Outcome, acc: bool, pred: str, error: str) -> RewardResult:
        if status == "unavailable":
            raise RewardServiceError(error)
        score = self._config.correct_score if acc else self._config.wrong_score
        return RewardResult(score=score, acc=acc, pred=pred, status=status, error=error)

    def _start_worker(self) -> _Worker:
        parent_end, child_end = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main, args=(child_end, self._score_fn), name="reward-worker", daemon=True
        )
        try:
            process.start()
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()  # only the child uses it; closing ours lets recv() see EOF
        return _Worker(process, parent_end, deadline=time.monotonic() + _STARTUP_TIMEOUT_S)

    def _reap(self, worker: _Worker) -> None:
        worker.process.join(_JOIN_TIMEOUT_S)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.connection.close()
        worker.process.close()

    def _replace(self, worker: _Worker) -> None:
        worker.process.kill()
        self._reap(worker)
        self._workers[self._workers.index(worker)] = self._start_worker()

    def _score_in_workers(self, batch: list[RewardItem]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(batch)
        pending = deque(range(len(batch)))
        chunk_size = max(
            1, min(_MAX_CHUNK, math.ceil(len(batch) / (len(self._workers) * _CHUNKS_PER_WORKER)))
        )
        timeout_s = self._config.timeout_s
        while pending or any(worker.in_flight for worker in self._workers):
            for worker in self._workers:
                if worker.ready and not worker.in_flight and pending:
                    indices = [pending.popleft() for _ in range(min(chunk_size, len(pending)))]
                    worker.in_flight.extend(indices)
                    # A worker that died while idle breaks the pipe; _collect then sees it dead
                    # and reschedules the chunk.
                    with contextlib.suppress(OSError):
                        worker.connection.send([(index, batch[index]) for index in indices])
                    worker.deadline = time.monotonic() + timeout_s
            waiting = [worker for worker in self._workers if worker.in_flight or not worker.ready]
            next_deadline = min(worker.deadline for worker in waiting)
            wait(
                [worker.connection for worker in waiting] + [worker.process.sentinel for worker in waiting],
                timeout=max(0.0, next_deadline - time.monotonic()),
            )
            for worker in waiting:
                self._collect(worker, results, pending, timeout_s)
        finished = [result for result in results if result is not None]
        assert len(finished) == len(batch), "every sample is either scored or rescheduled"
        return finished

    def _collect(
        self, worker: _Worker, results: list[RewardResult | None], pending: deque[int], timeout_s: float
    ) -> None:
        """Take the worker's finished results, then handle its death or an expired deadline."""
        try:
            while worker.connection.poll():
                message = worker.connection.recv()
                if message == _READY:
                    worker.ready, worker.deadline = True, math.inf
                    continue
                index, status, acc, pred, error = message
                results[index] = self._result(status, acc, pred, error)
                worker.in_flight.popleft()
                worker.deadline = time.monotonic() + timeout_s if worker.in_flight else math.inf
        except (EOFError, OSError):  # it died mid-message; the sentinel check below handles it
            pass
        alive = worker.process.is_alive()
        if alive and time.monotonic() < worker.deadline:
            return
        if not worker.ready:  # a broken scorer setup, not a bad sample: stop (score() closes us)
            reason = "did not start in time" if alive else f"exited with code {worker.process.exitcode}"
            raise RuntimeError(
                f"reward worker {reason} before it was ready; check that the scorer and its "
                "module import cleanly in a fresh process"
            )
        if worker.in_flight:
            stuck = worker.in_flight.popleft()
            if alive:
                results[stuck] = self._result(
                    "timeout", False, "", f"scoring took longer than {timeout_s} s; worker killed"
                )
            else:
                results[stuck] = self._result(
                    "error", False, "", f"reward worker died (exit code {worker.process.exitcode})"
                )
            pending.extendleft(reversed(worker.in_flight))  # the rest of its chunk goes to others
            worker.in_flight.clear()
        self._replace(worker)
