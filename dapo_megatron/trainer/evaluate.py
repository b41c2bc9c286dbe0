"""Held-out evaluation with the rollout engine: k samples per problem, avg@k and pass@k.

DAPO reports AIME 2024 avg@32 at temperature 1.0, top_p 0.7: the mean accuracy over 32 samples of each
of the 30 problems. pass@k is the share of problems with at least one correct sample. Problems from several
data sources (several eval files) are also reported per source, under `eval/<data_source>/...`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from dapo_megatron.records import Prompt
from dapo_megatron.rewards.pool import RewardItem, RewardPool
from dapo_megatron.rollout.client import RolloutClient, sample_seed
from dapo_megatron.trainer.config import EvalConfig


@dataclass(frozen=True)
class ProblemOutcome:
    """One problem's k samples, scored."""

    data_source: str
    correct: int
    """Samples graded correct."""
    response_lengths: tuple[int, ...]


def evaluate(
    client: RolloutClient,
    problems: Sequence[Prompt],
    rewards: RewardPool,
    cfg: EvalConfig,
    *,
    decode: Callable[[list[int]], str],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    progress: bool = False,
) -> dict[str, float]:
    """`eval_metrics` of the problems, plus the time taken. With rollout.deterministic (the client's config)
    sample i of problem j is seeded from (seed, j, uid, i): every evaluation draws the same random numbers."""
    started = time.perf_counter()
    k = cfg.samples_per_problem
    by_index = dict(enumerate(problems))

    def group_seed(index: Hashable) -> int:
        return sample_seed(client.cfg.seed, "eval", index, by_index[index].uid)

    outcomes: list[ProblemOutcome] = []
    for index, samples in client.stream_groups(
        ((i, p.ids) for i, p in by_index.items()),
        n=k,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        progress=progress,
        progress_total=len(problems) * k,
        group_seed=group_seed if client.cfg.deterministic else None,
    ):
        problem = by_index[index]
        results = rewards.score(
            [RewardItem(decode(s.output_ids), problem.ground_truth, problem.data_source) for s in samples]
        )
        outcomes.append(
            ProblemOutcome(
                problem.data_source, sum(r.acc for r in results), tuple(len(s.output_ids) for s in samples)
            )
        )
    return {**eval_metrics(outcomes, k), "timing_s/eval": time.perf_counter() - started}


def eval_metrics(outcomes: Sequence[ProblemOutcome], k: int) -> dict[str, float]:
    """avg@k (`eval/accuracy`: the mean accuracy over all samples), pass@k and the mean response length; for
    problems from more than one data source also per source, as `eval/<data_source>/accuracy` etc."""
    sources = sorted({o.data_source for o in outcomes})
    metrics = _summary("eval", outcomes, k)
    if len(sources) > 1:
        for source in sources:
            metrics.update(_summary(f"eval/{source}", [o for o in outcomes if o.data_source == source], k))
    return metrics


def _summary(prefix: str, outcomes: Sequence[ProblemOutcome], k: int) -> dict[str, float]:
    lengths = [n for o in outcomes for n in o.response_lengths]
    return {
        f"{prefix}/accuracy": sum(o.correct for o in outcomes) / (k * len(outcomes)),
        f"{prefix}/pass@{k}": sum(o.correct > 0 for o in outcomes) / len(outcomes),
        f"{prefix}/response_length": sum(lengths) / len(lengths),
    }
