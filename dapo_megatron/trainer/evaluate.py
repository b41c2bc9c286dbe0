"""Held-out evaluation with the rollout engine: k samples per problem, avg@k and pass@k.

DAPO reports AIME 2024 avg@32 at temperature 1.0, top_p 0.7: the mean accuracy over 32 samples of each
of the 30 problems. pass@k is the share of problems with at least one correct sample. Both are reported per
data source under verl's validation names (`eval_metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
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
    return {**eval_metrics(outcomes, k), "timing_s/testing": time.perf_counter() - started}


OVERALL = "all"
"""The data-source name of the summary over every problem, written when there are several sources."""


def eval_metrics(outcomes: Sequence[ProblemOutcome], k: int) -> dict[str, float]:
    """Per data source, as verl names its validation metrics: `val-core/<data_source>/acc/mean@k` (avg@k: the
    mean accuracy over all samples), for k > 1 `val-core/<data_source>/acc/best@k/mean` (pass@k: the share of
    problems with a correct sample, exact where verl estimates it by bootstrap) and
    `val-aux/<data_source>/response_length/mean@k`. With several sources also over all problems, under
    `val-aux/all/...`."""
    sources = sorted({o.data_source for o in outcomes})
    metrics: dict[str, float] = {}
    for source in sources:
        metrics.update(_summary("val-core", source, [o for o in outcomes if o.data_source == source], k))
    if len(sources) > 1:
        metrics.update(_summary("val-aux", OVERALL, outcomes, k))
    return metrics


def _summary(section: str, source: str, outcomes: Sequence[ProblemOutcome], k: int) -> dict[str, float]:
    lengths = [n for o in outcomes for n in o.response_lengths]
    metrics = {f"{section}/{source}/acc/mean@{k}": sum(o.correct for o in outcomes) / (k * len(outcomes))}
    if k > 1:
        solved = sum(o.correct > 0 for o in outcomes)
        metrics[f"{section}/{source}/acc/best@{k}/mean"] = solved / len(outcomes)
    metrics[f"val-aux/{source}/response_length/mean@{k}"] = sum(lengths) / len(lengths)
    return metrics


def eval_accuracy(metrics: Mapping[str, float]) -> float | None:
    """avg@k over every evaluated problem, from `eval_metrics`' names; None without an evaluation."""
    means = {name: v for name, v in metrics.items() if name.startswith("val-") and "/acc/mean@" in name}
    overall = [v for name, v in means.items() if name.startswith(f"val-aux/{OVERALL}/")]
    if overall:
        return overall[0]
    return next(iter(means.values()), None)


def by_source(metrics: Mapping[str, float], k: int) -> dict[str, dict[str, float]]:
    """`eval_metrics` regrouped: data source (`all` for the summary over several) -> `avg` (avg@k), `pass`
    (pass@k, for k > 1) and `response_length`."""
    fields = {
        f"acc/mean@{k}": "avg",
        f"acc/best@{k}/mean": "pass",
        f"response_length/mean@{k}": "response_length",
    }
    grouped: dict[str, dict[str, float]] = {}
    for name, value in metrics.items():
        section, _, rest = name.partition("/")
        source, _, field = rest.partition("/")
        if section in ("val-core", "val-aux") and field in fields:
            grouped.setdefault(source, {})[fields[field]] = value
    return grouped
