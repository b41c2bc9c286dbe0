"""Held-out evaluation with the rollout engine: k samples per problem, avg@k and pass@k.

DAPO reports AIME 2024 avg@32 at temperature 1.0, top_p 0.7: the mean accuracy over 32 samples of each
of the 30 problems. pass@k is the share of problems with at least one correct sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from dapo_megatron.rewards.pool import RewardItem, RewardPool
from dapo_megatron.rollout.client import RolloutClient
from dapo_megatron.trainer.config import EvalConfig
from dapo_megatron.trainer.rollout import Prompt


def evaluate(client: RolloutClient, problems: Sequence[Prompt], rewards: RewardPool, cfg: EvalConfig, *,
             decode: Callable[[list[int]], str], max_new_tokens: int, stop_token_ids: Sequence[int],
             progress: bool = False) -> dict[str, float]:
    started = time.perf_counter()
    k = cfg.samples_per_problem
    by_index = dict(enumerate(problems))
    correct_per_problem: list[int] = []
    lengths: list[int] = []
    for index, samples in client.stream_groups(
            ((i, p.ids) for i, p in by_index.items()), n=k, temperature=cfg.temperature, top_p=cfg.top_p,
            max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, progress=progress,
            progress_total=len(problems) * k):
        problem = by_index[index]
        results = rewards.score([RewardItem(decode(s.output_ids), problem.ground_truth, problem.data_source)
                                 for s in samples])
        correct_per_problem.append(sum(r.acc for r in results))
        lengths.extend(len(s.output_ids) for s in samples)
    return {
        "eval/accuracy": sum(correct_per_problem) / (k * len(problems)),
        f"eval/pass@{k}": sum(c > 0 for c in correct_per_problem) / len(problems),
        "eval/response_length": sum(lengths) / len(lengths),
        "timing_s/eval": time.perf_counter() - started,
    }
