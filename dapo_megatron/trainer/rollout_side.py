"""The driving rank's side of rollouts: prompts, the client for every engine, the reward workers, batch
collection (`trainer/collect.py`), the batch generated ahead, the carry-over backlog, and what a checkpoint
keeps of them.

Every rank holds one (the loop's calls are the same everywhere) but only the driving rank (global rank 0)
starts it; elsewhere `collect` returns nothing and `training_batch` receives the driving rank's rows.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from dapo_megatron.config import JobConfig
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.records import Drawn, PolicyRows, Prompt, ScoredGroup
from dapo_megatron.rewards.pool import RewardPool
from dapo_megatron.rollout.client import RolloutClient
from dapo_megatron.trainer.batch import build_rows, policy_lag
from dapo_megatron.trainer.collect import CollectCancelled, RolloutManager
from dapo_megatron.trainer.cpu_threads import TrainerThreads
from dapo_megatron.trainer.evaluate import evaluate
from dapo_megatron.trainer.fleet import rollout_config
from dapo_megatron.trainer.prompts import build_prompt_sources

Batch = tuple[list[ScoredGroup], dict[str, float]]
"""A training batch's groups and its rollout metrics."""

STOP_POLL_S = 1.0
"""How often a generation looks for a stop request: against a time-limit lead of minutes, a second is free."""


