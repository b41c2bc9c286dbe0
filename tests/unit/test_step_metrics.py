"""A training step's metrics and line (`trainer/step_metrics.StepLog`), on a clock the test sets: what goes
into metrics.jsonl and in which order, the throughput per device, the offload and generation-wait timings
only under the settings that make them, and the step line's elapsed time, ETA and latest evaluation."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dapo_megatron import config as job_config
from dapo_megatron.config import JobConfig
from dapo_megatron.metrics import MetricsLogger
from dapo_megatron.trainer import step_metrics
from dapo_megatron.trainer.fleet import SyncReport
from dapo_megatron.trainer.step_metrics import StepLog

ROLLOUT = {
    "critic/score/mean": 0.25,
    "rollout/accuracy": 0.625,
    "response_length/mean": 10.5,
    "timing_s/gen": 1.0,
}
BATCH = {"perf/total_num_tokens": 800.0}
TRAIN = {
    "actor/pg_loss": 0.001,
    "actor/pg_clipfrac": 0.004,
    "actor/grad_norm": 2.0,
    "timing_s/update_actor": 2.0,
}
SYNC = SyncReport(seconds=0.5, offload_seconds=0.25, probe_gap=None)
EVALUATION = {"val-core/math_dapo/acc/mean@1": 0.4}


def job_with(**trainer: Any) -> JobConfig:
    job = job_config.to_job_config(job_config.compose(["experiment=demo", "trainer.total_steps=10"]))
    return dataclasses.replace(job, trainer=dataclasses.replace(job.trainer, **trainer))


class Clock:
    """`time.perf_counter` for the module under test: the times it is set to, one per call."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self) -> float:
        return self.times.pop(0)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    clock = Clock()
    monkeypatch.setattr(step_metrics, "time", SimpleNamespace(perf_counter=clock))
    # The GPU-only parts answer the same on any machine; `updated` is checked to pass them on.
    monkeypatch.setattr(step_metrics, "actor_peak_tflops", lambda job, backend: 989.0)
    monkeypatch.setattr(
        step_metrics,
        "actor_perf",
        lambda job, rows, seconds, layout, peak: {"perf/mfu/actor": seconds * layout.world_size / peak},
    )
    yield clock
    assert clock.times == [], "the step log read the clock fewer times than expected"


def records(tmp_path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "dapo_megatron"]


def test_a_step_generated_ahead_logs_its_wait_and_the_throughput_per_device(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dapo_megatron")
    layout = SimpleNamespace(world_size=2, is_logging_rank=True, device=torch.device("cpu"))
    job = job_with(overlap_rollout=True, offload_during_rollout=False)
    with MetricsLogger(tmp_path, enabled=True, loggers=["jsonl"]) as metrics:
        clock.times = [100.0]  # the loop starts
        log = StepLog(job, layout, metrics, first_step=0, process_started=90.0)
        clock.times = [101.0]
        log.start_step()
        train = log.updated(None, dict(TRAIN))
        assert train == {**TRAIN, "perf/mfu/actor": 2.0 * 2 / 989.0}
        clock.times = [105.0, 105.0]  # the step's time, then the line's
        logged = log.finish(1, ROLLOUT, BATCH, train, SYNC, 0.125, 0.75)
    assert records(tmp_path) == [{"step": 1, **logged}]
    assert list(logged) == [
        *ROLLOUT,
        *BATCH,
        *train,
        "timing_s/update_weights",
        "timing_s/gen_wait",
        "timing_s/step",
        "perf/throughput",
    ]
    assert logged["timing_s/update_weights"] == 0.5 and logged["timing_s/gen_wait"] == 0.75
    assert logged["timing_s/step"] == 4.0
    assert logged["perf/throughput"] == 800.0 / (4.0 * 2)  # tokens per second and device
    # Elapsed since the process started (15 s); ETA: 5 s per step since the loop started, 9 steps to go.
    assert lines(caplog) == [
        "step 1/10 | score 0.250 | acc 0.625 | keep 1.000 | rounds 1 | resp_len 10.500 | pg_loss 0.001 | "
        "clipfrac 0.004 | entropy 0.000 | grad_norm 2.000 | t 4.0s (gen 1.0 wait 0.8 train 2.0 sync 0.5) | "
        "elapsed 15s | eta 45s"
    ]


def test_an_offloading_resumed_run_logs_the_offload_and_keeps_its_latest_evaluation(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dapo_megatron")
    layout = SimpleNamespace(world_size=1, is_logging_rank=True, device=torch.device("cpu"))
    job = job_with(overlap_rollout=False, offload_during_rollout=True)
    with MetricsLogger(tmp_path, enabled=True, loggers=["jsonl"]) as metrics:
        clock.times = [0.0]
        log = StepLog(  # resumed after step 4, evaluated before it at step 4
            job, layout, metrics, first_step=4, process_started=-30.0, last_eval=(4, 0.3)
        )
        for step, evaluation, ends in [(5, None, 10.0), (6, EVALUATION, 20.0), (7, {}, 30.0)]:
            clock.times = [ends - 10.0]
            log.start_step()
            clock.times = [ends, ends]
            logged = log.finish(step, ROLLOUT, BATCH, TRAIN, SYNC, 0.125, 0.75, evaluation)
            assert "timing_s/gen_wait" not in logged
            assert logged["timing_s/offload"] == 0.125 + 0.25  # back before the update, out in the sync
            assert logged["timing_s/step"] == 10.0
    written = records(tmp_path)
    assert [record["step"] for record in written] == [5, 6, 7]
    assert written[1]["val-core/math_dapo/acc/mean@1"] == 0.4
    assert (
        "val-core/math_dapo/acc/mean@1" not in written[0]
        and "val-core/math_dapo/acc/mean@1" not in written[2]
    )
    shown = [line.split(" | t ")[0].split(" | ")[-1] for line in lines(caplog)]
    # An evaluation a stop request cut short (empty) leaves the line on the latest complete one.
    assert shown == ["eval_acc 0.300 (step 4)", "eval_acc 0.400", "eval_acc 0.400 (step 6)"]
    # 10 s per step since the loop started (three steps after step 4), 3 steps to go.
    assert [line.split(" | ")[-2:] for line in lines(caplog)] == [
        ["elapsed 40s", "eta 50s"],
        ["elapsed 50s", "eta 40s"],
        ["elapsed 1m00s", "eta 30s"],
    ]


def test_other_ranks_log_their_metrics_without_a_line(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dapo_megatron")
    layout = SimpleNamespace(world_size=2, is_logging_rank=False, device=torch.device("cpu"))
    with MetricsLogger(tmp_path, enabled=True, loggers=["jsonl"]) as metrics:
        clock.times = [0.0]
        log = StepLog(job_with(), layout, metrics, first_step=0, process_started=0.0)
        clock.times = [0.0, 2.0]  # no clock read for a line
        log.start_step()
        logged = log.finish(1, ROLLOUT, BATCH, TRAIN, SYNC, 0.0, 0.0)
    assert "timing_s/offload" not in logged and "timing_s/gen_wait" not in logged
    assert records(tmp_path) == [{"step": 1, **logged}]
    assert lines(caplog) == []
