"""bench/trainer_runs.py's job runner, on jobs that stop at their config check (a run that trains is the
benchmarks' own business: far too slow for a test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import load_bench_script

runs = load_bench_script("trainer_runs")


def test_a_job_starts_in_an_empty_folder_so_an_earlier_runs_metrics_are_never_read_as_its_own(
    tmp_path: Path,
) -> None:
    out = tmp_path / "ours_large_overlap_seed0"
    stale = out / "tensorboard" / "metrics.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"step": 1, "timing_s/step": 1.0}\n')
    (out / "checkpoints").mkdir()
    with pytest.raises(RuntimeError, match=r"exited with 2(.|\n)*no_such_key"):
        runs.train_run(["trainer.no_such_key=1"], out, timeout=300)
    assert sorted(p.name for p in out.iterdir()) == ["train.log"]