@contextlib.contextmanager
def _watch(condition: Callable[[], bool], action: Callable[[], None]) -> Iterator[None]:
    """Call `action` once, from a thread, as soon as `condition` holds while the block runs."""
    done = threading.Event()

    def poll() -> None:
        while not done.wait(STOP_POLL_S):
            if condition():
                action()
                return

    watcher = threading.Thread(target=poll, name="stop-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


class RolloutSide:
    def __init__(self, job: JobConfig, layout: ParallelLayout, tokenizer: Any) -> None:
        self.job, self.layout, self.tokenizer = job, layout, tokenizer
        self.pad_token_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.stop_token_ids = [tokenizer.eos_token_id]
        self.client: RolloutClient | None = None
        self.rewards: RewardPool | None = None
        self.manager: RolloutManager | None = None
        self.eval_prompts: list[Prompt] | None = None
        """The evaluation problems (driving rank, once started)."""
        self._prompt_state: dict[str, Any] | None = None
        self._backlog: list[Drawn] = []
        self._ahead: Future[Batch] | None = None
        """The next batch, generated during the current update (trainer.overlap_rollout)."""
        self._ahead_worker: ThreadPoolExecutor | None = None
        self._interrupted: dict[str, Any] | None = None
        """What a checkpoint keeps after a stop request interrupted a `collect`: the state it began from."""

    def restore(self, shared: dict[str, Any] | None) -> None:
        """Take the prompt stream's position, the backlog and the batch generated ahead from a checkpoint's
        shared state (`Policy.load_initial_state`; None: start afresh). Before `start`."""
        if shared is None:
            return
        # Checkpoints older than the backlog carried finished groups without their prompts: start afresh.
        self._prompt_state, self._backlog = shared["prompts"], shared.get("backlog", [])
        if shared.get("ahead") is not None:  # generated ahead before the checkpoint: trained on next
            self._ahead = Future()
            self._ahead.set_result(shared["ahead"])

    def start_rewards(self) -> None:
        """The reward workers (driving rank), before the engines are ready: each imports its scorer modules
        (seconds on a CPU), which would otherwise delay the first batch's scores."""
        if self.rewards is None:
            self.rewards = RewardPool(self.job.reward)

    def start(self, urls: list[str], on_error: Callable[[str], None]) -> None:
        """The client for the engines at `urls`, the reward workers (unless `start_rewards` started them)
        and the prompt streams (driving rank)."""
        job = self.job
        rollout = rollout_config(job)
        self.client = RolloutClient(urls, rollout, on_error=on_error)
        self.start_rewards()
        train, self.eval_prompts = build_prompt_sources(job, self.tokenizer)
        if self._prompt_state is not None:
            train.load_state_dict(self._prompt_state)
        self.manager = RolloutManager(
            self.client,
            self.rewards,
            train,
            rollout=rollout,
            trainer=job.trainer,
            decode=self.decode,
            stop_token_ids=self.stop_token_ids,
            progress=True,
        )
        self.manager.backlog = self._backlog

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ what the loop calls

    def collect(self, stop_seen: Callable[[], bool] = lambda: False) -> Batch | tuple[None, dict[str, float]]:
        """The next batch's groups and rollout metrics (driving rank; None elsewhere): the batch generated
        ahead during the last update if there is one, else generated now.

        A generation of many rounds can outlast the time-limit signal's lead, so while it runs `stop_seen`
        (this process's view of a stop request) is polled: once it holds, the requests in flight are
        aborted and the groups come back as None. The prompt stream and the backlog are then what they were
        when this step began (`state_dict`), so the checkpoint of the previous step resumes with this one's
        prompts and none is lost."""
        if not self.layout.is_logging_rank:
            return None, {}
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            return ahead.result()
        # What this step begins from, kept as it is: the position is a fresh dict, and `collect` replaces the
        # backlog list rather than changing it (its entries are frozen records).
        step_start = self.state_dict()
        with _watch(stop_seen, self.manager.cancel):
            try:
                return self.manager.collect()
            except CollectCancelled:
                if not stop_seen():
                    raise
        self._interrupted = step_start
        return None, {}

    def training_batch(
        self, groups: list[ScoredGroup] | None, step: int
    ) -> tuple[PolicyRows, dict[str, float]] | None:
        """Rewards, advantages and token tensors built on the driving rank, handed to every rank, for rollout
        step `step` (which trains the weights pushed after step - 1). Collective. None on every rank when a
        stop request interrupted the driving rank's `collect`."""
        objects: list[Any] = [None]
        if self.layout.is_logging_rank and groups is not None:
            rows, metrics = build_rows(
                groups,
                self.job.algo,
                max_response_length=self.job.rollout.max_response_length,
                pad_token_id=self.pad_token_id,
                trained_step=step - 1,
            )
            objects = [(rows, {**metrics, **policy_lag(groups, step - 1)})]
        torch.distributed.broadcast_object_list(objects, src=0)
        return objects[0]

    def generate_ahead(self, threads: TrainerThreads) -> None:
        """Start collecting the next batch in the background, with the weights the engine holds now.
        Collective in effect: every rank leaves the engine its cores until `wait_for_ahead`."""
        if self.layout.is_logging_rank:
            if self._ahead_worker is None:
                self._ahead_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
            self._ahead = self._ahead_worker.submit(self.manager.collect)
        threads.engine_generating(self._ahead)

    def wait_for_ahead(self, threads: TrainerThreads) -> float:
        """Block until the batch generated ahead is complete (the engine takes no weights while it generates);
        raises what its generation raised. Returns the seconds waited."""
        started = time.perf_counter()
        threads.trainer_waiting()
        if self._ahead is not None:
            self._ahead.result()
        threads.engine_idle()
        return time.perf_counter() - started

    def evaluate(self, stop_seen: Callable[[], bool] = lambda: False) -> dict[str, float]:
        """`trainer/evaluate.py` on the evaluation problems (driving rank; empty elsewhere). A stop request
        (`stop_seen`, polled as in `collect`) aborts it, and then it reports nothing: its aborted samples
        would count as wrong."""
        if not self.layout.is_logging_rank:
            return {}
        job = self.job
        with _watch(stop_seen, self.client.abort_all):
            metrics = evaluate(
                self.client,
                self.eval_prompts,
                self.rewards,
                job.eval,
                decode=self.decode,
                max_new_tokens=job.eval.max_response_length or job.rollout.max_response_length,
                stop_token_ids=self.stop_token_ids,
            )
        return {} if stop_seen() else metrics

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps (driving rank; None elsewhere): the prompt stream's position, the backlog
        and the batch generated ahead (waited for)."""
        if not self.layout.is_logging_rank:
            return None
        if self._interrupted is not None:
            return self._interrupted
        return {
            "prompts": self.manager.prompts.state_dict(),
            "backlog": self.manager.backlog,
            "ahead": self._ahead.result() if self._ahead is not None else None,
        }

    # ------------------------------------------------------------------ tear-down

    def stop_generating(self) -> None:
        """Stop a batch generated ahead that an error left running, and wait for it."""
        if self._ahead is not None and not self._ahead.done():
            with contextlib.suppress(
                Exception
            ):  # best effort: the error that got us here is the one to report
                self.manager.cancel()
            self._ahead.exception()
        if self._ahead_worker is not None:
            self._ahead_worker.shutdown()

    def close(self) -> None:
        for resource in (self.client, self.rewards):
            if resource is not None:
                resource.close()
