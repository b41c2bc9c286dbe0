"""Collect one training batch: generate, score, filter (DAPO's dynamic sampling), on the driving rank.

Streaming mode: prompts go to the engine as request slots free up; each prompt group is scored the
moment its G samples are done and judged by raw accuracy, then admitted in draw order (see
`BatchCollector`: admitting in completion order would bias the batch towards short responses). Once
the batch holds `train_batch_size` informative groups the requests still in flight are aborted. Every
prompt drawn past the batch is resolved first thing next step, in its place: a group that finished is
carried over, an aborted one is generated again, so no prompt is skipped and none is chosen by how
fast it finished. Batch-synchronous mode reproduces verl's recipe: generate `gen_batch_size` prompts,
wait for all of them, filter, truncate to the batch size, repeat.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dapo_megatron.algo.dynamic_sampling import BatchCollector
from dapo_megatron.records import Drawn, Prompt, Sample, ScoredGroup, ScoredSample
from dapo_megatron.rewards.pool import RewardItem, RewardPool
from dapo_megatron.rollout.client import RolloutClient, sample_seed
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.trainer.config import TrainerConfig


class PromptSource(Protocol):
    """An endless, resumable stream of prompts."""

    def __iter__(self) -> Iterator[Prompt]: ...
    def __next__(self) -> Prompt: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class UnfilledBatchError(RuntimeError):
    """Dynamic sampling ran out of generation rounds before the batch was full."""


class CollectCancelled(RuntimeError):
    """`RolloutManager.cancel` stopped a collection (from another thread) before its batch was complete."""


@dataclass
class _Stats:
    prompts: int = 0
    generated: int = 0
    aborted: int = 0
    skipped: int = 0
    reward_status: Counter[str] = field(default_factory=Counter)


class RolloutManager:
    def __init__(
        self,
        client: RolloutClient,
        rewards: RewardPool,
        prompts: PromptSource,
        *,
        rollout: RolloutConfig,
        trainer: TrainerConfig,
        decode: Callable[[list[int]], str],
        stop_token_ids: Sequence[int],
        progress: bool,
    ) -> None:
        self.client, self.rewards, self.prompts = client, rewards, prompts
        self.rollout, self.trainer = rollout, trainer
        self.decode, self.stop_token_ids, self.progress = decode, list(stop_token_ids), progress
        self.backlog: list[Drawn] = []
        """Prompts drawn past the previous batch (streaming mode), in draw order: the next batch resolves
        them before any fresh prompt. With a group: finished and informative (carried over); without:
        aborted, generated again."""
        self._cancelled = threading.Event()
        self._step_position = ""
        """The prompt stream's position when the current `collect` began (rollout.deterministic)."""

    def cancel(self) -> None:
        """Stop a `collect` running in another thread: no new requests, those in flight aborted; it then
        raises CollectCancelled. For shutting down while a batch is generated ahead."""
        self._cancelled.set()
        self.client.abort_all()

    def collect(self) -> tuple[list[ScoredGroup], dict[str, float]]:
        """The groups of the next training batch, and the rollout metrics."""
        started = time.perf_counter()
        if self.rollout.deterministic:
            # Stands for the step in the samples' seeds: it is what a checkpoint restores, so a resumed job
            # seeds its first step as the original run seeded that step.
            self._step_position = json.dumps(self.prompts.state_dict(), sort_keys=True, default=str)
        trainer, stats = self.trainer, _Stats()
        size = trainer.train_batch_size
        collector: BatchCollector[Drawn] = BatchCollector(size)
        if not trainer.dynamic_sampling:
            self._stream(self._draw(size), stats, lambda _, drawn: collector.take(drawn, drawn.accuracies))
        elif trainer.dynamic_sampling_mode == "streaming":
            self._fill_streaming(collector, stats)
        else:
            self._fill_batch_sync(collector, stats)
        rounds = -(-stats.prompts // trainer.gen_batch_size)
        if self._cancelled.is_set():
            raise CollectCancelled(f"collection cancelled after {stats.prompts} prompts")
        if not collector.full:
            message = (
                f"dynamic sampling collected {len(collector.kept)} of {size} informative groups from "
                f"{stats.prompts} prompts in {rounds} generation rounds (kept "
                f"{collector.metrics()['keep_ratio']:.0%} of the groups): the prompts are too easy or too "
                "hard for the policy. Raise trainer.max_gen_rounds or trainer.gen_batch_size, change the "
                "data, or set trainer.on_unfilled_batch=train"
            )
            if trainer.on_unfilled_batch == "error" or not collector.kept:
                raise UnfilledBatchError(message)
        groups = [drawn.group for drawn in collector.kept if drawn.group is not None]
        metrics = {f"dynamic_sampling/{k}": float(v) for k, v in collector.metrics().items()}
        metrics.update(
            {
                "dynamic_sampling/gen_rounds": float(rounds),
                "dynamic_sampling/samples_per_kept": stats.generated
                / max(sum(len(g.samples) for g in groups), 1),
                "dynamic_sampling/backlog_groups": float(sum(d.group is not None for d in self.backlog)),
                "dynamic_sampling/backlog_prompts": float(len(self.backlog)),
                "dynamic_sampling/skipped_prompts": float(stats.skipped),
                "rollout/aborted_samples": float(stats.aborted),
                "reward/timeouts": float(stats.reward_status["timeout"]),
                "reward/errors": float(stats.reward_status["error"]),
                "timing_s/gen": time.perf_counter() - started,
            }
        )
        return groups, metrics

    def _fill_streaming(self, collector: BatchCollector[Drawn], stats: _Stats) -> None:
        """The backlog in its places (carried groups placed, aborted prompts first in line), then fresh
        prompts until the batch is full; what was drawn past it becomes the next backlog."""
        trainer, regenerate = self.trainer, []
        for index, drawn in enumerate(self.backlog):
            if drawn.group is None:
                regenerate.append((index, drawn.prompt))
            else:
                collector.carry_in(index, drawn)
        fresh = self._draw(
            trainer.max_gen_rounds * trainer.gen_batch_size - len(regenerate), start=len(self.backlog)
        )
        not_generated = (
            dict(regenerate)
            if collector.full
            else self._stream(
                itertools.chain(regenerate, fresh),
                stats,
                lambda index, drawn: collector.offer(index, drawn, drawn.accuracies),
                stop=lambda: collector.full,
            )
        )
        unresolved = self._unresolved(collector.leftover(), not_generated)
        # Without carry-over nothing is kept, as in verl; past max_carry_groups the rest is skipped. Both cut
        # by position, never by what finished.
        self.backlog = unresolved[: trainer.max_carry_groups] if trainer.carry_over else []
        stats.skipped = len(unresolved) - len(self.backlog)

    def _fill_batch_sync(self, collector: BatchCollector[Drawn], stats: _Stats) -> None:
        """Rounds of `gen_batch_size` prompts, each generated to the end, until the batch is full; verl drops
        what does not fit."""
        numbered = self._draw(self.trainer.max_gen_rounds * self.trainer.gen_batch_size)
        for _ in range(self.trainer.max_gen_rounds):
            self._stream(
                itertools.islice(numbered, self.trainer.gen_batch_size),
                stats,
                lambda index, drawn: collector.offer(index, drawn, drawn.accuracies),
            )
            if collector.full:
                return

    def _draw(self, count: int, start: int = 0) -> Iterator[tuple[int, Prompt]]:
        """Up to `count` fresh prompts, numbered in draw order from `start` (drawn lazily)."""
        return zip(itertools.count(start), itertools.islice(self.prompts, max(count, 0)), strict=False)

    @staticmethod
    def _unresolved(leftover: dict[int, Drawn | None], aborted: dict[int, Prompt]) -> list[Drawn]:
        """The prompts drawn past a full batch that still count, in draw order: informative groups that
        finished (carried over) and aborted prompts (generated again)."""
        entries = {
            **{i: d for i, d in leftover.items() if d is not None},
            **{i: Drawn(p) for i, p in aborted.items()},
        }
        return [entries[i] for i in sorted(entries)]

    def _stream(
        self,
        prompts: Iterable[tuple[int, Prompt]],
        stats: _Stats,
        on_group: Callable[[int, Drawn], Any],
        stop: Callable[[], bool] = lambda: False,
    ) -> dict[int, Prompt]:
        """Generate the numbered prompts, score each group as it completes and hand it to `on_group` with its
        number; once `stop()` holds, abort what is in flight. Returns the prompts whose groups were aborted
        (counted as generated, never trained on)."""
        pending: dict[int, Prompt] = {}
        aborted: dict[int, Prompt] = {}

        def submit() -> Iterator[tuple[int, list[int]]]:
            # Keyed by draw number: a small dataset can put one prompt in flight twice.
            for index, prompt in prompts:
                if self._cancelled.is_set():
                    return
                pending[index] = prompt
                stats.prompts += 1
                yield index, prompt.ids

        def group_seed(index: int) -> int:  # asked as the group is submitted, while it is pending
            return sample_seed(self.rollout.seed, self._step_position, index, pending[index].uid)

        aborting = False
        n = self.rollout.n_samples_per_prompt
        for index, samples in self.client.stream_groups(
            submit(),
            n=n,
            stop_token_ids=self.stop_token_ids,
            progress=self.progress,
            progress_total=None,
            group_seed=group_seed if self.rollout.deterministic else None,
        ):
            prompt = pending.pop(index)
            stats.generated += len(samples)
            if any(s.finish_reason == "abort" for s in samples):
                stats.aborted += len(samples)
                aborted[index] = prompt
                continue
            on_group(index, Drawn(prompt, self._score(prompt, samples, stats)))
            if not aborting and stop():
                aborting = True
                self.client.abort_all()
        return aborted

    def _score(self, prompt: Prompt, samples: Sequence[Sample], stats: _Stats) -> ScoredGroup:
        results = self.rewards.score(
            [RewardItem(self.decode(s.output_ids), prompt.ground_truth, prompt.data_source) for s in samples]
        )
        stats.reward_status.update(r.status for r in results)
        scored = [
            ScoredSample(
                prompt_ids=list(s.prompt_ids),
                output_ids=list(s.output_ids),
                rollout_log_probs=list(s.logprobs),
                finish_reason=s.finish_reason,
                score=r.score,
                acc=r.acc,
                weight_version=s.weight_version,
            )
            for s, r in zip(samples, results, strict=True)
        ]
        return ScoredGroup(key=prompt.uid, samples=scored)
