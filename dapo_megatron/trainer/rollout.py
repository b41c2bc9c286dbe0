"""Collect one training batch: generate, score, filter (DAPO's dynamic sampling), on the driving rank.

Streaming mode: prompts go to the engine as request slots free up; each prompt group is scored the
moment its G samples are done and judged by raw accuracy; once the batch holds `train_batch_size`
informative groups the requests still in flight are aborted, and informative groups that finished in
the meantime are carried over to the next step. Batch-synchronous mode reproduces verl's recipe:
generate `gen_batch_size` prompts, wait for all of them, filter, truncate to the batch size, repeat.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dapo_megatron.algo.dynamic_sampling import BatchCollector
from dapo_megatron.rewards.pool import RewardItem, RewardPool
from dapo_megatron.rollout.client import RolloutClient, Sample
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.trainer.batch import ScoredGroup, ScoredSample
from dapo_megatron.trainer.config import TrainerConfig


@dataclass(frozen=True)
class Prompt:
    uid: str
    ids: list[int]
    ground_truth: str
    data_source: str


class PromptSource(Protocol):
    """An endless, resumable stream of prompts."""

    def __iter__(self) -> Iterator[Prompt]: ...
    def __next__(self) -> Prompt: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class UnfilledBatchError(RuntimeError):
    """Dynamic sampling ran out of generation rounds before the batch was full."""


@dataclass
class _Stats:
    prompts: int = 0
    generated: int = 0
    aborted: int = 0
    reward_status: Counter[str] = field(default_factory=Counter)


class RolloutManager:
    def __init__(self, client: RolloutClient, rewards: RewardPool, prompts: PromptSource, *,
                 rollout: RolloutConfig, trainer: TrainerConfig, decode: Callable[[list[int]], str],
                 stop_token_ids: Sequence[int], progress: bool) -> None:
        self.client, self.rewards, self.prompts = client, rewards, prompts
        self.rollout, self.trainer = rollout, trainer
        self.decode, self.stop_token_ids, self.progress = decode, list(stop_token_ids), progress
        self.carry: list[ScoredGroup] = []
        """Informative groups generated after the previous batch filled up (streaming mode)."""

    def collect(self) -> tuple[list[ScoredGroup], dict[str, float]]:
        """The groups of the next training batch, and the rollout metrics."""
        started = time.perf_counter()
        trainer, stats = self.trainer, _Stats()
        size = trainer.train_batch_size
        if not trainer.dynamic_sampling:
            collector = BatchCollector(size)
            self._stream(size, stats, lambda _, group: collector.kept.append(group))
        elif trainer.dynamic_sampling_mode == "streaming":
            collector = BatchCollector(size, carry=self.carry, max_carry=trainer.max_carry_groups)
            self._stream(trainer.max_gen_rounds * trainer.gen_batch_size, stats,
                         lambda _, group: collector.offer(group, group.accuracies), stop=lambda: collector.full)
            self.carry = collector.next_carry() if trainer.carry_over else []
        else:  # batch_sync: judge each round's groups in submission order, so the batch is reproducible
            collector = BatchCollector(size)
            for _ in range(trainer.max_gen_rounds):
                finished: dict[int, ScoredGroup] = {}
                self._stream(trainer.gen_batch_size, stats, finished.__setitem__)
                for index in sorted(finished):
                    collector.offer(finished[index], finished[index].accuracies)
                if collector.full:
                    break
            collector.surplus.clear()  # verl drops what does not fit
        rounds = -(-stats.prompts // trainer.gen_batch_size)
        if not collector.full:
            message = (f"dynamic sampling collected {len(collector.kept)} of {size} informative groups from "
                       f"{stats.prompts} prompts in {rounds} generation rounds (kept "
                       f"{collector.metrics()['keep_ratio']:.0%} of the groups): the prompts are too easy or too "
                       "hard for the policy. Raise trainer.max_gen_rounds or trainer.gen_batch_size, change the "
                       "data, or set trainer.on_unfilled_batch=train")
            if trainer.on_unfilled_batch == "error" or not collector.kept:
                raise UnfilledBatchError(message)
        groups = collector.kept[:size]
        metrics = {f"dynamic_sampling/{k}": float(v) for k, v in collector.metrics().items()}
        metrics.update({
            "dynamic_sampling/gen_rounds": float(rounds),
            "dynamic_sampling/samples_per_kept": stats.generated / max(sum(len(g.samples) for g in groups), 1),
            "rollout/aborted_samples": float(stats.aborted),
            "reward/timeouts": float(stats.reward_status["timeout"]),
            "reward/errors": float(stats.reward_status["error"]),
            "timing_s/gen": time.perf_counter() - started,
        })
        return groups, metrics

    def _stream(self, limit: int, stats: _Stats, on_group: Callable[[int, ScoredGroup], Any],
                stop: Callable[[], bool] = lambda: False) -> None:
        """Generate up to `limit` prompt groups, score each as it completes and hand it to `on_group`
        with its submission index; once `stop()` holds, abort what is in flight (aborted groups are
        counted, never trained on)."""
        pending: dict[int, Prompt] = {}

        def prompts() -> Iterator[tuple[int, list[int]]]:
            # Keyed by submission index: a small dataset can put one prompt in flight twice.
            for prompt in itertools.islice(self.prompts, limit):
                pending[stats.prompts] = prompt
                stats.prompts += 1
                yield stats.prompts - 1, prompt.ids

        aborting = False
        n = self.rollout.n_samples_per_prompt
        for index, samples in self.client.stream_groups(prompts(), n=n, stop_token_ids=self.stop_token_ids,
                                                        progress=self.progress, progress_total=limit * n):
            prompt = pending.pop(index)
            stats.generated += len(samples)
            if any(s.finish_reason == "abort" for s in samples):
                stats.aborted += len(samples)
                continue
            on_group(index, self._score(prompt, samples, stats))
            if not aborting and stop():
                aborting = True
                self.client.abort_all()

    def _score(self, prompt: Prompt, samples: Sequence[Sample], stats: _Stats) -> ScoredGroup:
        results = self.rewards.score([RewardItem(self.decode(s.output_ids), prompt.ground_truth, prompt.data_source)
                                      for s in samples])
        stats.reward_status.update(r.status for r in results)
        scored = [ScoredSample(prompt_ids=list(s.prompt_ids), output_ids=list(s.output_ids),
                               rollout_log_probs=list(s.logprobs), finish_reason=s.finish_reason,
                               score=r.score, acc=r.acc) for s, r in zip(samples, results, strict=True)]
        return ScoredGroup(key=prompt.uid, samples=scored)
