"""A bounded sample of the fault-injection suite (bench/faults.py; the full run injects each fault ten times):
the reward faults once each, and one real job (real megatron-core, real SGLang on CPU) SIGKILLed while it
writes a checkpoint, whose resume must skip a damaged newest checkpoint, with nothing of the job left
behind."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.conftest import REPO, load_bench_script

pytestmark = [pytest.mark.faults, pytest.mark.sglang, pytest.mark.slow]

faults = load_bench_script("faults")

QUICK_BASE = [
    "warmup.max_steps=2",
    "warmup.eval_every=1",
    "warmup.eval_size=4",
    "warmup.batch_size=8",
    "warmup.micro_batch_size=8",
]
"""A base that has barely learned the format is enough to be killed and resumed: seconds to build."""


def test_a_hanging_or_crashing_scorer_and_hostile_answers_cost_nothing(tmp_path: Path) -> None:
    outcomes = faults.run_cheap(faults.CHEAP_FAULTS, repeats=1, seed=0, work=tmp_path)
    summary = faults.summarize(outcomes)
    assert summary["faults_injected"] == summary["recovered"] == 2, [o.detail for o in outcomes]
    assert summary["false_rewards"] == 0
    assert summary["orphans_left"] == summary["shm_left"] == summary["temp_left"] == 0, outcomes


def test_killed_while_checkpointing_the_job_resumes_past_a_damaged_checkpoint(tmp_path: Path) -> None:
    base = faults.ensure_base(tmp_path / "base", QUICK_BASE)
    plan = [("kill_checkpoint", False), ("sigterm_stop", True)]  # damage the newest before the resume
    lines: list[str] = []
    outcomes = faults.run_chain(
        plan,
        tmp_path,
        base,
        REPO,
        random.Random(0),  # aims at the second step's save: a first checkpoint is there to damage
        report=lines.append,
        # Barely trained, the base may solve no prompt at all: every sampled group is trained on.
        overrides=["trainer.dynamic_sampling=false"],
    )
    by_kind = {o.kind: o for o in outcomes}
    assert set(by_kind) == {"kill_checkpoint", "corrupt_checkpoint", "sigterm_stop"}, lines
    assert all(o.injected and o.recovered for o in outcomes), lines
    assert sum(o.orphans + o.shm_left + o.temp_left for o in outcomes) == 0, lines
    assert sum(o.checkpoints_lost for o in outcomes) == 0, lines
