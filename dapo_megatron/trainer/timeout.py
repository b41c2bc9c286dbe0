"""The collective timeout, sized from the recipe.

While the driving rank generates (a rollout step: up to `trainer.max_gen_rounds` rounds; an evaluation),
the other ranks wait in a collective for its result. A timeout shorter than that wait kills a healthy job
on its longest step, so the timeout is the longest the driver can take before the rollout client's own
request timeout fires (`rollout.request_timeout_s`, by default derived from the response budget:
`RolloutConfig.resolved_request_timeout_s`), plus `parallel.timeout_minutes` for everything else. A crashed
rank is still seen at once (torchrun stops the job when a process exits); only a rank that hangs inside a
collective takes this long to be reported.
"""

from __future__ import annotations

import datetime
import math

from dapo_megatron import backends
from dapo_megatron.backends.base import Backend
from dapo_megatron.config import JobConfig
from dapo_megatron.trainer.placement import engine_placement


def generation_bound_s(
    prompts: int,
    samples_per_prompt: int,
    engines: int,
    max_concurrent_requests: int,
    request_timeout_s: float,
) -> float:
    """The longest `RolloutClient.stream_groups` of `prompts` groups can take: it keeps
    `max(1, max_concurrent_requests // samples_per_prompt)` groups in flight per engine, and each group's
    request fails after `request_timeout_s`, so at most ceil(prompts / in flight) request lifetimes."""
    in_flight = max(1, max_concurrent_requests // samples_per_prompt) * engines
    return math.ceil(prompts / in_flight) * request_timeout_s


def collective_timeout(job: JobConfig, world_size: int, backend: Backend | None = None) -> datetime.timedelta:
    """`parallel.timeout_minutes` plus the longest generation the other ranks may wait for in one collective
    (a rollout step's rounds, then an evaluation when `eval.every` is set). `backend` (default: this
    machine's) sets how many engines serve the rollouts."""
    rollout, trainer = job.rollout, job.trainer
    engines = engine_placement(world_size, rollout, backend or backends.detect()).num_engines
    wait_s = trainer.max_gen_rounds * generation_bound_s(
        trainer.gen_batch_size,
        rollout.n_samples_per_prompt,
        engines,
        rollout.max_concurrent_requests,
        rollout.resolved_request_timeout_s,
    )
    if job.eval.every:
        wait_s += generation_bound_s(
            job.eval.num_problems,
            job.eval.samples_per_problem,
            engines,
            rollout.max_concurrent_requests,
            rollout.resolved_request_timeout_s,
        )
    return datetime.timedelta(minutes=job.parallel.timeout_minutes, seconds=wait_s)
